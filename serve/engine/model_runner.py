"""Model runners: the target (forward with aux capture, paged KV) and the EAGLE-3 draft.

Both take a flat varlen batch described by :class:`ForwardBatch` and own their KV cache; the
block ids are shared (the block manager hands out one table per sequence for both caches).

On CUDA the target also scores :class:`DecodeRows` - plain decode (a row per sequence), chain
verification (k+1 rows per sequence) and tree verification (a row per node, with tails) - through the batch-invariant fused step replayed from CUDA
graphs (:class:`~eagleray.platform.models.graphs.DecodeGraphRunner`): one launch sequence per
bucket, no host synchronisation, and a row's logits bitwise independent of the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.models.attention import AttentionMetadata, KVCache
from eagleray.platform.models.draft_graphs import DraftGraphRunner
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.layers import fuse_for_inference, pack_for_cpu
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows


@dataclass
class ForwardBatch:
    """Flat batch of new tokens, sequence by sequence."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    last_index: torch.Tensor  # [B] index in T of each sequence's last new token

    @classmethod
    def build(
        cls,
        tokens: list[list[int]],
        positions: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        tree_masks: list[torch.Tensor | None] | None = None,
    ) -> "ForwardBatch":
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=device)  # [T]
        pos = torch.tensor([p for seq in positions for p in seq], dtype=torch.int64, device=device)  # [T]
        return cls.of(ids, pos, [len(t) for t in tokens], context_lens, block_tables, block_size, tree_masks)

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]] | torch.Tensor,
        block_size: int,
        tree_masks: list[torch.Tensor | None] | None = None,
    ) -> "ForwardBatch":
        """From token tensors already on the device: input_ids, positions [T] int64, sequence by sequence;
        ``block_tables`` as lists or as a :func:`block_table_tensor` made once for several forwards."""
        device = input_ids.device
        table = block_tables if isinstance(block_tables, torch.Tensor) else block_table_tensor(block_tables, device)
        attn = AttentionMetadata.build(query_lens, context_lens, table, block_size, tree_masks, device)
        last = torch.tensor(query_lens, device=device).cumsum(0) - 1  # [B]
        return cls(input_ids, positions, attn, last)


def block_table_tensor(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Per-sequence block ids -> [B, max_blocks] int32 on ``device``, -1 padded."""
    width = max(max((len(b) for b in block_tables), default=0), 1)
    return torch.tensor([b + [-1] * (width - len(b)) for b in block_tables], dtype=torch.int32).to(device)


class TargetRunner:
    """Runs the target decoder over a :class:`ForwardBatch`; captures aux states when asked.

    ``max_rows`` > 0 (CUDA, one rank): :meth:`decode` scores :class:`DecodeRows` through CUDA graphs
    of the batch-invariant fused step, for up to ``max_rows`` rows of ``max_blocks`` blocks each; the
    cache's last slot takes the padding rows' K/V, so the block manager must not hand out the last block.
    ``tail_width`` > 0: rows may carry tails of that many positions (a draft tree's depth + 1).
    """

    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, max_rows: int = 0, max_blocks: int = 0, tail_width: int = 0
    ):
        self.model, self.device, self.kv = prepare_for_steps(model, num_blocks, block_size)
        self.block_size = block_size
        self.workers = getattr(model, "tp_workers", None)  # TPWorkers on rank 0 of a tensor-parallel target
        self.runner_id = None
        if self.workers is not None:
            self.runner_id = self.workers.new_runner_id()
            self.workers.call("kv", self.runner_id, num_blocks, block_size)
        self.capture_final = False  # serving capture: forward appends the final normed hidden [T, H] to aux
        self.rows: DecodeGraphRunner | None = None
        self.tail_width = tail_width
        if max_rows > 0:
            self.rows = DecodeGraphRunner(
                self.model, self.kv, max_blocks, buckets=row_buckets(max_rows), invariant=True, lazy=True, tail_width=tail_width
            )

    @torch.inference_mode()
    def decode(self, rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> logits [R, V] fp32, aux [R, A] or None (views valid until the next call)."""
        logits, aux = self.rows.run(rows)
        return logits.float(), (None if aux is None else aux.clone())  # aux outlives the next replay

    @torch.inference_mode()
    def prefill_rows(self, rows: DecodeRows, last: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score prompt ``rows`` (sequence by sequence, in position order) in replays of the largest bucket ->
        logits [B, V] fp32 of the rows ``last`` (each sequence's last), aux [R, A] of every row or None. Also a
        tree's rows (every row in ``last``): a node's ancestors come before it, in its replay or an earlier one."""
        chunk, picked, aux_parts = self.rows.buckets[-1], [], []
        for start in range(0, rows.num_rows, chunk):
            logits, aux = self.rows.run(rows.slice(start, start + chunk))  # views valid until the next replay
            mine = [r - start for r in last if start <= r < start + chunk]
            if mine:
                picked.append(logits.index_select(0, torch.tensor(mine, device=logits.device)).float())  # [b, V]
            if aux is not None:
                aux_parts.append(aux.clone())  # [chunk rows, A]
        aux = None if not aux_parts else aux_parts[0] if len(aux_parts) == 1 else torch.cat(aux_parts)
        return torch.cat(picked) if len(picked) > 1 else picked[0], aux

    @torch.inference_mode()
    def decode_staged(self, staged: torch.Tensor, bucket: int, n: int):
        """A plain decode batch of ``n`` sequences staged on the device (:meth:`DecodeGraphRunner.run_staged`) ->
        logits [n, V] (a static view), greedy tokens [n], aux [n, A] or None (a copy: it outlives the next replay)."""
        logits, greedy, aux = self.rows.run_staged(staged, bucket)
        return logits[:n], greedy[:n], (None if aux is None else aux[:n].clone())

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    def close(self) -> None:
        """Stop the tensor-parallel workers of this target (no-op for one rank)."""
        if self.workers is not None:
            self.workers.close()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> logits [S, V] fp32 at ``logits_index`` (default: every token), aux [T, A] or None
        ([T, A + H] with ``capture_final``: the final normed hidden state appended)."""
        rows = self.last_rows(logits_index)
        if self.workers is not None:  # rank 0's choice of rows: a worker's model captures no aux layers
            self.workers.call("forward", self.runner_id, batch, logits_index, rows)
        return self.forward_rows(batch, logits_index, rows)

    def last_rows(self, logits_index: torch.Tensor | None) -> torch.Tensor | None:
        """The rows the model's last layer carries on past attention: ``logits_index``, or None (every row) when every
        row's final state is wanted (``capture_final``, or the final pre-norm state as an aux layer)."""
        aux_ids = self.model.aux_layer_ids
        every = (self.capture_final and bool(aux_ids)) or self.model.arch.num_layers in aux_ids
        return None if every else logits_index

    @torch.inference_mode()
    def forward_rows(
        self, batch: ForwardBatch, logits_index: torch.Tensor | None, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` with the last layer's rows chosen (:meth:`last_rows`; a tensor-parallel worker gets rank 0's)."""
        hidden, aux = self.model(batch.input_ids, batch.positions, batch.attn, self.kv, rows)  # [T or S, H], [T, A]
        if self.capture_final and aux is not None:
            aux = torch.cat([aux, hidden], dim=-1)  # [T, A + H]: the final normed state rides with the aux rows
        if rows is None and logits_index is not None:
            hidden = hidden[logits_index]  # [S, H]
        return self.model.compute_logits(hidden).float(), aux

    def move_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K/V of every layer from ``src_slots`` to ``dst_slots`` (tree compaction). [n] int64 each."""
        if self.workers is not None:
            self.workers.call("move_kv", self.runner_id, src_slots, dst_slots)
        copy_slots(self.kv, src_slots, dst_slots)


class DraftRunner:
    """Runs the EAGLE-3 draft layer; its one-layer cache uses the target's block ids.

    ``max_rows`` > 0: :meth:`decode` runs :class:`DecodeRows` (catch-up and chain steps, a tree's nodes with tails of
    up to ``tail_width`` positions) through CUDA graphs on CUDA; the cache's last slot takes the padding rows' K/V.
    """

    def __init__(
        self, draft: Eagle3Draft, num_blocks: int, block_size: int, max_rows: int = 0, max_blocks: int = 0, tail_width: int = 0
    ):
        self.draft, self.device, self.kv = prepare_for_steps(draft, num_blocks, block_size)
        self.block_size = block_size
        self.max_rows = max_rows
        self.rows: DraftGraphRunner | None = None
        if max_rows > 0:
            self.rows = DraftGraphRunner(self.draft, self.kv, max_rows, max_blocks, row_buckets(max_rows), tail_width=tail_width)

    @torch.inference_mode()
    def decode(self, rows: DecodeRows, hidden: torch.Tensor, from_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [R, n_aux*H_t] (from_aux) or [R, H] -> logits [R, Vd] in the draft's dtype (argmax needs no fp32
        copy; sampling converts), next hidden [R, H] (views valid until the next call)."""
        return self.rows.run(rows, hidden, from_aux)

    @property
    def num_aux(self) -> int:
        return self.draft.num_aux

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, from_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, n_aux*H_t] (from_aux) or [T, H] -> normed [T, H], next_hidden [T, H]."""
        h = self.draft.combine_hidden_states(hidden) if from_aux else hidden  # [T, H]
        return self.draft(batch.input_ids, batch.positions, h, batch.attn, self.kv)

    @torch.inference_mode()
    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, Vd] fp32
        return self.draft.compute_logits(normed).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft.to_target_ids(draft_ids)

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft.d2t


def prepare_for_steps(
    module: LlamaModel | Eagle3Draft, num_blocks: int, block_size: int
) -> tuple[LlamaModel | Eagle3Draft, torch.device, KVCache]:
    """A target or draft made ready for engine steps -> (the module fused for inference, its device, its paged
    KV cache of ``num_blocks`` x ``block_size``). On a CPU with the native kernels its weights are packed here,
    at load, not in the first request's steps."""
    module = fuse_for_inference(module)
    device = module.norm.weight.device
    if device.type == "cpu" and cpu_decode.status() == "native":
        pack_for_cpu(module)
    kv: KVCache = module.make_kv_cache(num_blocks, block_size)
    return module, device, kv


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Powers of two below ``max_rows``, then ``max_rows`` itself: the graph sizes a batch is padded to."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (max_rows,)


def copy_slots(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V [L, num_blocks, block_size, Hkv, D]: slot dst[i] <- slot src[i] in every layer."""
    if src.numel() == 0:
        return
    for cache in (kv.k, kv.v):
        flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [L, num_blocks*block_size, Hkv, D]
        flat[:, dst] = flat[:, src]  # the right side is gathered first, so overlaps are safe
