"""Checks of a draft's vocabulary: sizes, ``lm_head`` rows and the ``d2t``/``t2d`` maps."""

from __future__ import annotations

import torch

from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.errors import Problem


def check_vocab_map(draft: DraftCheckpoint, target_vocab: int) -> list[Problem]:
    """Every vocabulary problem of ``draft`` against a target of ``target_vocab`` tokens."""
    cfg, out = draft.config, []
    vocab = int(cfg.get("vocab_size") or 0)
    dvocab = draft.draft_vocab_size
    if vocab != target_vocab:
        out.append(
            Problem(
                "draft.config.vocab_size",
                f"is {vocab} but the target's vocab_size is {target_vocab}",
                "use a draft trained for this target's tokenizer",
            )
        )
    head = draft.shapes.get("lm_head.weight")
    if head is not None and head[0] != dvocab:
        out.append(
            Problem(
                "draft.weights.lm_head.weight",
                f"has {head[0]} rows but draft_vocab_size is {dvocab}",
                "set draft_vocab_size to the lm_head rows (or restore the matching weights)",
            )
        )
    has_d2t, has_t2d = "d2t" in draft.shapes, "t2d" in draft.shapes
    if dvocab == target_vocab and not has_d2t:
        return out  # full vocabulary: the identity map needs no tensors
    if not has_d2t or not has_t2d:
        missing = [n for n, ok in (("d2t", has_d2t), ("t2d", has_t2d)) if not ok]
        return out + [
            Problem(
                f"draft.weights.{missing[0]}",
                f"missing {missing} although draft_vocab_size {dvocab} < vocab_size {target_vocab}",
                "save d2t [draft_vocab] int64 and t2d [vocab] bool with the draft (eagleray train does)",
            )
        ]
    return out + _check_maps(draft, dvocab, target_vocab)


def _check_maps(draft: DraftCheckpoint, dvocab: int, target_vocab: int) -> list[Problem]:
    t = draft.load_tensors(["d2t", "t2d"])
    d2t, t2d = t["d2t"], t["t2d"]  # [Vd] offsets, [V] mask
    fix = (
        "rebuild d2t/t2d from the token counts the draft was trained with (eagleray.platform.checkpoints.draft_factory.vocab_map)"
    )
    if list(d2t.shape) != [dvocab] or d2t.dtype not in (torch.int64, torch.int32):
        return [Problem("draft.weights.d2t", f"has shape {list(d2t.shape)} dtype {d2t.dtype}, expected [{dvocab}] int64", fix)]
    if list(t2d.shape) != [target_vocab] or t2d.dtype != torch.bool:
        return [
            Problem("draft.weights.t2d", f"has shape {list(t2d.shape)} dtype {t2d.dtype}, expected [{target_vocab}] bool", fix)
        ]
    ids = torch.arange(dvocab, dtype=torch.int64) + d2t.to(torch.int64)  # [Vd] target ids
    bad = ((ids < 0) | (ids >= target_vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        return [
            Problem(
                "draft.weights.d2t",
                f"maps draft id {i} to target id {int(ids[i])}, outside [0, {target_vocab}) ({bad.numel()} ids out of range)",
                fix,
            )
        ]
    out = []
    if ids.unique().numel() != dvocab:
        out.append(
            Problem("draft.weights.d2t", f"maps {dvocab} draft ids onto only {ids.unique().numel()} distinct target ids", fix)
        )
    if int(t2d.sum()) != dvocab or not bool(t2d[ids].all()):
        out.append(
            Problem(
                "draft.weights.t2d", f"marks {int(t2d.sum())} tokens but d2t names {dvocab}, and they must be the same set", fix
            )
        )
    return out
