"""Serving capture's settings (``serving.capture``), in a module of their own: the capture writer actor reads them in
a process that never imports the engine (serve/capture_writer)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eagleray.platform.config.load import StrictModel
from eagleray.platform.config.schemas import FaultHooks, testing_delay, testing_hooks


class CaptureTesting(FaultHooks):
    write_delay_s: float = testing_delay("the writer sleeps this long in every add (a slow disk), to fill the buffer.")


class CaptureConfig(StrictModel):
    """Capture of served requests as training data (see docs/capture.md). Off unless ``serving.capture`` is set."""

    path: str = Field(
        description="Directory of the captured shards (shards/shard-<ms>-<id>.parquet in the datagen format); create it on storage every replica reaches."
    )
    rate: float = Field(1.0, ge=0.0, le=1.0, description="Share of finished requests captured, drawn per request.")
    max_gib: float = Field(
        10.0,
        gt=0.0,
        description="Disk cap of the shards under path: after each write the oldest shards are deleted to stay under it.",
    )
    retention_days: float = Field(30.0, gt=0.0, description="Shards whose last row is older than this are deleted.")
    require_store: bool = Field(
        False,
        description="Capture only requests that send store: true (OpenAI's default). Default: every request except those that send store: false.",
    )
    buffer_requests: int = Field(
        64,
        ge=1,
        description="Captures handed to the writer and not yet buffered by it; a capture beyond this is dropped (counted), the request never waits.",
    )
    rows_per_shard: int = Field(64, ge=1, description="Requests per shard: the writer writes a shard when it holds this many.")
    flush_seconds: float = Field(
        30.0, gt=0.0, description="A shard is written at the latest this long after its first request was buffered."
    )
    writer: Literal["thread", "actor"] = Field(
        "thread",
        description="Where the shard writer runs: thread, a thread of the engine replica (no process of its own: the cheapest on a machine whose cores the engine fills; measured in BENCHMARKS.md); actor, a Ray actor of its own (0 CPUs), isolated from the replica's memory, GIL and crashes.",
    )
    seed: int | None = Field(None, description="Seed of the per-request sampling draw (None: from the OS).")
    testing: CaptureTesting = testing_hooks(CaptureTesting)
