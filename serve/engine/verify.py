"""The one place the engine calls verification: Triton kernels on CUDA, PyTorch references on CPU.

Switching implementation is the ``backend`` argument ("auto" = kernel on CUDA, reference on CPU,
where Triton would need its slow interpreter). Tree verification has no kernel yet: it runs the
reference in :mod:`eagleray.serve.engine.tree`.
"""

from __future__ import annotations

import torch

from eagleray.kernels.verify_chain import verify_chain as chain_kernel
from eagleray.kernels.verify_chain import verify_chain_reference
from eagleray.kernels.verify_reduced import t2d_index, verify_chain_reduced, verify_chain_reduced_reference


def use_kernel(backend: str, device: torch.device) -> bool:
    return backend == "kernel" or (backend == "auto" and device.type == "cuda")


class ChainVerifier:
    """Chain verification; caches the draft's target->draft index for the reduced-vocab kernel."""

    def __init__(self, backend: str = "auto", d2t: torch.Tensor | None = None, vocab_size: int | None = None):
        self.backend = backend
        self.d2t = d2t  # [Vd] int64 offsets (draft id -> target id)
        self._t2d = None if d2t is None or vocab_size is None else t2d_index(d2t, vocab_size)  # [V] int32

    def __call__(self, target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 temperature: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """target_logits [B, K+1, V] fp32, draft_tokens [B, K] int64 target ids, draft_probs [B, K, Vd] or None,
        temperature [B] f32, seed [B] i64 -> tokens [B, K+1] (padded -1), num_accepted [B]."""
        all_greedy = bool((temperature == 0).all())
        kernel = use_kernel(self.backend, target_logits.device)
        if draft_probs is None or all_greedy:
            if kernel:
                return chain_kernel(target_logits, draft_tokens, None, temperature=temperature, seed=seed, all_greedy=all_greedy)
            return verify_chain_reference(target_logits, draft_tokens, None, temperature=temperature, seed=seed)
        if kernel:
            return verify_chain_reduced(target_logits, draft_tokens, draft_probs.contiguous(), self.d2t,
                                        temperature=temperature, seed=seed, t2d=self._t2d)
        return verify_chain_reduced_reference(target_logits, draft_tokens, draft_probs, self.d2t,
                                              temperature=temperature, seed=seed)
