"""Hidden-state shards: schema, bf16 encoding, atomic writes, readers, and what a rerun may skip.

Layout of ``output_dir``::

    run.json                     settings a rerun must match (compat hash, fingerprints)
    shards/shard-<chunk>.parquet one per chunk of prompts (SHARD_SCHEMA)
    errors/part-<chunk>.jsonl    failed rows of a chunk (ERROR_FIELDS), never dropped
    manifest.json, vocab_counts.npy, errors.parquet   written when a run finishes

bf16 encoding (pyarrow has no bf16): ``aux_hidden`` and ``final_hidden`` are ``large_binary``
holding the raw bfloat16 bit patterns, little-endian, row-major: ``aux_hidden`` is [T, n_aux*H]
(aux layers in ascending id order, each H wide), ``final_hidden`` is [T, H]. Decode with
:func:`decode_bf16` (``torch.frombuffer(..., dtype=torch.bfloat16).view(T, -1)``).

``final_hidden`` is the target's last hidden state AFTER its final RMSNorm, so training gets the
target's next-token logits as ``target.lm_head(final_hidden)`` without storing [T, V] logits.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagleray.platform.shard_format import (  # noqa: F401  (re-exported)
    SHARD_SCHEMA,
    SHARDS_DIR,
    decode_bf16,
    encode_bf16,
    shard_files,
)

ERROR_FIELDS = ("prompt_id", "chunk_id", "stage", "kind", "message")
ERRORS_DIR = "errors"
_TMP_PREFIX = ".tmp-"


def shard_path(output_dir: str | Path, chunk_id: str) -> Path:
    return Path(output_dir) / SHARDS_DIR / f"shard-{chunk_id}.parquet"


def error_path(output_dir: str | Path, chunk_id: str) -> Path:
    return Path(output_dir) / ERRORS_DIR / f"part-{chunk_id}.jsonl"


def _tmp_for(path: Path) -> Path:
    return path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")


def write_shard(path: Path, rows: list[dict[str, Any]], metadata: dict[str, str], before_rename=None) -> int:
    """Write ``rows`` (SHARD_SCHEMA) to ``path`` atomically: tmp file in the same folder, then rename.

    Returns the file's size. ``before_rename`` (tests) runs with the tmp path before the rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA.with_metadata({k.encode(): v.encode() for k, v in metadata.items()}))
    tmp = _tmp_for(path)
    try:
        pq.write_table(table, tmp, row_group_size=16, compression="zstd")
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def finished_counts(path: Path) -> dict[str, int]:
    """rows, tokens, loss_tokens and bytes of a finished shard, read back from the file."""
    import pyarrow.compute as pc

    table = pq.read_table(path, columns=["num_tokens", "loss_mask"])
    tokens = pc.sum(table.column("num_tokens")).as_py() or 0
    loss = pc.sum(pc.list_flatten(table.column("loss_mask"))).as_py() or 0
    return {"rows": table.num_rows, "tokens": int(tokens), "loss_tokens": int(loss), "bytes": path.stat().st_size}


def write_errors(path: Path, errors: list[dict[str, str]]) -> None:
    """Write error records (ERROR_FIELDS) as JSONL atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_for(path)
    try:
        tmp.write_text("".join(json.dumps({k: e[k] for k in ERROR_FIELDS}, ensure_ascii=False) + "\n" for e in errors))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_tmp_files(output_dir: str | Path) -> int:
    """Delete half-written files a killed run left behind; returns how many."""
    n = 0
    for sub in (SHARDS_DIR, ERRORS_DIR):
        for p in (Path(output_dir) / sub).glob(f"{_TMP_PREFIX}*"):
            p.unlink()
            n += 1
    return n


def read_errors(output_dir: str | Path) -> list[dict[str, str]]:
    out = []
    for p in sorted((Path(output_dir) / ERRORS_DIR).glob("part-*.jsonl")):
        out.extend(json.loads(line) for line in p.read_text().splitlines() if line.strip())
    return out


def written_ids(output_dir: str | Path) -> list[str]:
    """Prompt ids in finished shards (duplicates kept, so callers can detect them)."""
    ids: list[str] = []
    for p in shard_files(output_dir):
        ids.extend(pq.read_table(p, columns=["prompt_id"]).column("prompt_id").to_pylist())
    return ids


def iter_rows(output_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of every shard with tensors: input_ids int64 [T], loss_mask int8 [T], aux_hidden and
    final_hidden torch.bfloat16 [T, n_aux*H] and [T, H]."""
    for p in shard_files(output_dir):
        for batch in pq.ParquetFile(p).iter_batches(batch_size=16):
            for row in batch.to_pylist():
                t = row["num_tokens"]
                row["input_ids"] = torch.tensor(row["input_ids"], dtype=torch.int64)
                row["loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.int8)
                row["aux_hidden"] = decode_bf16(row["aux_hidden"], t)
                row["final_hidden"] = decode_bf16(row["final_hidden"], t)
                yield row
