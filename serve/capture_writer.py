"""Serving capture's writer: buffers captured rows and writes them as shards, off the replica's request path.

    CaptureWriter.add(row)  buffer one row (serve/capture.CaptureClient hands it over, never waiting)
        -> a shard (platform/capture_store.write_shard) at rows_per_shard rows or flush_seconds after the first,
           then shards past retention_days / over max_gib are deleted

It runs where ``serving.capture.writer`` says, behind one interface (``ready``, ``add``, ``flush``, ``close``):

- ``thread`` (:class:`ThreadHost`): a thread of the engine replica, fed by a queue. No process of its own: on the
  2-core CPU a writer actor's process cost the Serve app more than the writing itself (an idle Ray worker uses 1.3%
  of a core, and every row crosses the object store), and any CPU taken beside an engine whose two threads work in
  step stalls both.
- ``actor`` (:class:`ActorHost`): a Ray actor of its own (0 CPUs), isolated from the replica's process (its memory,
  its GIL, its crashes).

This module never imports torch or the engine: an actor process imports the module of its class, and serve/capture's
imports took the writer 2.6 s of CPU and 455 MiB to start beside the replica (a test keeps torch out).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.exceptions import GetTimeoutError, RayError

from eagleray.platform import capture_store
from eagleray.platform.errors import EaglerayError
from eagleray.platform.shard_format import SHARDS_DIR
from eagleray.serve.capture_config import CaptureConfig

logger = logging.getLogger(__name__)
START_S = 120.0  # a writer actor's start: a worker process and this module
STOP_S = 30.0  # a thread writer's last shard when its replica shuts down


class CaptureWriteFailed(EaglerayError):
    """The writer failed to take a row (it died, or its write raised): that capture is lost, serving goes on."""


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
    """Buffers captured rows and writes them as shards (the body of either host; one caller at a time)."""

    def __init__(self, cfg: dict[str, Any], meta: dict[str, Any]):
        self.cfg = CaptureConfig.model_validate(cfg)
        self.meta = dict(meta)  # target/tokenizer fingerprints, hidden_size
        self.rows: list[dict[str, Any]] = []
        self.first_ms: int | None = None
        self.aux_ids: list[int] | None = None
        self.draft_versions: set[str] = set()
        self.written = {"shards": 0, "rows": 0, "bytes": 0, "expired": 0, "evicted": 0, "lost_rows": 0}
        self.tick_s = min(1.0, self.cfg.flush_seconds)  # how often a host asks whether a shard is due
        self.problem = writable(Path(self.cfg.path) / SHARDS_DIR)  # on the writer's node, which may not be the replica's

    def add(self, row: dict[str, Any], draft_version: str | None) -> dict[str, Any]:
        """Buffer one row (flushing first when it reads other aux layers); returns ``{"stored": True}``."""
        if self.cfg.testing.write_delay_s:
            time.sleep(self.cfg.testing.write_delay_s)  # blocks the writer like a slow disk would
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

    def due(self) -> bool:
        """Whether the buffered rows have waited flush_seconds since the first."""
        return bool(self.rows) and time.time() * 1000 - self.first_ms >= self.cfg.flush_seconds * 1000

    def flush_due(self) -> None:
        """A host's tick: write the shard if it is due; a failed write is logged and retried at the next tick."""
        if self.due():
            try:
                self.flush()
            except OSError as err:
                logger.error(
                    "capture: writing a shard of %d rows failed (%s); retried in %.0f s", len(self.rows), err, self.tick_s
                )

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
            try:
                path = capture_store.write_shard(self.cfg.path, self.rows, meta)
            except (OSError, pa.ArrowException) as err:  # dropped, not kept to fail again: a bad row would poison all
                lost = len(self.rows)
                self.written["lost_rows"] += lost
                self.rows, self.first_ms, self.draft_versions = [], None, set()
                raise CaptureWriteFailed(f"capture: writing a shard of {lost} rows failed, they are dropped: {err}") from None
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


class ThreadHost:
    """The writer on a daemon thread of the replica: rows queue to it; each call returns an asyncio future."""

    def __init__(self, cfg: CaptureConfig, meta: dict[str, Any]):
        self.writer = CaptureWriter(cfg.model_dump(mode="json"), meta)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (method name, args, concurrent future)
        self.thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
        self.thread.start()

    def ready(self) -> str | None:
        return self.writer.problem

    def add(self, row: dict[str, Any], draft_version: str | None) -> asyncio.Future:
        return self._call("add", row, draft_version)

    def flush(self) -> asyncio.Future:
        return self._call("flush")

    def close(self) -> None:
        """Write the buffer and stop (the replica is going away; waits up to STOP_S for the last shard)."""
        self.queue.put(("flush", (), None))
        self.queue.put(None)
        self.thread.join(STOP_S)

    def _call(self, method: str, *args: Any) -> asyncio.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.queue.put((method, args, fut))
        return asyncio.wrap_future(fut)

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=self.writer.tick_s)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                method, args, fut = item
                try:
                    result = getattr(self.writer, method)(*args)
                except Exception as err:  # the thread's boundary: the error goes to the caller's future, the thread lives on
                    logger.error("capture writer: %s failed: %s", method, err)
                    if fut is not None:
                        fut.set_exception(CaptureWriteFailed(f"capture writer: {method} failed: {err}"))
                else:
                    if fut is not None:
                        fut.set_result(result)
            self.writer.flush_due()


class _WriterActor:
    """The writer as a Ray actor's body; a ticker task writes shards that are due."""

    def __init__(self, cfg: dict[str, Any], meta: dict[str, Any]):
        self.writer = CaptureWriter(cfg, meta)
        self._ticker: asyncio.Task | None = None

    def ready(self) -> str | None:
        return self.writer.problem

    async def add(self, row: dict[str, Any], draft_version: str | None) -> dict[str, Any]:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return self.writer.add(row, draft_version)

    async def flush(self) -> dict[str, Any]:
        return self.writer.flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.writer.tick_s)
            self.writer.flush_due()


CaptureWriterActor = ray.remote(num_cpus=0, max_concurrency=1)(_WriterActor)


class ActorHost:
    """The writer as a Ray actor of its own; each call returns an awaitable that raises CaptureWriteFailed."""

    def __init__(self, cfg: CaptureConfig, meta: dict[str, Any]):
        self.actor = CaptureWriterActor.remote(cfg.model_dump(mode="json"), meta)

    def ready(self) -> str | None:
        try:
            problem = ray.get(self.actor.ready.remote(), timeout=START_S)
        except (RayError, GetTimeoutError) as err:
            return (
                f"serving.capture.writer: the capture writer actor did not start within {START_S:.0f} s "
                f"({type(err).__name__})\n    fix: check the Ray cluster's logs for the writer, or set "
                "serving.capture.writer: thread"
            )
        if problem:
            ray.kill(self.actor)
        return problem

    def add(self, row: dict[str, Any], draft_version: str | None):
        return self._await(self.actor.add.remote(row, draft_version))

    def flush(self):
        return self._await(self.actor.flush.remote())

    def close(self) -> None:
        """Ask the actor to write its buffer (not waited for)."""
        self.actor.flush.remote()

    @staticmethod
    async def _await(ref: ray.ObjectRef) -> dict[str, Any]:
        try:
            return await ref
        except RayError as err:
            raise CaptureWriteFailed(f"capture writer actor: {err}") from None


HOSTS = {"thread": ThreadHost, "actor": ActorHost}
