"""The hidden-state dataset format shared by datagen (writer) and training (reader).

Layout of a dataset directory::

    shards/shard-<chunk>.parquet   rows in SHARD_SCHEMA
    manifest.json                  dataset_id, target/tokenizer fingerprints, aux_layer_ids, rows, tokens, bytes
    vocab_counts.npy               [V] int64 counts of loss-masked target tokens (-> draft vocab, d2t/t2d)

bf16 encoding (pyarrow has no bf16): ``aux_hidden`` and ``final_hidden`` are ``large_binary``
holding raw bfloat16 bit patterns, little-endian, row-major: ``aux_hidden`` is [T, n_aux*H]
(aux layers in ascending id order, each H wide), ``final_hidden`` is [T, H] AFTER the target's
final RMSNorm, so the target's logits are ``lm_head(final_hidden)`` without storing [T, V].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from eagleray.platform.errors import DataError

if TYPE_CHECKING:
    import torch
# torch is imported by the functions that return or take tensors, not here: the serving capture's writer actor writes
# shards through this module (platform/capture_store) in a process that never needs torch (serve/capture_writer)

SHARD_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string()),
        pa.field("response", pa.string()),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("truncated", pa.bool_()),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),  # [T]
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),  # [T]
        pa.field("aux_hidden", pa.large_binary(), nullable=False),  # bf16 [T, n_aux*H]
        pa.field("final_hidden", pa.large_binary(), nullable=False),  # bf16 [T, H], after the final norm
    ]
)
SHARDS_DIR, MANIFEST, VOCAB_COUNTS = "shards", "manifest.json", "vocab_counts.npy"
SHARDS_GLOB = f"{SHARDS_DIR}/shard-*.parquet"


def encode_bf16(x: torch.Tensor) -> bytes:
    """[T, W] any float -> raw little-endian bf16 bytes (row-major), rounded to nearest even as ``x.to(bfloat16)``.

    A CPU fp32 tensor is converted in numpy (bits equal to torch's): a serving replica encodes on its event loop
    thread, where a torch op of this size starts a second OpenMP thread team beside the engine thread's (a request's
    aux rows took 6 ms there against 0.2 with one thread on the 2-core CPU, and a second team slows the engine's own
    parallel regions)."""
    import torch

    if x.device.type == "cpu" and x.dtype == torch.float32:
        return _fp32_to_bf16_bits(x.detach().numpy()).astype("<u2", copy=False).tobytes()
    raw = x.detach().to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy()
    return raw.astype("<i2", copy=False).tobytes()


def _fp32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 [T, W] (any strides) -> uint16 bf16 bit patterns [T, W], C order: round to nearest even (c10's
    round_to_nearest_even: the upper half of ``bits + 0x7FFF + lsb``), NaN -> 0x7FC0."""
    bits = a.view(np.uint32)
    out = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def decode_bf16(buf: bytes, num_tokens: int) -> torch.Tensor:
    """Raw bf16 bytes -> torch.bfloat16 [T, W]."""
    if sys.byteorder != "little":
        raise DataError("bf16 shards are little-endian; this reader supports little-endian hosts only")
    if num_tokens <= 0 or len(buf) % (2 * num_tokens):
        raise DataError(f"hidden-state blob of {len(buf)} bytes does not hold {num_tokens} bf16 rows")
    import torch

    return torch.frombuffer(bytearray(buf), dtype=torch.bfloat16).view(num_tokens, -1)


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The finished dataset's manifest; a clear error when datagen has not finished there."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"data_dir: {path} does not exist\n    fix: point data_dir at a finished datagen output "
            "(python -m eagleray.jobs.datagen writes manifest.json at the end)"
        )
    return json.loads(path.read_text())


def read_vocab_counts(data_dir: str | Path) -> torch.Tensor:
    """Token counts [V] int64 over loss-masked tokens."""
    path = Path(data_dir) / VOCAB_COUNTS
    if not path.is_file():
        raise DataError(f"data_dir: {path} does not exist\n    fix: rerun datagen to finish the dataset")
    import torch

    return torch.from_numpy(np.load(path)).to(torch.int64)


def ids_and_mask(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """A shard table's ``input_ids`` [sum T] int64 and ``loss_mask`` [sum T] bool, rows concatenated."""
    ids = np.asarray(table.column("input_ids").combine_chunks().flatten(), dtype=np.int64)
    mask = np.asarray(table.column("loss_mask").combine_chunks().flatten(), dtype=np.int8).astype(bool)
    return ids, mask


def count_loss_tokens(files: list[Path], vocab_size: int) -> torch.Tensor:
    """Token counts [V] int64 over the loss-masked tokens of ``files`` (what datagen writes for all shards)."""
    import pyarrow.parquet as pq
    import torch

    counts = np.zeros(vocab_size, dtype=np.int64)  # [V]
    for p in files:
        ids, mask = ids_and_mask(pq.read_table(p, columns=["input_ids", "loss_mask"]))
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def shard_files(data_dir: str | Path) -> list[Path]:
    """Every finished shard of the dataset, sorted (an empty list when there is none yet)."""
    return sorted(Path(data_dir).glob(SHARDS_GLOB))
