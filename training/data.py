"""Offline training data: datagen's hidden-state shards, streamed, shuffled and padded into batches.

Shard format (written by ``eagleray.datagen.shards``; read here directly because ``training`` may
not import ``datagen``): ``<data_dir>/shards/shard-*.parquet`` with columns ``prompt_id`` str,
``num_tokens`` int32, ``input_ids`` list<int32> [T], ``loss_mask`` list<int8> [T], ``aux_hidden``
and ``final_hidden`` large_binary (little-endian bf16, row-major [T, n_aux*H] and [T, H]);
``manifest.json`` (dataset_id, target_fingerprint, aux_layer_ids, hidden_size, ...) and
``vocab_counts.npy`` [V] (counts of loss-masked tokens).

Splits: a row is held out for evaluation when a hash of its ``prompt_id`` falls below
``eval_fraction`` (stable across runs and ranks). Ranks: shards are dealt round-robin when there
are at least as many shards as ranks, else rows are. Every rank cycles its share forever (epoch
e reshuffles with seed+e), so DDP ranks never run out at different steps. Batches are padded
(right) after grouping rows of similar length inside a shuffle buffer.
"""

from __future__ import annotations

import hashlib
import queue
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from eagleray.platform.errors import DataError
from eagleray.platform.shard_format import (  # noqa: F401
    count_loss_tokens,
    decode_bf16,
    read_manifest,
    read_vocab_counts,
    shard_files,
)
from eagleray.training.ttt import TTTBatch

COLUMNS = ["prompt_id", "num_tokens", "input_ids", "loss_mask", "aux_hidden", "final_hidden"]
Row = dict[str, Any]


def is_eval(prompt_id: str, eval_fraction: float) -> bool:
    """Stable held-out split by prompt id."""
    if eval_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(prompt_id.encode()).digest()[:8], "little") / 2**64
    return h < eval_fraction


def iter_rows(
    files: list[Path],
    *,
    rank: int = 0,
    world: int = 1,
    split: str = "train",
    eval_fraction: float = 0.0,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> Iterator[Row]:
    """This rank's raw rows of one epoch (hidden states still encoded)."""
    order = list(files)
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    by_shard = len(order) >= world
    mine = order[rank::world] if by_shard else order
    index = 0
    for path in mine:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=16, columns=COLUMNS):
            for row in batch.to_pylist():
                take = by_shard or index % world == rank
                index += 1
                if take and is_eval(row["prompt_id"], eval_fraction) == (split == "eval") and row["num_tokens"] >= 2:
                    yield row


def group(rows: Iterator[Row], batch_size: int, buffer: int, rng: random.Random | None) -> Iterator[list[Row]]:
    """Batches of ``batch_size`` rows: a shuffle buffer, sorted by length inside it, batch order shuffled."""
    pending: list[Row] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= max(buffer, batch_size):
            yield from _flush(pending, batch_size, rng)
            pending = []
    if pending:
        yield from _flush(pending, batch_size, rng)


def prefetch(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items`` produced by a background thread up to ``depth`` ahead, so CPU work (tokenizing, grouping) overlaps
    the device's. An exception in the producer is raised here, where its item would have come; closing this
    generator stops the producer and waits for it (at most the item it is making), so nothing else shares the
    producer's tools (a tokenizer) after the close."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put(("error", e))

    thread = threading.Thread(target=produce, name="eagleray-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()
        thread.join()


def _flush(rows: list[Row], batch_size: int, rng: random.Random | None) -> Iterator[list[Row]]:
    if rng is not None:
        rng.shuffle(rows)
        rows.sort(key=lambda r: r["num_tokens"])
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    if rng is not None:
        rng.shuffle(batches)
    yield from batches


def window(row: Row, max_seq_len: int) -> tuple[int, int]:
    """[start, end) of the tokens trained on: the last ``max_seq_len`` tokens that end at the last answer token.

    Long prompts (multi-turn ShareGPT) would otherwise push the loss-masked answer out of a
    window taken from the start. RoPE attention depends on relative positions only, so a window
    that starts mid-sequence needs no position offset; the aux states were computed over the
    full sequence by the target.
    """
    mask = row["loss_mask"]
    n = len(row["input_ids"])
    last = max((i for i in range(n - 1, -1, -1) if mask[i]), default=n - 1)
    end = last + 1
    return max(0, end - max_seq_len), end


def pad_tokens(rows: list[Row], max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """input_ids [B, T] int64, loss_mask [B, T] float, and each row's [start, end) window."""
    spans = [window(r, max_seq_len) for r in rows]
    t = max(e - s for s, e in spans)
    ids = torch.zeros(len(rows), t, dtype=torch.int64)  # [B, T]
    mask = torch.zeros(len(rows), t, dtype=torch.float32)  # [B, T]
    for b, (r, (s, e)) in enumerate(zip(rows, spans)):
        ids[b, : e - s] = torch.as_tensor(r["input_ids"][s:e], dtype=torch.int64)
        mask[b, : e - s] = torch.as_tensor(r["loss_mask"][s:e], dtype=torch.float32)
    return ids, mask, spans


def pad_hidden(parts: list[torch.Tensor], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Per-row [T_b, W] -> [B, T, W]: each row's [start, end) window, zeros after it."""
    t = max(e - s for s, e in spans)
    out = torch.zeros(len(parts), t, parts[0].shape[-1], dtype=torch.float32, device=parts[0].device)  # [B, T, W]
    for b, (x, (s, e)) in enumerate(zip(parts, spans)):
        out[b, : e - s] = x[s:e]
    return out


def collate(rows: list[Row], max_seq_len: int) -> TTTBatch:
    """Decode and pad shard rows into a :class:`TTTBatch`."""
    ids, mask, spans = pad_tokens(rows, max_seq_len)
    aux = pad_hidden([decode_bf16(r["aux_hidden"], r["num_tokens"]) for r in rows], spans)  # [B, T, n_aux*H]
    final = pad_hidden([decode_bf16(r["final_hidden"], r["num_tokens"]) for r in rows], spans)  # [B, T, H]
    return TTTBatch(ids, mask, aux, final)


def train_batches(
    files: list[Path],
    *,
    batch_size: int,
    max_seq_len: int,
    rank: int,
    world: int,
    seed: int,
    eval_fraction: float,
    shuffle_buffer: int,
    skip: int = 0,
    replay_files: list[Path] | None = None,
    replay_fraction: float = 0.0,
) -> Iterator[TTTBatch]:
    """Endless stream of this rank's training batches; ``skip`` batches are passed over undecoded (resume).

    With ``replay_files`` each row comes from them with probability ``replay_fraction`` (a seeded draw,
    so a resumed run sees the same stream), else from ``files``; both cycle forever."""
    if replay_files:
        kw = dict(rank=rank, world=world, seed=seed, eval_fraction=eval_fraction)
        rows = mix(endless_rows(files, **kw), endless_rows(replay_files, **kw), replay_fraction, random.Random(seed * 13 + rank))
        batches = group(rows, batch_size, shuffle_buffer, random.Random(seed * 7919 + rank))
        for produced, rows_b in enumerate(batches, 1):
            if produced > skip:
                yield collate(rows_b, max_seq_len)
        return  # not reached: the mixed stream is endless
    epoch, produced = 0, 0
    while True:
        rows = iter_rows(files, rank=rank, world=world, eval_fraction=eval_fraction, seed=seed, epoch=epoch)
        n_epoch = 0
        for rows_b in group(rows, batch_size, shuffle_buffer, random.Random(seed * 7919 + epoch * 31 + rank)):
            n_epoch += 1
            produced += 1
            if produced > skip:
                yield collate(rows_b, max_seq_len)
        if n_epoch == 0:
            raise DataError(
                f"rank {rank} of {world} got no training rows from {len(files)} shard(s)\n"
                f"    fix: lower eval_fraction or num_workers, or generate more data"
            )
        epoch += 1


def endless_rows(files: list[Path], *, rank: int, world: int, seed: int, eval_fraction: float) -> Iterator[Row]:
    """This rank's training rows of ``files``, epoch after epoch (each reshuffled)."""
    epoch = 0
    while True:
        n = 0
        for row in iter_rows(files, rank=rank, world=world, eval_fraction=eval_fraction, seed=seed, epoch=epoch):
            n += 1
            yield row
        if n == 0:
            raise DataError(
                f"rank {rank} of {world} got no training rows from {len(files)} shard(s)\n"
                f"    fix: lower eval_fraction or num_workers, or generate more data"
            )
        epoch += 1


def mix(primary: Iterator[Row], replay: Iterator[Row], fraction: float, rng: random.Random) -> Iterator[Row]:
    """Rows of ``replay`` with probability ``fraction``, else of ``primary`` (both endless)."""
    while True:
        yield next(replay) if rng.random() < fraction else next(primary)


def eval_batches(
    files: list[Path], *, batch_size: int, max_seq_len: int, eval_fraction: float, max_batches: int | None = None
) -> Iterator[TTTBatch]:
    """The held-out rows once, in a fixed order (all ranks' data; run on one rank)."""
    rows = iter_rows(files, split="eval", eval_fraction=eval_fraction, shuffle=False)
    for n, rows_b in enumerate(group(rows, batch_size, batch_size, None)):
        if max_batches is not None and n >= max_batches:
            return
        yield collate(rows_b, max_seq_len)
