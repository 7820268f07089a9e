"""Online training data: the target computes aux and final hidden states per batch (no shard storage).

Input: conversations whose last message is the assistant answer to learn (best: answers the
target itself generated). Each is chat-templated with the target's tokenizer; the loss mask
covers the last assistant message's tokens (from the end of the generation prompt through the
tokenizer's eos, like datagen). Rows are split across ranks by index; held-out rows by prompt id.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from eagleray.platform.config.schemas import TrainingConfig
from eagleray.platform.errors import DataError
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.prompts.sources import iter_prompts
from eagleray.platform.prompts.template import RowError, tokenize_conversation_with_mask, tokenize_with_mask
from eagleray.training.data import Row, group, is_eval, pad_hidden, pad_tokens, prefetch
from eagleray.training.ttt import TTTBatch


def tokenize(tok, messages: list[dict], max_seq_len: int, loss_turns: str = "last") -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask) of a conversation ending with an assistant message (the loss mask datagen
    writes, :func:`~eagleray.platform.prompts.template.tokenize_with_mask`; with ``loss_turns`` 'all' every
    assistant message, :func:`~eagleray.platform.prompts.template.tokenize_conversation_with_mask`); None if it
    does not end so."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return None
    try:
        if loss_turns == "all":
            t = tokenize_conversation_with_mask(tok, messages, max_seq_len)
        else:
            t = tokenize_with_mask(tok, messages[:-1], messages[-1]["content"], max_seq_len)
    except RowError:  # the template of prompt + answer does not start with the templated prompt
        return None
    return t.input_ids, t.loss_mask


def iter_online_rows(cfg: TrainingConfig, tok, *, split: str = "train") -> Iterator[Row]:
    """Tokenized rows of every online source (in file order)."""
    assert cfg.online is not None
    for source in cfg.online.prompts:
        for rec in iter_prompts(source, limit=cfg.online.limit):
            if is_eval(rec.prompt_id, cfg.eval_fraction) != (split == "eval"):
                continue
            out = tokenize(tok, [m.to_dict() for m in rec.messages], cfg.max_seq_len, cfg.online.loss_turns)
            if out is not None and sum(out[1]) > 0:
                yield {"prompt_id": rec.prompt_id, "input_ids": out[0], "loss_mask": out[1], "num_tokens": len(out[0])}


def online_vocab_counts(cfg: TrainingConfig, tok, vocab_size: int) -> torch.Tensor:
    """Counts [V] of loss-masked tokens over the first ``online.vocab_count_rows`` conversations."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    n = 0
    for row in iter_online_rows(cfg, tok):
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        n += 1
        if n >= cfg.online.vocab_count_rows:
            break
    if n == 0:
        raise DataError(
            f"training.online.prompts {cfg.online.prompts}: no conversation ends with an assistant message\n"
            f"    fix: give conversations whose last message is the answer to learn (e.g. datagen's regenerated responses)"
        )
    return counts


PREFETCH_BATCHES = 8  # tokenized batches the first epoch's background thread may run ahead


class OnlineTarget:
    """The target on the training device, filling a batch's aux/final hidden states."""

    def __init__(self, target_dir: Path, aux_layer_ids: list[int], device: torch.device, dtype: str):
        from eagleray.platform.models.tp import TPInfo

        self.model = LlamaModel.from_dir(target_dir, dtype=dtype, device=device, tp=TPInfo(), aux_layer_ids=aux_layer_ids)
        self.device = device

    @torch.no_grad()  # not inference_mode: the outputs feed autograd-tracked training
    def batch(self, rows: list[Row], max_seq_len: int) -> TTTBatch:
        ids, mask, spans = pad_tokens(rows, max_seq_len)  # [B, T]; the target sees only each row's window
        lens = [e - s for s, e in spans]
        flat = torch.cat([ids[b, :n] for b, n in enumerate(lens)]).to(self.device)  # [sum T]
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.device)  # [sum T]
        final, aux = self.model(flat, pos, AttentionMetadata.build(lens), None)  # [sum T, H], [sum T, n_aux*H]
        aux_parts = list(aux.float().split(lens))  # stay on the training device: no host round trip per batch
        final_parts = list(final.float().split(lens))
        local = [(0, n) for n in lens]
        return TTTBatch(ids, mask, pad_hidden(aux_parts, local), pad_hidden(final_parts, local))


def online_batches(cfg: TrainingConfig, tok, target: OnlineTarget, *, rank: int, world: int, skip: int = 0) -> Iterator[TTTBatch]:
    """Endless stream of this rank's online batches (epoch e reshuffles with seed+e). The first epoch tokenizes
    (chat template + mask) on a background thread, ahead of the target and the draft on the device; later
    epochs reuse those rows (compact arrays), so only the first pays for it."""
    epoch, produced = 0, 0
    cache: list[Row] = []
    while True:
        if epoch == 0:
            rows = (_keep(r, cache) for i, r in enumerate(iter_online_rows(cfg, tok)) if i % world == rank)
        else:
            rows = iter(cache)
        n_epoch = 0
        groups = group(rows, cfg.batch_size, cfg.shuffle_buffer, random.Random(cfg.seed * 7919 + epoch * 31 + rank))
        for rows_b in prefetch(groups, PREFETCH_BATCHES) if epoch == 0 else groups:
            n_epoch += 1
            produced += 1
            if produced > skip:
                yield target.batch(rows_b, cfg.max_seq_len)
        if n_epoch == 0:
            raise DataError(
                f"rank {rank} of {world} got no online training rows\n    fix: add conversations or lower num_workers"
            )
        epoch += 1


def _keep(row: Row, cache: list[Row]) -> Row:
    """``row`` with its token lists as compact arrays, appended to ``cache``."""
    row = {
        **row,
        "input_ids": np.asarray(row["input_ids"], dtype=np.int32),
        "loss_mask": np.asarray(row["loss_mask"], dtype=np.int8),
    }
    cache.append(row)
    return row


def online_eval_batches(cfg: TrainingConfig, tok, target: OnlineTarget) -> Iterator[TTTBatch]:
    rows = iter_online_rows(cfg, tok, split="eval")
    for n, rows_b in enumerate(group(rows, cfg.batch_size, cfg.batch_size, None)):
        if cfg.eval_batches is not None and n >= cfg.eval_batches:
            return
        yield target.batch(rows_b, cfg.max_seq_len)
