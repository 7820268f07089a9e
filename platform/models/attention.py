"""Paged-KV attention for varlen batches (PyTorch SDPA over gathered K/V).

This module is the one place that knows how attention is computed; swap it for flex_attention or
FlashAttention without touching the model code.

The contract with the engine
----------------------------
A forward processes a flat batch of T new tokens from B sequences, laid out sequence by sequence
(``query_lens[b]`` tokens of sequence b, in order). For every sequence:

- ``context_lens[b]`` tokens are already in the KV cache (cache indices 0..ctx-1 of that sequence);
- the new tokens are written to cache indices ctx..ctx+q-1 (in query order), i.e. to the slots
  ``slot_mapping`` [T] (slot = block_id * block_size + offset), before attention runs;
- query i of sequence b attends to all ``ctx`` cached tokens plus new tokens j with
  ``tree_masks[b][i, j]`` (True = may attend; must include i == j); without a tree mask, causal
  (j <= i). A tree mask lets one forward verify a token tree: each node sees its ancestors only.
  The engine moves accepted tree tokens into contiguous cache positions afterwards.
- ``sliding_window`` (Mistral): key k is visible to query q only if pos_k > pos_q - window, with
  cached tokens at positions 0..ctx-1 and new tokens at their ``positions``.

KV cache: :class:`KVCache` holds, per layer, K and V as [num_blocks, block_size, kv_heads, head_dim]
(stacked: [L, num_blocks, block_size, kv_heads, head_dim]); ``block_tables`` [B, max_blocks] int32
lists each sequence's blocks in order (-1 = unused entry). Under tensor parallelism each rank's
cache holds only its kv_heads / tp heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagleray.platform.errors import EaglerayError


@dataclass
class KVCache:
    """Paged K/V for ``L`` layers: k, v [L, num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None) -> "KVCache":
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device))

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


@dataclass
class AttentionMetadata:
    """Per-forward batch layout; build it with :meth:`build`."""

    query_lens: list[int]  # [B] new tokens per sequence
    context_lens: list[int]  # [B] tokens already cached per sequence
    block_tables: torch.Tensor | None  # [B, max_blocks] int32, -1 padded; None = no KV cache
    slot_mapping: torch.Tensor | None  # [T] int64 cache slot of every new token; None = no KV cache
    tree_masks: list[torch.Tensor | None] | None = None  # per sequence [q_b, q_b] bool, None = causal
    block_size: int = 0

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int] | None = None,
              block_tables: torch.Tensor | list[list[int]] | None = None, block_size: int = 0,
              tree_masks: list[torch.Tensor | None] | None = None, device=None) -> "AttentionMetadata":
        """Check the layout and compute ``slot_mapping``; no ``block_tables`` means no KV cache."""
        ctx = list(context_lens) if context_lens is not None else [0] * len(query_lens)
        if len(ctx) != len(query_lens):
            raise EaglerayError(f"attention: {len(query_lens)} query_lens but {len(ctx)} context_lens")
        if tree_masks is not None:
            _check_tree_masks(tree_masks, query_lens)
        if block_tables is None:
            if any(ctx):
                raise EaglerayError("attention: context_lens > 0 needs block_tables (a KV cache)")
            return cls(list(query_lens), ctx, None, None, tree_masks, 0)
        bt = torch.as_tensor(block_tables, dtype=torch.int32, device=device)  # [B, max_blocks]
        slots = _slot_mapping(query_lens, ctx, bt, block_size)  # [T]
        return cls(list(query_lens), ctx, bt, slots, tree_masks, block_size)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


def _check_tree_masks(masks: list[torch.Tensor | None], query_lens: list[int]) -> None:
    if len(masks) != len(query_lens):
        raise EaglerayError(f"attention: {len(masks)} tree masks for {len(query_lens)} sequences")
    for b, (m, q) in enumerate(zip(masks, query_lens)):
        if m is not None and tuple(m.shape) != (q, q):
            raise EaglerayError(f"attention: tree_masks[{b}] has shape {tuple(m.shape)}, expected ({q}, {q})")


def _slot_mapping(query_lens: list[int], ctx: list[int], bt: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot [T] of each new token: block_tables[b][idx // bs] * bs + idx % bs, idx = ctx+i."""
    if block_size <= 0:
        raise EaglerayError("attention: block_size must be > 0 when block_tables are given")
    out = []
    for b, (q, c) in enumerate(zip(query_lens, ctx)):
        idx = torch.arange(c, c + q, device=bt.device)  # [q]
        need = (c + q + block_size - 1) // block_size
        if need > bt.shape[1] or bool((bt[b, :need] < 0).any()):
            raise EaglerayError(f"attention: sequence {b} needs {need} blocks for {c + q} tokens but its block table "
                                f"has too few valid entries\n    fix: allocate blocks before the forward")
        out.append(bt[b, idx // block_size].to(torch.int64) * block_size + idx % block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=bt.device)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new k, v [T, Hkv, D] into one layer's cache [num_blocks, block_size, Hkv, D]."""
    flat_k = cache_k.view(-1, *cache_k.shape[2:])  # [num_blocks*block_size, Hkv, D]
    flat_v = cache_v.view(-1, *cache_v.shape[2:])  # [num_blocks*block_size, Hkv, D]
    flat_k[slot_mapping] = k.to(flat_k.dtype)
    flat_v[slot_mapping] = v.to(flat_v.dtype)


def _visible(b: int, q: int, c: int, meta: AttentionMetadata, qpos: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """Bool mask [q, c+q]: which keys each new query of sequence b may attend to."""
    new = meta.tree_masks[b] if meta.tree_masks is not None else None
    if new is None:
        new = torch.ones(q, q, dtype=torch.bool, device=qpos.device).tril()  # [q, q]
    ctx = torch.ones(q, c, dtype=torch.bool, device=qpos.device)  # [q, c]
    mask = torch.cat([ctx, new.to(device=qpos.device, dtype=torch.bool)], dim=1)  # [q, c+q]
    if window is not None:
        kpos = torch.cat([torch.arange(c, device=qpos.device), qpos])  # [c+q]
        mask = mask & (kpos.unsqueeze(0) > qpos.unsqueeze(1) - window)  # [q, c+q]
    return mask


def _gather(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cached tokens of one sequence from one layer's cache -> [n, Hkv, D]."""
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor] | None,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention for a varlen batch: q [T, Hq, D], k/v [T, Hkv, D] new tokens -> [T, Hq, D].

    With ``cache`` (this layer's K, V [num_blocks, block_size, Hkv, D]) the new k/v are written first
    and each sequence attends over its gathered context + new tokens; without, only over new tokens.
    Metadata that carries its own attention (``meta.attend``: the no-sync decode path of
    :mod:`eagleray.platform.models.attention_gpu`) computes it instead.
    """
    attend = getattr(meta, "attend", None)
    if attend is not None:
        return attend(q, k, v, cache, scale, sliding_window)
    if cache is None and meta.tree_masks is None and sliding_window is None:
        return _causal_prefill(q, k, v, meta.query_lens, scale)
    if cache is not None:
        if meta.slot_mapping is None:
            raise EaglerayError("attention: a KV cache was passed but the metadata has no block_tables")
        write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    out = torch.empty_like(q)  # [T, Hq, D]
    start = 0
    for b, (ql, c) in enumerate(zip(meta.query_lens, meta.context_lens)):
        end = start + ql
        if cache is not None:
            nblk = (c + ql + meta.block_size - 1) // meta.block_size
            blocks = meta.block_tables[b, :nblk].long()  # [nblk]
            kb = _gather(cache[0], blocks, c + ql).to(q.dtype)  # [c+q, Hkv, D]
            vb = _gather(cache[1], blocks, c + ql).to(q.dtype)  # [c+q, Hkv, D]
        else:
            kb, vb = k[start:end], v[start:end]  # [q, Hkv, D]
        mask = _visible(b, ql, c, meta, positions[start:end], sliding_window)  # [q, c+q]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1),  # [H, q|c+q, D]
            attn_mask=mask, scale=scale, enable_gqa=True)  # [Hq, q, D]
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


def _causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int],
                    scale: float) -> torch.Tensor:
    """No cache, causal: one SDPA call (flash on GPU) per run of equal lengths -> [T, Hq, D]."""
    out = torch.empty_like(q)  # [T, Hq, D]
    start, b = 0, 0
    while b < len(query_lens):
        n, ql = 1, query_lens[b]
        while b + n < len(query_lens) and query_lens[b + n] == ql:
            n += 1
        end = start + n * ql
        shape = (n, ql, q.shape[1], q.shape[2])
        qb = q[start:end].reshape(shape).transpose(1, 2)  # [n, Hq, q, D]
        kb = k[start:end].reshape(n, ql, *k.shape[1:]).transpose(1, 2)  # [n, Hkv, q, D]
        vb = v[start:end].reshape(n, ql, *v.shape[1:]).transpose(1, 2)  # [n, Hkv, q, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)  # [n, Hq, q, D]
        out[start:end] = o.transpose(1, 2).reshape(n * ql, *q.shape[1:])
        start, b = end, b + n
    return out
