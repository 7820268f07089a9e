"""Chain verification with draft probabilities over a reduced draft vocabulary (EAGLE-3 `d2t`).

An EAGLE-3 draft predicts over Vd (e.g. 32k) ids; `d2t[i]` is the OFFSET to the target id:
target_id = i + d2t[i] (the checkpoint format vLLM and SpecForge use). q over the target vocab is
q_t(i + d2t[i]) = q_d(i) and 0 for target ids outside the draft vocab; it is never expanded:
the kernels reach q_d through a [V] int32 target->draft index (`t2d_index`, -1 = not in the
draft vocab), built once per checkpoint. Semantics are exactly `verify_chain`'s with that q, and the
same random draws, so the result equals the full-vocab reference run on the expanded q.
"""

from __future__ import annotations

import torch

from eagleray.kernels.errors import VerifyInputError
from eagleray.kernels.verify_chain import launch_chain, verify_chain_reference
from eagleray.kernels.verify_common import Q_REDUCED, LaunchConfig, check_common, check_tensor, pick_config


def t2d_index(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V] int32 draft id of each target id (-1 if the target id is not in the draft vocab)."""
    draft_ids = torch.arange(d2t.shape[0], device=d2t.device)  # [Vd]
    index = torch.full((vocab,), -1, dtype=torch.int32, device=d2t.device)  # [V]
    index[draft_ids + d2t] = draft_ids.to(torch.int32)
    return index


def expand_draft_probs(draft_probs: torch.Tensor, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, K, Vd] -> [B, K, V] (reference and tests only: this is what the kernel avoids)."""
    full = draft_probs.new_zeros((*draft_probs.shape[:-1], vocab))  # [B, K, V]
    full[..., torch.arange(d2t.shape[0], device=d2t.device) + d2t] = draft_probs
    return full


def verify_chain_reduced_reference(target_logits, draft_tokens, draft_probs, d2t, *, temperature, seed):
    """PyTorch reference: expand q to the target vocab and run the chain reference."""
    q_full = expand_draft_probs(draft_probs.float(), d2t, target_logits.shape[-1])
    return verify_chain_reference(target_logits, draft_tokens, q_full, temperature=temperature, seed=seed)


def verify_chain_reduced(
    target_logits,
    draft_tokens,
    draft_probs,
    d2t,
    *,
    temperature,
    seed,
    t2d: torch.Tensor | None = None,
    all_greedy: bool = False,
    config: LaunchConfig | None = None,
):
    """Fused chain verification with q over the draft vocab.

    target_logits [B, K+1, V], draft_tokens [B, K] int64 TARGET ids (-1 = padding),
    draft_probs [B, K, Vd] fp32/bf16/fp16 (last stride 1), d2t [Vd] int64 offsets,
    temperature [B] fp32, seed [B] int64; t2d: optional cached `t2d_index(d2t, V)`.
    Returns (tokens [B, K+1] int64, num_accepted [B] int64).
    """
    bsz, rows, vocab = check_common(target_logits, draft_tokens, temperature, seed)
    dev = target_logits.device
    if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1:
        check_tensor("d2t", d2t, (None,), (torch.int64,), dev, True)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    check_tensor("draft_probs", draft_probs, (bsz, rows - 1, d2t.shape[0]), floats, dev, False)
    check_tensor("d2t", d2t, (draft_probs.shape[-1],), (torch.int64,), dev, True)
    if d2t.shape[0] > vocab:
        raise VerifyInputError(
            "d2t", f"at most V={vocab} draft ids", f"{d2t.shape[0]}", "pass the d2t of a draft trained for this target"
        )
    if t2d is None:
        t2d = t2d_index(d2t, vocab)
    check_tensor("t2d", t2d, (vocab,), (torch.int32,), dev, True)
    return launch_chain(
        target_logits, draft_tokens, draft_probs, t2d, temperature, seed, Q_REDUCED, pick_config(config, bsz, vocab), all_greedy
    )


__all__ = ["expand_draft_probs", "t2d_index", "verify_chain_reduced", "verify_chain_reduced_reference"]
