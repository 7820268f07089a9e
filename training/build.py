"""Build a new trainable EAGLE-3 draft for a target, and export it in the vLLM-loadable format.

- config: :func:`eagleray.platform.checkpoints.draft_factory.eagle3_config` (layer shapes and rope follow the target);
- draft vocab: the ``draft_vocab_size`` most frequent loss-masked tokens of the training data
  (datagen's ``vocab_counts.npy``) -> ``d2t``/``t2d`` (:func:`~eagleray.platform.checkpoints.draft_factory.vocab_map`);
- embedding: the target's, frozen, not saved (vLLM/eagleray share the target's at load time);
- lm_head: initialised from the target's lm_head rows of the draft vocab (``init_lm_head_from_target``),
  other linears N(0, 0.02), norms 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagleray.platform.checkpoints.draft import DraftCheckpoint, DraftMetadata, save_draft
from eagleray.platform.checkpoints.draft_factory import eagle3_config, random_eagle3_tensors, vocab_map
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.tp import TPInfo

EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight",)


@dataclass
class DraftInit:
    """A draft to train: its config and initial tensors (checkpoint names, incl. d2t/t2d)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def t2d(self) -> torch.Tensor:
        return self.tensors["t2d"]  # [V] bool


def target_embed_and_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head [V, H] (fp32; a tied head is the embedding)."""
    found: dict[str, torch.Tensor] = {}
    files = sorted(Path(target_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in EMBED_NAMES + HEAD_NAMES:
                    found[name] = sf.get_tensor(name).float()
    embed = next((found[n] for n in EMBED_NAMES if n in found), None)
    if embed is None:
        raise EaglerayError(
            f"target {target_dir}: no embedding tensor ({' or '.join(EMBED_NAMES)}) in {len(files)} safetensors file(s)\n"
            f"    fix: point target.model at a complete Hugging Face Llama-family directory"
        )
    return embed, found.get("lm_head.weight", embed)


def new_draft(
    target: TargetSpec,
    counts: torch.Tensor | None,
    draft_vocab_size: int,
    *,
    aux_layer_ids: list[int] | None = None,
    seed: int = 0,
    target_head: torch.Tensor | None = None,
) -> DraftInit:
    """A fresh draft for ``target``: vocab from ``counts`` [V] (None = lowest ids), lm_head from ``target_head``."""
    size = min(int(draft_vocab_size), target.vocab_size)
    cfg = eagle3_config(target, aux_layer_ids, size)
    if counts is not None and counts.numel() != target.vocab_size:
        raise EaglerayError(
            f"vocab counts cover {counts.numel()} tokens but the target vocab has {target.vocab_size}\n"
            f"    fix: use data generated with this target (manifest.json target_fingerprint)"
        )
    d2t, t2d = vocab_map(counts if counts is not None else torch.zeros(target.vocab_size), size)
    tensors = random_eagle3_tensors(cfg, d2t, t2d, seed)
    if target_head is not None:
        tensors["lm_head.weight"] = target_head[t2d].float().clone()  # [Vd, H]
    return DraftInit(cfg, tensors)


def from_checkpoint(path: str | Path) -> DraftInit:
    """Re-open a draft written by :func:`export` (for resume or fine-tuning)."""
    ckpt = DraftCheckpoint.open(path)
    return DraftInit(dict(ckpt.config), ckpt.load_tensors())


def draft_module(init: DraftInit, device=None) -> Eagle3Draft:
    """A trainable fp32 :class:`Eagle3Draft` holding ``init``'s weights (no TP: one replica per DDP rank)."""
    cfg = {k: v for k, v in init.config.items() if k != "eagleray"}
    with torch.device(device or "cpu"):
        draft = Eagle3Draft(cfg, tp=TPInfo(), dtype=torch.float32)
    weights = {k: v for k, v in init.tensors.items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise EaglerayError(
            f"draft weights do not match the draft module: missing {missing}, unexpected {unexpected}\n"
            f"    fix: rebuild the draft with eagleray.training.build.new_draft"
        )
    draft.d2t.copy_(init.tensors["d2t"])
    for p in draft.parameters():
        p.requires_grad_(True)
    return draft


def export(draft: Eagle3Draft, init: DraftInit, out_dir: str | Path, metadata: DraftMetadata) -> Path:
    """Write the trained draft (vLLM-loadable: config.json + model.safetensors with d2t/t2d)."""
    tensors = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()}
    tensors["d2t"] = init.tensors["d2t"]
    tensors["t2d"] = init.tensors["t2d"]
    cfg = {k: v for k, v in init.config.items() if k != "eagleray"}
    return save_draft(out_dir, cfg, tensors, metadata)
