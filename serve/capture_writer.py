"""Serving capture's writer: the Ray actor that buffers captured rows and writes them as shards (one per engine replica).

    CaptureWriter.add(row)  buffer one row (serve/capture.CaptureClient hands it over, never waiting)
        -> a shard (platform/capture_store.write_shard) at rows_per_shard rows or flush_seconds after the first,
           then shards past retention_days / over max_gib are deleted

A module of its own that never imports torch or the engine: an actor process imports the module of its class, and
serve/capture's imports (the engine's RequestOutput, the Serve metrics) took the writer 2.6 s of CPU and 455 MiB to
start, on the same cores as the replica it was started beside (a test keeps torch out).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from eagleray.platform import capture_store
from eagleray.platform.shard_format import SHARDS_DIR
from eagleray.serve.capture_config import CaptureConfig

logger = logging.getLogger(__name__)


def writable(folder: Path) -> str | None:
    """Create ``folder`` and write a file in it: None, or the error naming ``serving.capture.path``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return (
            f"serving.capture.path: cannot write captured shards under {folder} ({err.strerror or err})\n"
            "    fix: point serving.capture.path at a directory the engine replicas' nodes can create and write"
        )
    return None


class CaptureWriter:
    """Buffers captured rows and writes them as shards (the body of the writer actor)."""

    def __init__(self, cfg: dict[str, Any], meta: dict[str, Any]):
        self.cfg = CaptureConfig.model_validate(cfg)
        self.meta = dict(meta)  # target/tokenizer fingerprints, hidden_size
        self.rows: list[dict[str, Any]] = []
        self.first_ms: int | None = None
        self.aux_ids: list[int] | None = None
        self.draft_versions: set[str] = set()
        self.written = {"shards": 0, "rows": 0, "bytes": 0, "expired": 0, "evicted": 0}
        self._ticker: asyncio.Task | None = None
        self.problem = writable(Path(self.cfg.path) / SHARDS_DIR)  # on the writer's node, which may not be the replica's

    def ready(self) -> str | None:
        """Whether the writer can write its shards: None, or why not (the replica refuses to start with it)."""
        return self.problem

    async def add(self, row: dict[str, Any], draft_version: str | None) -> dict[str, Any]:
        """Buffer one row (flushing first when it reads other aux layers); returns ``{"stored": True}``."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        if self.cfg.testing.write_delay_s:
            time.sleep(self.cfg.testing.write_delay_s)  # blocks the actor like a slow disk would
        aux_ids = row.pop("_aux_layer_ids")
        if self.aux_ids is not None and aux_ids != self.aux_ids:
            self.flush()  # a shard holds one aux-layer set
        self.aux_ids = aux_ids
        now = int(time.time() * 1000)
        self.first_ms = self.first_ms or now
        self.rows.append(row)
        if draft_version:
            self.draft_versions.add(draft_version)
        if len(self.rows) >= self.cfg.rows_per_shard:
            self.flush()
        return {"stored": True}

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.flush_seconds))
            if self.rows and time.time() * 1000 - self.first_ms >= self.cfg.flush_seconds * 1000:
                self.flush()

    def flush(self) -> dict[str, Any]:
        """Write the buffered rows as one shard (if any), then apply retention and the size cap."""
        if self.rows:
            meta = {
                **self.meta,
                "aux_layer_ids": self.aux_ids,
                "first_ms": self.first_ms,
                "last_ms": int(time.time() * 1000),
                "rows": len(self.rows),
                "draft_versions": sorted(self.draft_versions),
            }
            path = capture_store.write_shard(self.cfg.path, self.rows, meta)
            self.written["shards"] += 1
            self.written["rows"] += len(self.rows)
            self.written["bytes"] += path.stat().st_size
            logger.info("capture: wrote %s (%d requests)", path.name, len(self.rows))
            self.rows, self.first_ms, self.draft_versions = [], None, set()
        limits = capture_store.enforce_limits(self.cfg.path, int(self.cfg.max_gib * 2**30), self.cfg.retention_days * 86400)
        self.written["expired"] += limits["expired"]
        self.written["evicted"] += limits["evicted"]
        return self.status(limits["bytes"])

    def status(self, disk_bytes: int | None = None) -> dict[str, Any]:
        return {"buffered": len(self.rows), **self.written, **({"disk_bytes": disk_bytes} if disk_bytes is not None else {})}


CaptureWriterActor = ray.remote(num_cpus=0, max_concurrency=1)(CaptureWriter)
