"""Capture shards on disk: names in time order, retention, the size cap, snapshots training reads."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from eagleray.platform import capture_store
from eagleray.platform.errors import DataError
from eagleray.platform.shard_format import encode_bf16, read_manifest, read_vocab_counts
from eagleray.training import data

H, N_AUX = 8, 3


def row(i: int, prompt: int = 3, answer: int = 4) -> dict:
    n = prompt + answer
    return {
        "prompt_id": f"req-{i}",
        "source": "traffic",
        "response": "x",
        "num_tokens": n,
        "truncated": False,
        "input_ids": list(range(i, i + n)),
        "loss_mask": [0] * prompt + [1] * answer,
        "aux_hidden": encode_bf16(torch.randn(n, N_AUX * H)),
        "final_hidden": encode_bf16(torch.randn(n, H)),
    }


def meta(last_ms: int, aux=(1, 2, 3), fp="fp-a") -> dict:
    return {
        "target_fingerprint": fp,
        "tokenizer_fingerprint": "tok",
        "hidden_size": H,
        "aux_layer_ids": list(aux),
        "first_ms": last_ms - 10,
        "last_ms": last_ms,
    }


def test_shards_list_in_time_order_and_a_window_selects_by_time(tmp_path):
    for t in (3000, 1000, 2000):
        capture_store.write_shard(tmp_path, [row(t)], meta(t))
    assert [s.last_ms for s in capture_store.list_shards(tmp_path)] == [1000, 2000, 3000]
    assert [s.last_ms for s in capture_store.window(tmp_path, since_ms=1000, until_ms=2500)] == [2000]
    assert capture_store.count_rows(capture_store.list_shards(tmp_path)) == 3
    assert not list((tmp_path / "shards").glob(".tmp-*"))


def test_retention_deletes_old_shards_and_the_cap_the_oldest(tmp_path):
    now = int(time.time() * 1000)
    day = 86_400_000
    for t in (now - 3 * day, now - 2, now - 1, now):
        capture_store.write_shard(tmp_path, [row(t % 1000)], meta(t))
    out = capture_store.enforce_limits(tmp_path, max_bytes=10**9, retention_s=2 * 86400, now_ms=now)
    assert out["expired"] == 1 and len(capture_store.list_shards(tmp_path)) == 3
    one = capture_store.list_shards(tmp_path)[0].bytes
    out = capture_store.enforce_limits(tmp_path, max_bytes=2 * one + one // 2, retention_s=2 * 86400, now_ms=now)
    assert out["evicted"] == 1
    assert [s.last_ms for s in capture_store.list_shards(tmp_path)] == [now - 1, now]  # the newest kept


def test_snapshot_is_a_dataset_training_reads(tmp_path):
    src, out = tmp_path / "capture", tmp_path / "snap"
    capture_store.write_shard(src, [row(i) for i in range(4)], meta(1000))
    capture_store.write_shard(src, [row(10 + i) for i in range(4)], meta(2000))
    manifest = capture_store.snapshot(capture_store.list_shards(src), out, vocab_size=64)
    assert read_manifest(out) == manifest and manifest["rows"] == 8 and manifest["aux_layer_ids"] == [1, 2, 3]
    assert (manifest["window_first_ms"], manifest["window_last_ms"]) == (990, 2000)
    assert int(read_vocab_counts(out).sum()) == manifest["loss_tokens"] == 8 * 4
    for s in capture_store.list_shards(src):  # hard links: retention deleting the source keeps the snapshot
        assert os.path.samefile(s.path, out / "shards" / s.path.name)
        s.path.unlink()
    batch = next(
        data.train_batches(
            data.shard_files(out), batch_size=2, max_seq_len=64, rank=0, world=1, seed=0, eval_fraction=0.0, shuffle_buffer=4
        )
    )
    assert batch.aux.shape[-1] == N_AUX * H and batch.final_hidden.shape[-1] == H


def test_snapshot_keeps_the_newest_aux_layer_set(tmp_path):
    src = tmp_path / "capture"
    capture_store.write_shard(src, [row(1)], meta(1000, aux=(1, 2, 3)))
    capture_store.write_shard(src, [row(2)], meta(2000, aux=(2, 4, 6)))
    manifest = capture_store.snapshot(capture_store.list_shards(src), tmp_path / "snap", vocab_size=64)
    assert manifest["aux_layer_ids"] == [2, 4, 6] and manifest["skipped_shards"] == 1 and manifest["rows"] == 1


def test_snapshot_of_nothing_is_an_error(tmp_path):
    with pytest.raises(DataError, match="capture more traffic"):
        capture_store.snapshot([], tmp_path / "snap", vocab_size=64)


def test_adapt_status_round_trip(tmp_path):
    assert capture_store.read_adapt_status(tmp_path) is None
    capture_store.write_adapt_status(tmp_path, {"promoted": True, "at": 1.0})
    assert capture_store.read_adapt_status(tmp_path) == {"promoted": True, "at": 1.0}
    assert json.loads((tmp_path / "adapt" / "last.json").read_text())["promoted"] is True


def _served(prompt: list[int], answer: list[int]):
    from eagleray.serve.engine.outputs import CapturedHidden, RequestOutput

    n = len(prompt) + len(answer) - 1
    hidden = CapturedHidden(torch.randn(n, N_AUX * H), torch.randn(n, H), [1, 2, 3])
    return RequestOutput("r", prompt, answer, "x", answer, "x", True, "length", hidden=hidden)


def test_requests_of_one_prompt_share_its_id_and_one_side_of_the_gates_hold_out(tmp_path):
    """A captured row's prompt_id is a hash of its prompt tokens, not the request id: several answers to one prompt
    (retries, sampled repeats) are all trained on or all held out, and the gate measures a held-out prompt once."""
    from eagleray.jobs.adapt import held_out_prompts
    from eagleray.serve.capture import prompt_key, shard_row

    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    rows = []
    for p in range(40):
        prompt = [p, p + 1, p + 2]
        for r in range(3):  # three requests of the prompt with different answers
            got = shard_row(f"req-{p}-{r}", prompt, _served(prompt, [100 + r, 101, 102]))
            assert isinstance(got, dict) and got["prompt_id"] == prompt_key(prompt)
            got.pop("_aux_layer_ids")
            rows.append(got)
    capture_store.write_shard(tmp_path / "cap", rows, meta(1000))
    capture_store.snapshot(capture_store.list_shards(tmp_path / "cap"), tmp_path / "snap", vocab_size=256)
    files = data.shard_files(tmp_path / "snap")
    held = {tuple(r["input_ids"][:3]) for r in data.iter_rows(files, split="eval", eval_fraction=0.3, shuffle=False)}
    train = {tuple(r["input_ids"][:3]) for r in data.iter_rows(files, split="train", eval_fraction=0.3, shuffle=False)}
    assert held and train and not held & train
    gate = held_out_prompts(tmp_path / "snap", 0.3, limit=100)
    assert sorted(map(tuple, gate)) == sorted(held)  # each held-out prompt once, not once per request


def test_a_shard_stores_hidden_states_uncompressed_and_the_rest_zstd(tmp_path):
    """The writer spends no zstd on the bf16 hidden states (they barely shrink; the CPU is the serving engine's), the
    other columns are zstd; the rows read back as written."""
    import pyarrow.parquet as pq

    rows = [row(0), row(1)]
    path = capture_store.write_shard(tmp_path, rows, meta(1_000))
    col = pq.ParquetFile(path).metadata.row_group(0)
    codecs = {col.column(i).path_in_schema.split(".")[0]: col.column(i).compression for i in range(col.num_columns)}
    assert codecs["aux_hidden"] == codecs["final_hidden"] == "UNCOMPRESSED"
    assert {c for name, c in codecs.items() if not name.endswith("_hidden")} == {"ZSTD"}
    back = pq.read_table(path).to_pylist()
    assert [r["aux_hidden"] for r in back] == [r["aux_hidden"] for r in rows]
