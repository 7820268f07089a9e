"""Run a training job end to end: MLflow run -> Ray Train ``TorchTrainer`` (DDP) or one local worker ->
final draft (vLLM format) -> MLflow artifacts + registered version.

    from eagleray.training.trainer import train
    result = train(cfg)            # TrainResult(run_id, draft_dir, metrics, version)

Fault tolerance (backend "ray"): ``FailureConfig(max_failures)``; a killed worker restarts the
worker group, which resumes from the latest checkpoint reported through ``ray.train.report``. Workers
placed by ``resources_per_worker`` restart with them (``after_node_loss: wait``: a lost node's share
waits for a replacement) or, with ``anywhere``, the run is fitted again without them on the nodes left.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagleray.platform.config.schemas import TrainingConfig
from eagleray.platform.registry import DraftVersion
from eagleray.training.loop import DRAFT, train_worker
from eagleray.training.session import LocalSession

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_id: str
    draft_dir: Path  # the final draft (config.json + model.safetensors)
    metrics: dict[str, float] = field(default_factory=dict)
    version: DraftVersion | None = None


def ray_worker_entry(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the TorchTrainer (module-level so Ray can pickle it)."""
    import torch

    from eagleray.training.loop import is_complete
    from eagleray.training.session import RaySession

    cfg = TrainingConfig.model_validate_json(config["cfg"])
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    train_worker(cfg, RaySession(config.get("storage_dir"), is_complete), config.get("run_id"))


def _fit_ray(cfg: TrainingConfig, run_id: str, emit: Callable[[str], None] = print) -> tuple[Path, dict[str, float]]:
    """``trainer.fit()``; with ``after_node_loss: anywhere`` a failed run is fitted again without
    ``resources_per_worker`` (same storage, so it resumes from the last checkpoint) on the nodes left."""
    import ray
    from ray.train import TrainingFailedError

    if not ray.is_initialized():
        ray.init(address=cfg.ray_address or os.environ.get("RAY_ADDRESS") or "local", ignore_reinit_error=True)
    anywhere = cfg.after_node_loss == "anywhere" and bool(cfg.resources_per_worker)
    if not anywhere:  # Ray Train restarts the group itself, with the same resources (waiting for them)
        return _fit_ray_once(cfg, run_id, cfg.resources_per_worker, cfg.max_failures)
    try:
        return _fit_ray_once(cfg, run_id, cfg.resources_per_worker, 0)
    except TrainingFailedError as err:
        if cfg.max_failures < 1:
            raise
        emit(
            f"train: the worker group failed ({type(err).__name__}); after_node_loss=anywhere: restarting from the "
            f"last checkpoint without resources_per_worker {cfg.resources_per_worker}"
        )
        from eagleray.training.tracking import record_restart_reason

        record_restart_reason(
            cfg,
            run_id,
            f"worker group failed ({type(err).__name__}); restarted from the "
            f"last checkpoint without resources_per_worker (after_node_loss=anywhere)",
        )
        return _fit_ray_once(cfg, run_id, {}, cfg.max_failures - 1)


def _fit_ray_once(cfg: TrainingConfig, run_id: str, custom: dict[str, float], max_failures: int) -> tuple[Path, dict[str, float]]:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage, name = Path(cfg.output_dir).resolve() / "ray", f"train-{run_id[:12]}"
    trainer = TorchTrainer(
        ray_worker_entry,
        train_loop_config={"cfg": cfg.model_dump_json(), "run_id": run_id, "storage_dir": str(storage / name)},
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker, **custom}
        ),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"Ray Train finished without a checkpoint (error: {result.error})")
    local = Path(result.checkpoint.to_directory(str(Path(cfg.output_dir).resolve() / "final-checkpoint")))
    return local, dict(result.metrics or {})


def _fit_local(cfg: TrainingConfig, run_id: str) -> tuple[Path, dict[str, float]]:
    session = LocalSession(Path(cfg.output_dir) / "checkpoints")
    metrics = train_worker(cfg, session, run_id)
    return session.latest_checkpoint(), metrics


def absolute_paths(cfg: TrainingConfig) -> TrainingConfig:
    """A copy with the local paths made absolute against this process's working directory: data_dir,
    output_dir, and target.model / init_from when they name existing paths (not 'smollm2' or models:/)."""

    def local(value: str) -> str:
        return str(Path(value).resolve()) if Path(value).exists() else value

    cfg = cfg.model_copy(deep=True)
    if cfg.data_dir != "online":
        cfg.data_dir = str(Path(cfg.data_dir).resolve())
    cfg.output_dir = str(Path(cfg.output_dir).resolve())
    if cfg.target.model.lower() not in ("smollm2", "smollm2-135m-instruct"):
        cfg.target.model = local(cfg.target.model)
    if cfg.init_from is not None and not cfg.init_from.startswith("models:/"):
        cfg.init_from = local(cfg.init_from)
    if cfg.online is not None:
        cfg.online.prompts = [local(p) for p in cfg.online.prompts]
    return cfg


def train(cfg: TrainingConfig, emit: Callable[[str], None] = print, run_name: str | None = None) -> TrainResult:
    """Train, then log the draft and register it (see module doc). ``cfg`` is not modified."""
    from eagleray.training.plan import make_plan
    from eagleray.training.tracking import finish_run, start_run

    cfg = absolute_paths(cfg)  # Ray Train workers run in their own working directory
    plan = make_plan(cfg)  # fail fast on config/data problems, before Ray starts
    facts = {
        "target_fingerprint": plan.spec.fingerprint,
        "tokenizer_fingerprint": plan.spec.tokenizer_fingerprint,
        "aux_layer_ids": plan.aux_layer_ids,
        "dataset_id": plan.dataset_id,
        "draft_vocab_size": plan.init.config["draft_vocab_size"],
        "target_dir": str(plan.target_dir),
        **plan.data_facts,
    }
    run_id = start_run(cfg, facts, run_name)
    emit(f"train: MLflow run {run_id} ({cfg.mlflow.tracking_uri}), backend={cfg.backend}, workers={cfg.num_workers}")
    ckpt, metrics = _fit_ray(cfg, run_id, emit) if cfg.backend == "ray" else _fit_local(cfg, run_id)
    final = Path(cfg.output_dir) / "final-draft"
    if final.exists():
        shutil.rmtree(final)
    shutil.copytree(ckpt / DRAFT, final)
    tags = {k: facts[k] for k in ("target_fingerprint", "tokenizer_fingerprint", "aux_layer_ids", "dataset_id")}
    version = finish_run(cfg, run_id, final, metrics, tags)
    summary = ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and ("acc" in k or "tau" in k))
    emit(
        f"train: done at step {metrics.get('step')}: {summary}; draft {final}"
        + (f"; registered {version.uri}" + (f" @{cfg.alias}" if cfg.alias else "") if version else "")
    )
    return TrainResult(run_id, final, metrics, version)
