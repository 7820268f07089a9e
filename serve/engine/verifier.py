"""The one place the engine calls verification: Triton kernels on CUDA, PyTorch references on CPU.

Switching implementation is the ``backend`` argument ("auto" = kernel on CUDA, reference on CPU,
where Triton would need its slow interpreter). Everything comes from the public kernel module
:mod:`eagleray.kernels.verify`; the references there draw the same random numbers as the kernels.
"""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_decode
from eagleray.kernels.verify import (
    t2d_index,
    verify_chain,
    verify_chain_greedy,
    verify_chain_reduced,
    verify_chain_reduced_reference,
    verify_chain_reference,
    verify_tree,
    verify_tree_greedy_host,
    verify_tree_reference,
)
from eagleray.serve.engine.tree import DraftTree


def use_kernel(backend: str, device: torch.device) -> bool:
    return backend == "kernel" or (backend == "auto" and device.type == "cuda")


class Verifier:
    """Verification of a speculative step, chain (:meth:`chain`) or tree (:meth:`tree`); caches the draft's
    target->draft index for the reduced-vocab kernel."""

    def __init__(self, backend: str = "auto", d2t: torch.Tensor | None = None, vocab_size: int | None = None):
        self.backend = backend
        self.d2t = d2t  # [Vd] int64 offsets (draft id -> target id)
        self._t2d = None if d2t is None or vocab_size is None else t2d_index(d2t, vocab_size)  # [V] int32

    def chain(
        self,
        target_logits: torch.Tensor,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        all_greedy: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """target_logits [B, K+1, V] fp32, draft_tokens [B, K] int64 target ids, draft_probs [B, K, Vd] or None,
        temperature [B] f32, seed [B] i64 -> tokens [B, K+1] (padded -1), num_accepted [B]. ``all_greedy``: whether
        every temperature is 0, if the caller knows it on the host (else read from ``temperature``)."""
        if all_greedy is None:
            all_greedy = bool((temperature == 0).all())
        kernel = use_kernel(self.backend, target_logits.device)
        if draft_probs is None or all_greedy:
            if kernel:
                return verify_chain(target_logits, draft_tokens, None, temperature=temperature, seed=seed, all_greedy=all_greedy)
            if all_greedy:  # no softmax over the vocabulary, no random draws: one argmax per row
                return verify_chain_greedy(target_logits, draft_tokens)
            return verify_chain_reference(target_logits, draft_tokens, None, temperature=temperature, seed=seed)
        if kernel:
            return verify_chain_reduced(
                target_logits, draft_tokens, draft_probs.contiguous(), self.d2t, temperature=temperature, seed=seed, t2d=self._t2d
            )
        return verify_chain_reduced_reference(
            target_logits, draft_tokens, draft_probs, self.d2t, temperature=temperature, seed=seed
        )

    def chain_greedy(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy chain verification that reads nothing back to the host (a CUDA graph captures it):
        target_logits [B, K+1, V] fp32, draft_tokens [B, K] -> tokens [B, K+1] (-1 padded), num_accepted [B]."""
        if not use_kernel(self.backend, target_logits.device):
            return verify_chain_greedy(target_logits, draft_tokens)
        b, dev = target_logits.shape[0], target_logits.device
        temperature = torch.zeros(b, dtype=torch.float32, device=dev)  # [B]
        seed = torch.zeros(b, dtype=torch.int64, device=dev)  # [B]
        return verify_chain(target_logits, draft_tokens, None, temperature=temperature, seed=seed, all_greedy=True)

    def tree(
        self,
        logits: list[torch.Tensor],
        trees: list[DraftTree],
        temperature: torch.Tensor,
        seed: torch.Tensor,
        all_greedy: bool = False,
    ) -> list[tuple[list[int], list[int]]]:
        """Per sequence logits [M_b+1, V] (filtered) and tree -> (path node ids incl. root 0, emitted tokens).
        ``all_greedy``: every row's temperature is 0 (the caller knows it on the host): on CPU each tree is walked on
        the host over its rows' argmaxes (:func:`verify_tree_greedy_host`).

        The engine's trees number nodes 1..M with parent 0 = root; the kernels number them 0..N-1 with
        parent -1 = root, so parents shift by one and rows are padded to the largest tree (token -1).
        """
        dev = logits[0].device
        if all_greedy and not use_kernel(self.backend, dev):
            return [self._tree_greedy_host(row, t) for row, t in zip(logits, trees)]
        bsz, n = len(trees), max(t.size for t in trees)
        vocab = logits[0].shape[-1]
        p = torch.zeros((bsz, n + 1, vocab), dtype=torch.float32, device=dev)  # [B, N+1, V]
        tokens = torch.full((bsz, n), -1, dtype=torch.int64, device=dev)  # [B, N]
        parents = torch.full((bsz, n), -1, dtype=torch.int64, device=dev)  # [B, N]
        for b, (row, t) in enumerate(zip(logits, trees)):
            p[b, : t.size + 1] = row
            tokens[b, : t.size] = t.tokens.to(dev)
            parents[b, : t.size] = t.parents.to(dev) - 1
        fn = verify_tree if use_kernel(self.backend, dev) else verify_tree_reference
        out, nacc, path = fn(p, tokens, parents, temperature=temperature.to(dev), seed=seed.to(dev))
        result = []
        for b in range(bsz):
            k = int(nacc[b])
            result.append(([0] + (path[b, :k] + 1).tolist(), out[b, : k + 1].tolist()))
        return result

    @staticmethod
    def _tree_greedy_host(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], list[int]]:
        """logits [M+1, V] of one tree (engine numbering) -> (path incl. root 0, emitted tokens)."""
        arg = cpu_decode.argmax_last(logits).tolist()  # [M+1]
        toks, path = verify_tree_greedy_host(arg, tree.tokens.tolist(), [p - 1 for p in tree.parents.tolist()])
        return [0] + [i + 1 for i in path], toks
