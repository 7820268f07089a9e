"""Where the training loop runs: a Ray Train worker, or one local process (same loop, same checkpoints).

A session knows the worker's rank/world/device, hands out the latest checkpoint directory to
resume from, and reports metrics with an optional checkpoint directory (copied into storage).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from eagleray.platform.host import pick_device


class Session:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    def latest_checkpoint(self) -> Path | None:
        """A local directory with the latest reported checkpoint, or None for a fresh run."""
        raise NotImplementedError

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        """Record metrics; with ``checkpoint_dir`` also persist it as the newest checkpoint. Collective in Ray."""
        raise NotImplementedError

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1 and dist.is_initialized():
            dist.all_reduce(x)
        return x

    def barrier(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.barrier()


@dataclass
class LocalSession(Session):
    """One process; checkpoints in ``root``/step-NNNNNNN, the newest ``keep`` kept."""

    root: Path
    keep: int = 2
    device: torch.device = field(default_factory=pick_device)
    reports: list[dict[str, Any]] = field(default_factory=list)
    last_checkpoint: Path | None = None

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.root.glob("step-*"))
        return found[-1] if found else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        dst = self.root / f"step-{int(metrics['step']):07d}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(checkpoint_dir, dst)
        self.last_checkpoint = dst
        for old in sorted(self.root.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old)


class RaySession(Session):
    """Inside ``TorchTrainer``: rank/world from the train context, checkpoints through ``ray.train``.

    Ray registers a reported checkpoint when its controller next polls the worker (every ~2 s); a
    worker killed in between leaves the checkpoint persisted but unregistered. So when Ray offers
    none, the run's storage folder is searched for the newest complete one (``is_complete``).
    """

    def __init__(self, storage_dir: str | None = None, is_complete=lambda p: True) -> None:
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.storage_dir = Path(storage_dir) if storage_dir else None
        self.is_complete = is_complete

    def latest_checkpoint(self) -> Path | None:
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            return self._local_dir(ckpt)
        if self.storage_dir is None or not self.storage_dir.is_dir():
            return None
        done = [p for p in self.storage_dir.glob("checkpoint_*") if p.is_dir() and self.is_complete(p)]
        return max(done, key=lambda p: p.stat().st_mtime) if done else None

    def _local_dir(self, ckpt) -> Path:
        """Ray's checkpoint as a local directory: itself where the run's storage is this machine's file system
        (every resume used to leave a copy in /tmp), else a copy removed with this session."""
        import pyarrow.fs

        if isinstance(ckpt.filesystem, pyarrow.fs.LocalFileSystem) and Path(ckpt.path).is_dir():
            return Path(ckpt.path)
        tmp = Path(tempfile.mkdtemp(prefix="eagleray-resume-"))
        weakref.finalize(self, shutil.rmtree, tmp, True)
        return Path(ckpt.to_directory(str(tmp / "latest")))

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir is not None else None
        ray.train.report(metrics, checkpoint=ckpt)
