"""Captured serving traffic on disk: shards in the datagen format, their window, retention, snapshots.

The serving capture writer (``serve/capture``) appends shards; the adaptation loop (``jobs/adapt``)
reads a time window of them as a training dataset. Layout of a capture directory::

    shards/shard-<last_ms>-<id>.parquet   SHARD_SCHEMA rows (one a finished request), named by the
                                          capture time of their last row (ms since the epoch), so
                                          name order is time order; parquet metadata
                                          ``eagleray.capture`` (JSON) has target/tokenizer
                                          fingerprints, aux_layer_ids, hidden_size, first_ms, last_ms
    adapt/last.json                       the adaptation loop's last decision (read by serving metrics)

A row is a request: ``prompt_id`` a hash of its prompt tokens (serve/capture.prompt_key: requests of one
prompt share it, so the hold-out split keeps them together), ``source`` 'traffic', ``input_ids`` prompt +
output without the last output token (the target never ran it), ``loss_mask`` 1 over the output,
``aux_hidden`` / ``final_hidden`` the target's states the engine computed while serving it.
:func:`snapshot` turns a window into a dataset directory ``eagleray train`` reads (manifest.json,
vocab_counts.npy, shards hard-linked so retention cannot delete them under a running job).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagleray.platform.errors import DataError
from eagleray.platform.shard_format import MANIFEST, SHARD_SCHEMA, SHARDS_DIR, VOCAB_COUNTS, count_loss_tokens

logger = logging.getLogger(__name__)

META_KEY = "eagleray.capture"
ADAPT_STATUS = "adapt/last.json"
_TMP = ".tmp-"


@dataclass(frozen=True)
class CapturedShard:
    path: Path
    last_ms: int  # capture time of its last row
    bytes: int

    @classmethod
    def of(cls, path: Path) -> "CapturedShard":
        parts = path.stem.split("-")  # shard-<last_ms>-<id>
        if len(parts) != 3 or not parts[1].isdigit():
            raise DataError(f"{path}: not a capture shard name (shard-<last_ms>-<id>.parquet)")
        return cls(path, int(parts[1]), path.stat().st_size)


def shard_name(last_ms: int) -> str:
    return f"shard-{last_ms:013d}-{uuid.uuid4().hex[:8]}.parquet"


def list_shards(root: str | Path) -> list[CapturedShard]:
    """Every finished capture shard under ``root``, oldest first (tmp files of a write in progress skipped)."""
    shards = (Path(root) / SHARDS_DIR).glob("shard-*.parquet")
    return sorted((CapturedShard.of(p) for p in shards), key=lambda s: (s.last_ms, s.path.name))


def shard_meta(path: Path) -> dict[str, Any]:
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(META_KEY.encode())
    if raw is None:
        raise DataError(f"{path}: no {META_KEY} metadata (not written by the serving capture)")
    return json.loads(raw)


# zstd for every column but the hidden states: bf16 activations shrink by ~22% under zstd for ~23 ms of the writer's CPU
# a 190-token request, time a serving machine's engine loses (on 2 cores at ~1.5 captured requests a second: ~3.5% of
# a core)
# (keyed by Parquet's leaf column paths: a list column's values are "<name>.list.element")
SHARD_COMPRESSION = {
    f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name: "none" if f.name.endswith("_hidden") else "zstd"
    for f in SHARD_SCHEMA
}


def write_shard(root: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Write ``rows`` (SHARD_SCHEMA) as one shard, atomically (tmp file in the same folder, then rename)."""
    out = Path(root) / SHARDS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / shard_name(int(meta["last_ms"]))
    schema = SHARD_SCHEMA.with_metadata({META_KEY.encode(): json.dumps(meta).encode()})
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = out / f"{_TMP}{path.name}"
    try:
        pq.write_table(table, tmp, row_group_size=16, compression=SHARD_COMPRESSION)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def enforce_limits(root: str | Path, max_bytes: int, retention_s: float, now_ms: int | None = None) -> dict[str, int]:
    """Delete shards older than ``retention_s``, then the oldest until the rest fit in ``max_bytes``.

    Returns how many shards each rule deleted and the bytes left."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    shards = list_shards(root)
    expired = [s for s in shards if now_ms - s.last_ms > retention_s * 1000]
    kept = [s for s in shards if s not in expired]
    total = sum(s.bytes for s in kept)
    over: list[CapturedShard] = []
    while kept and total > max_bytes:
        s = kept.pop(0)
        over.append(s)
        total -= s.bytes
    for s in expired + over:
        s.path.unlink(missing_ok=True)
    if expired or over:
        logger.info("capture: deleted %d shard(s) past retention and %d over the size cap", len(expired), len(over))
    return {"expired": len(expired), "evicted": len(over), "bytes": total}


def window(root: str | Path, since_ms: int = 0, until_ms: int | None = None) -> list[CapturedShard]:
    """Shards whose last row was captured in (since_ms, until_ms]."""
    return [s for s in list_shards(root) if s.last_ms > since_ms and (until_ms is None or s.last_ms <= until_ms)]


def count_rows(shards: list[CapturedShard]) -> int:
    return sum(pq.read_metadata(s.path).num_rows for s in shards)


def snapshot(shards: list[CapturedShard], out_dir: str | Path, vocab_size: int) -> dict[str, Any]:
    """A datagen-format dataset of ``shards`` in ``out_dir`` (hard links; a copy across file systems).

    All shards must come from one target and aux-layer set (a draft swap to other layers starts a new
    set: the shards of the set of the newest shard are kept, the others are reported as skipped)."""
    if not shards:
        raise DataError("capture snapshot: the window holds no shards\n    fix: capture more traffic first")
    metas = [shard_meta(s.path) for s in shards]
    key = lambda m: (m["target_fingerprint"], tuple(m["aux_layer_ids"]))  # noqa: E731
    newest = key(metas[-1])
    chosen = [(s, m) for s, m in zip(shards, metas) if key(m) == newest]
    skipped = len(shards) - len(chosen)
    if skipped:
        logger.warning("capture snapshot: %d shard(s) of another target or aux-layer set skipped", skipped)
    out = Path(out_dir)
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    files = []
    for s, _ in chosen:
        dst = out / SHARDS_DIR / s.path.name
        if not dst.exists():
            try:
                os.link(s.path, dst)
            except OSError as err:  # EXDEV: another file system; the copy is logged, not silent
                logger.info("capture snapshot: copying %s (no hard link: %s)", s.path.name, err)
                shutil.copy2(s.path, dst)
        files.append(dst)
    counts = count_loss_tokens(files, vocab_size)
    np.save(out / VOCAB_COUNTS, counts.numpy())
    first = chosen[0][1]
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    manifest = {
        "source": "capture",
        "dataset_id": hashlib.sha256(json.dumps(sorted(f.name for f in files)).encode()).hexdigest()[:16],
        "target_fingerprint": first["target_fingerprint"],
        "tokenizer_fingerprint": first.get("tokenizer_fingerprint"),
        "aux_layer_ids": list(first["aux_layer_ids"]),
        "hidden_size": first["hidden_size"],
        "dtype": "bf16",
        "rows": rows,
        "loss_tokens": int(counts.sum()),
        "shards": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "window_first_ms": min(m["first_ms"] for _, m in chosen),
        "window_last_ms": max(m["last_ms"] for _, m in chosen),
        "skipped_shards": skipped,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def write_adapt_status(root: str | Path, status: dict[str, Any]) -> None:
    """The adaptation loop's last decision, atomically (serving reads it for its metrics)."""
    path = Path(root) / ADAPT_STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{_TMP}{uuid.uuid4().hex[:8]}-{path.name}")
    tmp.write_text(json.dumps(status, indent=2))
    os.replace(tmp, path)


def read_adapt_status(root: str | Path) -> dict[str, Any] | None:
    path = Path(root) / ADAPT_STATUS
    return json.loads(path.read_text()) if path.is_file() else None
