"""Build the engine's models from config: target directory, draft source (guarded), tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagleray.platform.checkpoints.guard import ensure_compatible
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.schemas import DraftConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import pick_device
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.tp import TPInfo, VocabParallelEmbedding
from eagleray.platform.models.weights import iter_safetensors
from eagleray.platform.registry import resolve_draft
from eagleray.serve.engine.tp_workers import TPLaunch, rank_device, start_workers

logger = logging.getLogger(__name__)


def load_models(target_cfg: TargetConfig, draft_cfg: DraftConfig | None, workdir=None, tp_launch: TPLaunch | None = None):
    """-> (target LlamaModel, Eagle3Draft | None, tokenizer, device). The guard runs before any draft is loaded.

    ``target.tensor_parallel_size`` > 1 starts the worker ranks with ``tp_launch`` (default: child
    processes, ``TPLaunch("mp")``; see :mod:`eagleray.serve.engine.tp_workers`);
    the returned target is rank 0's shard with ``tp_workers`` attached (``engine.close()`` stops them).
    """
    from transformers import AutoTokenizer

    device = pick_device(target_cfg.device)
    target_dir = resolve_target(target_cfg.model, target_cfg.dtype)
    spec = TargetSpec.from_dir(target_dir)
    draft_dir, aux_ids = None, []
    if draft_cfg is not None:
        draft_dir = resolve_draft(draft_cfg.source, spec, workdir=workdir).path
        report = ensure_compatible(spec, draft_dir, algorithm=draft_cfg.algorithm, max_model_len=target_cfg.max_model_len)
        aux_ids = report.facts["aux_layer_ids"]
    target = load_target(target_dir, target_cfg, device, aux_ids, tp_launch or TPLaunch())
    try:
        draft = None if draft_dir is None else load_draft(draft_dir, target, device)
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    except BaseException:
        close_target(target)
        raise
    return target, draft, tokenizer, device


def load_target(
    target_dir: Path, target_cfg: TargetConfig, device: torch.device, aux_ids: list[int], launch: TPLaunch
) -> LlamaModel:
    """One rank (``TPInfo()``, never an ambient process group) or rank 0 of ``tensor_parallel_size`` ranks."""
    world = target_cfg.tensor_parallel_size
    if world == 1:
        return LlamaModel.from_dir(target_dir, dtype=target_cfg.dtype, device=device, tp=TPInfo(), aux_layer_ids=aux_ids)
    if launch.backend == "mp" and device.type == "cuda" and torch.cuda.device_count() < world:
        raise EaglerayError(
            f"target.tensor_parallel_size={world} but {torch.cuda.device_count()} GPUs are visible\n"
            f"    fix: lower target.tensor_parallel_size or expose more GPUs"
        )
    workers = start_workers(launch, str(target_dir), world, target_cfg.dtype, device)
    try:
        target = LlamaModel.from_dir(
            target_dir, dtype=target_cfg.dtype, device=rank_device(device, 0), tp=workers.tp, aux_layer_ids=aux_ids
        )
    except BaseException:
        workers.close()
        raise
    target.tp_workers = workers
    workers.target_dir = str(target_dir)
    return target


def load_draft(draft_dir: Path, target: LlamaModel, device: torch.device) -> Eagle3Draft:
    """The draft runs on rank 0 only (replicated): a tensor-parallel target's sharded embedding cannot be
    shared, so the draft gets a full copy of the target's embedding from the target checkpoint."""
    draft = Eagle3Draft.from_checkpoint(draft_dir, target, dtype=target.arch.dtype, device=device, tp=TPInfo())
    workers = getattr(target, "tp_workers", None)
    if workers is not None and draft.embed_tokens is None:
        emb = VocabParallelEmbedding(target.arch.vocab_size, target.hidden_size, TPInfo(), target.arch.dtype, device)
        full = next((t for n, t in iter_safetensors(Path(workers.target_dir)) if n.endswith("embed_tokens.weight")), None)
        if full is None:
            raise EaglerayError(
                f"target {workers.target_dir} has no embed_tokens.weight for the draft to share\n"
                f"    fix: use a draft checkpoint that has its own embed_tokens.weight"
            )
        emb.weight.weight_loader(emb.weight, full)
        draft.share_embedding(emb)
    return draft


def close_target(target: LlamaModel) -> None:
    """Stop a tensor-parallel target's workers (no-op for one rank)."""
    workers = getattr(target, "tp_workers", None)
    if workers is not None:
        workers.close()
