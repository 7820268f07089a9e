"""Model runners: the target (forward with aux capture, paged KV) and the EAGLE-3 draft.

Both take a flat varlen batch described by :class:`ForwardBatch` and own their KV cache; the
block ids are shared (the block manager hands out one table per sequence for both caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.platform.models.attention import AttentionMetadata, KVCache
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.layers import fuse_for_inference
from eagleray.platform.models.llama import LlamaModel


@dataclass
class ForwardBatch:
    """Flat batch of new tokens, sequence by sequence."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    last_index: torch.Tensor  # [B] index in T of each sequence's last new token

    @classmethod
    def build(cls, tokens: list[list[int]], positions: list[list[int]], context_lens: list[int],
              block_tables: list[list[int]], block_size: int, device: torch.device,
              tree_masks: list[torch.Tensor | None] | None = None) -> "ForwardBatch":
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=device)  # [T]
        pos = torch.tensor([p for seq in positions for p in seq], dtype=torch.int64, device=device)  # [T]
        return cls.of(ids, pos, [len(t) for t in tokens], context_lens, block_tables, block_size, tree_masks)

    @classmethod
    def of(cls, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: list[int], context_lens: list[int],
           block_tables: list[list[int]] | torch.Tensor, block_size: int,
           tree_masks: list[torch.Tensor | None] | None = None) -> "ForwardBatch":
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
    """Runs the target decoder over a :class:`ForwardBatch`; captures aux states when asked."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = fuse_for_inference(model)
        self.block_size = block_size
        self.device = model.norm.weight.device
        self.kv: KVCache = model.make_kv_cache(num_blocks, block_size)
        self.workers = getattr(model, "tp_workers", None)  # TPWorkers on rank 0 of a tensor-parallel target
        self.runner_id = None
        if self.workers is not None:
            self.runner_id = self.workers.new_runner_id()
            self.workers.call("kv", self.runner_id, num_blocks, block_size)

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    def close(self) -> None:
        """Stop the tensor-parallel workers of this target (no-op for one rank)."""
        if self.workers is not None:
            self.workers.close()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> logits [S, V] fp32 at ``logits_index`` (default: every token), aux [T, A] or None."""
        if self.workers is not None:
            self.workers.call("forward", self.runner_id, batch, logits_index)
        hidden, aux = self.model(batch.input_ids, batch.positions, batch.attn, self.kv)  # [T, H], [T, A]
        if logits_index is not None:
            hidden = hidden[logits_index]  # [S, H]
        return self.model.compute_logits(hidden).float(), aux

    def move_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K/V of every layer from ``src_slots`` to ``dst_slots`` (tree compaction). [n] int64 each."""
        if self.workers is not None:
            self.workers.call("move_kv", self.runner_id, src_slots, dst_slots)
        copy_slots(self.kv, src_slots, dst_slots)


class DraftRunner:
    """Runs the EAGLE-3 draft layer; its one-layer cache uses the target's block ids."""

    def __init__(self, draft: Eagle3Draft, num_blocks: int, block_size: int):
        self.draft = fuse_for_inference(draft)
        self.block_size = block_size
        self.device = draft.norm.weight.device
        self.kv: KVCache = draft.make_kv_cache(num_blocks, block_size)

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


def copy_slots(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V [L, num_blocks, block_size, Hkv, D]: slot dst[i] <- slot src[i] in every layer."""
    if src.numel() == 0:
        return
    for cache in (kv.k, kv.v):
        flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [L, num_blocks*block_size, Hkv, D]
        flat[:, dst] = flat[:, src]  # the right side is gathered first, so overlaps are safe
