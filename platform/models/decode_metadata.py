"""Decode attention metadata with no host synchronisation (one new token per sequence), for CUDA graphs.

:class:`DecodeMetadata` is the decode-only counterpart of
:class:`~eagleray.platform.models.attention.AttentionMetadata`: every field is a device tensor of a
fixed shape, nothing is read back to the host, so a decode step can be captured once per batch size
and replayed. ``paged_attention`` hands attention to the metadata when it carries its own
(``meta.attend``), so ``LlamaModel.forward`` runs unchanged on this path. The attention itself is
:mod:`eagleray.kernels.decode_attention` (the Triton kernel, or its PyTorch reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.kernels.decode_attention import decode_attention
from eagleray.kernels.reference_ops import write_kv
from eagleray.platform.errors import EaglerayError


@dataclass
class DecodeMetadata:
    """A decode batch of B sequences, one new token each; all tensors live on the model's device."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, entries past a sequence's length are ignored
    seq_lens: torch.Tensor  # [B] int32 tokens in the cache after writing the new one (>= 1)
    slot_mapping: torch.Tensor  # [B] int64 cache slot of each new token
    block_size: int
    use_triton: bool = False
    split_tokens: int | None = None  # fixed split-K length (a multiple of the tile): batch-invariant attention
    tail_start: torch.Tensor | None = None  # [B] int32 first position read from tail_slots (tree rows), or None
    tail_slots: torch.Tensor | None = None  # [B, W] int64 cache slot of position tail_start + j (a node's ancestors)

    # a fixed split read as one tile (one round of loads a program; class-wide, for measurements): off, because on the
    # H200 it made SmolLM2's batch-1 step 4% faster but its k=4 verification at 64 sequences 29% slower (BENCHMARKS.md)
    ONE_TILE_SPLITS = False

    @property
    def num_tokens(self) -> int:
        return self.seq_lens.shape[0]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Write k, v [B, Hkv, D] into ``cache``, then attend q [B, Hq, D] -> [B, Hq, D]."""
        if cache is None:
            raise EaglerayError("decode attention needs a KV cache\n    fix: pass kv_cache to the forward")
        write_kv(cache[0], cache[1], k, v, self.slot_mapping)
        return self.attend_cached(q, cache[0], cache[1], scale, sliding_window)

    def attend_cached(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, sliding_window: int | None = None
    ) -> torch.Tensor:
        """q [B, Hq, D] over one layer's paged cache [num_blocks, block_size, Hkv, D] (new K/V already in it) -> [B, Hq, D]."""
        return decode_attention(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            scale,
            sliding_window,
            tile=self.split_tokens if self.split_tokens and self.ONE_TILE_SPLITS else 64,
            split_tokens=self.split_tokens,
            reference=not self.use_triton,
            tail_start=self.tail_start,
            tail_slots=self.tail_slots,
        )
