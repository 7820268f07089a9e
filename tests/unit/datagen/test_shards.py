"""Shard schema, the bf16 encoding round trip, atomic writes."""

import pyarrow.parquet as pq
import pytest
import torch

from eagleray.datagen import shards
from eagleray.platform.errors import DataError


def _row(pid: str, t: int, n_aux: int = 3, h: int = 8, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(t, n_aux * h, generator=g) * 100  # [T, n_aux*H]
    final = torch.randn(t, h, generator=g)  # [T, H]
    row = {
        "prompt_id": pid,
        "source": "s",
        "response": "r",
        "num_tokens": t,
        "truncated": False,
        "input_ids": list(range(t)),
        "loss_mask": [0] * (t - 2) + [1, 1],
        "aux_hidden": shards.encode_bf16(aux),
        "final_hidden": shards.encode_bf16(final),
    }
    return row, aux, final


def test_bf16_round_trip_is_bit_exact():
    x = torch.randn(5, 24) * 1e3
    y = shards.decode_bf16(shards.encode_bf16(x), 5)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 24)
    assert torch.equal(y, x.to(torch.bfloat16))


def test_fp32_encodes_as_torchs_bf16_rounding_in_numpy():
    """A CPU fp32 tensor is encoded without torch (numpy): the bits of ``x.to(bfloat16)`` for every magnitude, ties
    (to even), infinities, signed zeros, subnormals and a strided view; NaN as bf16's quiet NaN; the bf16 and GPU
    path unchanged."""
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * torch.logspace(-44, 38, 64)[:, None]
    x[0, :8] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3.3895314e38, 1e-45, -1e-45, 1.0000001])
    x[1, :4] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 2.0**-130])  # halfway: to even
    for t in (x, x[:, 3:29], x.t()):
        assert shards.encode_bf16(t) == t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    nan = torch.tensor([[0x7FFFFFFF, 0x7FC00000]], dtype=torch.int32).view(torch.float32)  # rounding would carry out
    assert shards.encode_bf16(nan) == bytes.fromhex("c07fc07f")
    b = x.to(torch.bfloat16)
    assert shards.encode_bf16(b) == shards.encode_bf16(x)


def test_decode_rejects_wrong_length():
    with pytest.raises(DataError, match="does not hold 3 bf16 rows"):
        shards.decode_bf16(b"\x00" * 10, 3)


def test_shard_schema_and_reader(tmp_path):
    rows = [_row("a", 7, seed=1), _row("b", 3, seed=2)]
    path = shards.shard_path(tmp_path, "c1")
    size = shards.write_shard(path, [r for r, _, _ in rows], {"aux_layer_ids": "[2, 4, 5]"})
    assert size == path.stat().st_size > 0
    pf = pq.ParquetFile(path)
    assert pf.schema_arrow.remove_metadata().equals(shards.SHARD_SCHEMA)
    assert pf.schema_arrow.metadata[b"aux_layer_ids"] == b"[2, 4, 5]"
    got = list(shards.iter_rows(tmp_path))
    assert [g["prompt_id"] for g in got] == ["a", "b"]
    for g, (_, aux, final) in zip(got, rows):
        assert g["aux_hidden"].dtype == torch.bfloat16 and torch.equal(g["aux_hidden"], aux.to(torch.bfloat16))
        assert torch.equal(g["final_hidden"], final.to(torch.bfloat16))
        assert g["input_ids"].dtype == torch.int64 and g["loss_mask"].dtype == torch.int8
    assert shards.written_ids(tmp_path) == ["a", "b"]


def test_failed_write_leaves_no_file(tmp_path):
    path = shards.shard_path(tmp_path, "c2")

    def boom(tmp):
        assert tmp.exists() and not path.exists()
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        shards.write_shard(path, [_row("a", 2)[0]], {}, before_rename=boom)
    assert not path.exists() and list(path.parent.iterdir()) == []


def test_remove_tmp_files(tmp_path):
    d = tmp_path / shards.SHARDS_DIR
    d.mkdir()
    (d / ".tmp-1234-shard-x.parquet").write_bytes(b"half")
    (d / "shard-y.parquet").write_bytes(b"done")
    assert shards.remove_tmp_files(tmp_path) == 1
    assert [p.name for p in d.iterdir()] == ["shard-y.parquet"]
