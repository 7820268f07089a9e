"""Serving capture: a sample of finished requests -> training shards, without the request waiting.

    engine deployment: at start, CaptureClient starts its writer and waits for it to say it can write under ``path``
    (a request finished with its hidden states)
        CaptureClient.submit: build the shard row (bf16 bytes), hand it to the writer
            (no wait); more than ``buffer_requests`` unacknowledged -> the capture is dropped and counted,
            the request is not touched
    CaptureWriter (serve/capture_writer; one per engine replica, on a thread of the replica or a Ray actor)
        buffers rows; writes a shard (platform/capture_store) at rows_per_shard or flush_seconds,
        then deletes shards past retention_days / over max_gib

Which requests: none with ``"store": false``; with ``require_store`` only those with ``"store": true``;
of the rest a ``rate`` share drawn per request. What a row holds: see platform/capture_store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Awaitable
from typing import Any

import numpy as np

from eagleray.platform.errors import EaglerayError
from eagleray.platform.shard_format import encode_bf16
from eagleray.serve.capture_config import CaptureConfig
from eagleray.serve.capture_writer import HOSTS, CaptureWriteFailed
from eagleray.serve.engine import RequestOutput
from eagleray.serve.prometheus import ServeMetrics

logger = logging.getLogger(__name__)


def prompt_key(prompt_ids: list[int]) -> str:
    """A row's ``prompt_id``: a hash of the prompt's tokens, so that requests of one prompt (retries, several
    sampled answers) share it and the hold-out split by ``prompt_id`` keeps them on one side of the gate."""
    return "prompt-" + hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).hexdigest()[:20]


def shard_row(request_id: str, prompt_ids: list[int], out: RequestOutput) -> dict[str, Any] | str:
    """The SHARD_SCHEMA row of a finished captured request, or why it cannot be one (a drop reason)."""
    hidden = out.hidden
    n = len(prompt_ids) + len(out.token_ids) - 1  # the last output token never ran through the target
    if hidden is None or hidden.aux.shape[0] != n or hidden.final.shape[0] != n:
        rows = None if hidden is None else hidden.aux.shape[0]
        logger.error("capture of %s: %s hidden-state rows for %d tokens (engine bug); dropped", request_id, rows, n)
        return "inconsistent"
    if len(out.token_ids) < 2:
        return "too_short"  # no answer token left to learn once the last one is cut
    return {
        "prompt_id": prompt_key(prompt_ids),
        "source": "traffic",
        "response": out.text,
        "num_tokens": n,
        "truncated": out.finish_reason == "length",
        "input_ids": (list(prompt_ids) + list(out.token_ids))[:n],
        "loss_mask": [0] * len(prompt_ids) + [1] * (n - len(prompt_ids)),
        "aux_hidden": encode_bf16(hidden.aux),
        "final_hidden": encode_bf16(hidden.final),
        "_aux_layer_ids": list(hidden.aux_layer_ids),
    }


class CaptureClient:
    """The engine deployment's side: the sampling draw, the hand-off, the counts (never blocks a request)."""

    def __init__(self, cfg: CaptureConfig, meta: dict[str, Any], metrics: ServeMetrics):
        self.cfg, self.metrics = cfg, metrics
        self.rng = random.Random(cfg.seed)
        self.writer = HOSTS[cfg.writer](cfg, meta)
        problem = self.writer.ready()  # a writer that cannot write fails the replica's start, not each capture later
        if problem:
            self.writer.close()
            raise EaglerayError(problem)
        self.inflight = 0
        self._acks: set[asyncio.Task] = set()

    def wants(self, store: bool | None) -> bool:
        """Whether to capture a request with this ``store`` field (decided before it runs)."""
        if store is False or (self.cfg.require_store and store is not True):
            return False
        return self.rng.random() < self.cfg.rate

    def submit(self, request_id: str, prompt_ids: list[int], out: RequestOutput, draft_version: str | None) -> None:
        """Hand a finished request to the writer, or drop it (counted) when the writer is behind."""
        if self.inflight >= self.cfg.buffer_requests:
            self.metrics.record_capture_drop("buffer_full")
            return
        row = shard_row(request_id, prompt_ids, out)
        if isinstance(row, str):
            self.metrics.record_capture_drop(row)
            return
        nbytes = len(row["aux_hidden"]) + len(row["final_hidden"]) + 4 * len(row["input_ids"])
        self.inflight += 1
        task = asyncio.get_running_loop().create_task(self._ack(self.writer.add(row, draft_version), nbytes))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _ack(self, stored: Awaitable[dict[str, Any]], nbytes: int) -> None:
        try:
            result = await stored
        except CaptureWriteFailed as err:  # the writer died or its write failed: this capture is lost, serving goes on
            logger.warning("%s", err)
            self.metrics.record_capture_drop("writer_failed")
            return
        finally:
            self.inflight -= 1
        if result["stored"]:
            self.metrics.record_capture(nbytes)
        else:
            self.metrics.record_capture_drop(result["reason"])

    async def flush(self) -> dict[str, Any]:
        """Write what the writer holds now (tests, the adaptation loop's --flush) and return its counts."""
        if self._acks:
            await asyncio.gather(*self._acks)
        return await self.writer.flush()

    def close(self) -> None:
        """Have the writer write its buffer (the replica is going away)."""
        self.writer.close()
