"""Build the engine's models from config: target directory, draft source (guarded), tokenizer."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from eagleray.platform.draft_factory import make_random_draft
from eagleray.platform.errors import EaglerayError
from eagleray.platform.guard import ensure_compatible
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.schemas import DraftConfig, TargetConfig
from eagleray.platform.smollm2 import resolve_target
from eagleray.platform.target import TargetSpec

logger = logging.getLogger(__name__)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EaglerayError("target.device='cuda' but no CUDA device is visible\n    fix: set target.device to 'cpu' or 'auto'")
    return torch.device(device)


def resolve_draft_dir(cfg: DraftConfig, spec: TargetSpec, workdir: str | Path | None = None) -> Path:
    """'random' -> an untrained draft written to ``workdir``; a directory -> itself; models:/ -> error here."""
    if cfg.source == "random":
        out = Path(workdir or tempfile.mkdtemp(prefix="eagleray-random-draft-")) / "random-draft"
        return make_random_draft(spec, out)
    if cfg.source.startswith("models:/"):
        raise EaglerayError(f"draft.source={cfg.source!r}: the engine loads directories; resolve registry URIs first\n"
                            f"    fix: download the version with the MLflow registry client and pass its directory")
    path = Path(cfg.source)
    if not path.is_dir():
        raise EaglerayError(f"draft.source={cfg.source!r} is not a directory\n    fix: pass a draft checkpoint directory or 'random'")
    return path


def load_models(target_cfg: TargetConfig, draft_cfg: DraftConfig | None, workdir=None):
    """-> (target LlamaModel, Eagle3Draft | None, tokenizer, device). The guard runs before any draft is loaded."""
    from transformers import AutoTokenizer

    if target_cfg.tensor_parallel_size != 1:
        raise EaglerayError(f"target.tensor_parallel_size={target_cfg.tensor_parallel_size}: the in-process engine runs one rank\n"
                            f"    fix: use tensor_parallel_size=1 here; multi-rank serving goes through the Ray Serve deployment")
    device = pick_device(target_cfg.device)
    target_dir = resolve_target(target_cfg.model, target_cfg.dtype)
    spec = TargetSpec.from_dir(target_dir)
    draft_dir, aux_ids = None, []
    if draft_cfg is not None:
        draft_dir = resolve_draft_dir(draft_cfg, spec, workdir)
        report = ensure_compatible(spec, draft_dir, algorithm=draft_cfg.algorithm, max_model_len=target_cfg.max_model_len)
        aux_ids = report.facts["aux_layer_ids"]
    target = LlamaModel.from_dir(target_dir, dtype=target_cfg.dtype, device=device, aux_layer_ids=aux_ids)
    draft = None if draft_dir is None else Eagle3Draft.from_checkpoint(draft_dir, target, dtype=target_cfg.dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    return target, draft, tokenizer, device
