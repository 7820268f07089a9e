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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from eagleray.kernels import cpu_decode
from eagleray.kernels.reference_ops import write_kv
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models import attention_host

# Not cuDNN: its attention builds an execution plan for every new shape, ~1.5 ms of host time a layer (measured on
# the H200: 46 ms of a 79 ms one-prompt prefill of SmolLM2); flash, memory-efficient and math attention need none.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on :data:`SDPA_BACKENDS`."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@dataclass
class KVCache:
    """Paged K/V for ``L`` layers: k, v [L, num_blocks, block_size, kv_heads, head_dim]."""

    k: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> "KVCache":
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
    layouts: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # sliding window -> BatchLayout, built once per forward

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int] | None = None,
        block_tables: torch.Tensor | list[list[int]] | None = None,
        block_size: int = 0,
        tree_masks: list[torch.Tensor | None] | None = None,
        device=None,
    ) -> "AttentionMetadata":
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
    """Cache slot [T] of each new token: block_tables[b][idx // bs] * bs + idx % bs, idx = ctx+i (vectorised)."""
    if block_size <= 0:
        raise EaglerayError("attention: block_size must be > 0 when block_tables are given")
    dev = bt.device
    if attention_host.use_host(sum(query_lens), dev):
        return attention_host.slot_mapping(query_lens, ctx, bt, block_size)
    need = [(c + q + block_size - 1) // block_size for c, q in zip(ctx, query_lens)]
    short = [b for b, n in enumerate(need) if n > bt.shape[1]]
    ql = torch.tensor(query_lens, device=dev)  # [B]
    seq = torch.repeat_interleave(torch.arange(len(query_lens), device=dev), ql)  # [T] sequence of each token
    first = torch.tensor(ctx, device=dev) - (ql.cumsum(0) - ql)  # [B] idx - row offset
    idx = torch.arange(seq.shape[0], device=dev) + first[seq]  # [T] cache index within the sequence
    blocks = bt[seq, (idx // block_size).clamp(max=max(bt.shape[1] - 1, 0))].to(torch.int64) if bt.shape[1] else idx * 0 - 1
    if short or bool((blocks < 0).any()):
        b = short[0] if short else int(seq[blocks < 0][0])
        raise EaglerayError(
            f"attention: sequence {b} needs {need[b]} blocks for {ctx[b] + query_lens[b]} tokens but its block table "
            f"has too few valid entries\n    fix: allocate blocks before the forward"
        )
    return blocks * block_size + idx % block_size


@dataclass
class BatchLayout:
    """How one forward's varlen batch maps onto a padded [B, Qmax] x [B, Lmax] attention; built once,
    shared by every layer (this is what keeps the per-layer cost to a gather and one SDPA call).

    Keys are the cache slots 0..ctx+q-1 of each sequence, padded at the end (masked), so a query's
    softmax and weighted sum see the same values in the same order whatever else is in the batch.
    """

    q_index: torch.Tensor | None  # [B*Qmax] rows of T laid out as [B, Qmax] (None: every sequence has Qmax queries)
    out_index: torch.Tensor | None  # [T] rows of [B*Qmax] that are real queries (None: all are)
    kv_slots: torch.Tensor  # [B, Lmax] int64 flat cache slot of each key (padding -> slot of key 0)
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool, True = may attend
    qmax: int


def batch_layout(meta: AttentionMetadata, positions: torch.Tensor, window: int | None) -> BatchLayout:
    """The padded layout of ``meta`` (cached on it per sliding window)."""
    layout = meta.layouts.get(window)
    if layout is None:
        layout = meta.layouts[window] = _build_layout(meta, positions, window)
    return layout


def _build_layout(meta: AttentionMetadata, positions: torch.Tensor, window: int | None) -> BatchLayout:
    dev, bs = positions.device, meta.block_size
    qlens, ctxs = meta.query_lens, meta.context_lens
    bsz, qmax, lmax = len(qlens), max(qlens), max(c + q for c, q in zip(ctxs, qlens))
    ql = torch.tensor(qlens, device=dev)  # [B]
    ctx = torch.tensor(ctxs, device=dev)  # [B]
    qi = torch.arange(qmax, device=dev)  # [Qmax]
    j = torch.arange(lmax, device=dev)  # [Lmax]
    valid_q = qi[None, :] < ql[:, None]  # [B, Qmax]
    valid_k = j[None, :] < (ctx + ql)[:, None]  # [B, Lmax]
    bt = meta.block_tables.to(device=dev, dtype=torch.int64)  # [B, max_blocks]
    blk = bt[:, (j // bs).clamp(max=bt.shape[1] - 1)]  # [B, Lmax]
    slots = torch.where(valid_k & (blk >= 0), blk * bs + j % bs, bt[:, :1] * bs)  # [B, Lmax]
    new_j = j[None, None, :] - ctx[:, None, None]  # [B, 1, Lmax] index among the new tokens (< 0: cached)
    if meta.tree_masks is None:
        vis = new_j <= qi[None, :, None]  # [B, Qmax, Lmax] causal; cached keys always visible
    else:
        tm = torch.zeros(bsz, qmax, qmax, dtype=torch.bool, device=dev)  # [B, Qmax, Qmax]
        for b, (m, q) in enumerate(zip(meta.tree_masks, qlens)):
            tm[b, :q, :q] = (
                m.to(device=dev, dtype=torch.bool) if m is not None else torch.ones(q, q, dtype=torch.bool, device=dev).tril()
            )
        idx = new_j.clamp(0, qmax - 1).expand(bsz, qmax, lmax)  # [B, Qmax, Lmax]
        vis = (new_j < 0) | tm.gather(2, idx)
    vis = vis & valid_k[:, None, :]
    starts = ql.cumsum(0) - ql  # [B] first row in T of each sequence
    rows = starts[:, None] + qi[None, :].clamp(max=ql[:, None] - 1)  # [B, Qmax] (padding repeats the last query)
    if window is not None:
        qpos = positions[rows]  # [B, Qmax]
        kpos = torch.where(
            new_j[:, 0] < 0, j[None, :], positions[(starts[:, None] + new_j[:, 0]).clamp(0, positions.shape[0] - 1)]
        )
        vis = vis & (kpos[:, None, :] > qpos[:, :, None] - window)  # [B, Qmax, Lmax]
    vis = vis | (~valid_q[:, :, None] & (j == 0)[None, None, :])  # padded query rows see key 0 (no empty softmax)
    uniform = all(q == qmax for q in qlens)
    q_index = None if uniform else rows.reshape(-1)
    out_index = None if uniform else (torch.arange(bsz * qmax, device=dev).view(bsz, qmax)[valid_q])
    return BatchLayout(q_index, out_index, slots, vis[:, None], qmax)


def row_keys(meta: AttentionMetadata) -> cpu_decode.RowKeys:
    """The keys each query row sees, for the native CPU kernel (cached on the metadata, built once per forward).

    A causal row i of a sequence with c cached tokens sees keys 0..c+i, all in the cache once the new K/V
    are written: it is described as c+i+1 cached keys and no new ones, whatever the prompt length (so
    prefill needs no padding and no bit mask). A draft-tree row sees the cache and its ancestors: c cached
    keys plus a bit mask over the (<= MAX_NEW) new ones. Both give the kernel the same keys in the same
    order, so a causal row's value does not depend on which description it gets.
    """
    rows = meta.layouts.get("rows")
    if rows is None and sum(meta.query_lens) <= attention_host.HOST_ROWS:  # the native kernel's: CPU rows
        rows = meta.layouts["rows"] = attention_host.row_keys(meta.query_lens, meta.context_lens, meta.tree_masks)
    if rows is None:
        ql = torch.tensor(meta.query_lens, dtype=torch.int64)  # [B]
        seq = torch.repeat_interleave(torch.arange(len(ql)), ql)  # [T]
        first = torch.repeat_interleave(ql.cumsum(0) - ql, ql)  # [T] first row of each row's sequence
        ctx = torch.repeat_interleave(torch.tensor(meta.context_lens, dtype=torch.int64), ql)  # [T]
        ctx = ctx + (torch.arange(len(seq)) - first) + 1  # causal: the cache up to and including the row
        nnew = torch.zeros_like(ctx)
        mask = torch.zeros_like(ctx)
        for b, tree in enumerate(meta.tree_masks or ()):
            if tree is None:
                continue
            q, c, start = meta.query_lens[b], meta.context_lens[b], int(first[seq == b][0])
            allowed = tree.to(torch.bool).tolist()
            for i in range(q):
                bits = sum(1 << j for j in range(q) if allowed[i][j])
                ctx[start + i], nnew[start + i] = c, q
                mask[start + i] = bits - (1 << 64) if bits >= 1 << 63 else bits
        rows = meta.layouts["rows"] = cpu_decode.RowKeys(seq, ctx, nnew, mask)
    return rows


def native_rows(meta: AttentionMetadata) -> bool:
    """Whether every row fits the native kernel: causal rows always, draft-tree rows up to MAX_NEW new tokens."""
    trees = meta.tree_masks or ()
    return all(t is None or q <= cpu_decode.MAX_NEW for t, q in zip(trees, meta.query_lens))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    cache: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for a varlen batch: q [T, Hq, D], k/v [T, Hkv, D] new tokens -> [T, Hq, D].

    With ``cache`` (this layer's K, V [num_blocks, block_size, Hkv, D]) the new k/v are written first
    and each sequence attends over its context + new tokens, gathered by the forward's
    :class:`BatchLayout` in one indexing op and one SDPA call for the whole batch; without a cache,
    only over the new tokens. Metadata that carries its own attention (``meta.attend``: the no-sync
    decode path of :mod:`eagleray.platform.models.decode_metadata`) computes it instead.
    """
    attend = getattr(meta, "attend", None)
    if attend is not None:
        return attend(q, k, v, cache, scale, sliding_window)
    if cache is None and meta.tree_masks is None and sliding_window is None:
        return _causal_prefill(q, k, v, meta.query_lens, scale)
    if cache is None:
        return _no_cache_masked(q, k, v, positions, meta, scale, sliding_window)
    if meta.slot_mapping is None:
        raise EaglerayError("attention: a KV cache was passed but the metadata has no block_tables")
    write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    if native_rows(meta) and cpu_decode.attention_supported(q, cache[0], sliding_window):
        return cpu_decode.paged_attention(q.contiguous(), cache[0], cache[1], meta.block_tables, row_keys(meta), scale)
    if meta.tree_masks is None and sliding_window is None and not any(meta.context_lens):
        # a prefill from position 0: the keys are the new tokens themselves - causal SDPA (flash on GPU), no gather and
        # no mask (a masked SDPA runs the math backend: 0.4 ms of host time a layer on the H200)
        return _causal_prefill(q, k, v, meta.query_lens, scale)
    lay = batch_layout(meta, positions, sliding_window)
    bsz, hq, d = len(meta.query_lens), q.shape[1], q.shape[2]
    kb = cache[0].view(-1, *cache[0].shape[2:])[lay.kv_slots].to(q.dtype)  # [B, Lmax, Hkv, D]
    vb = cache[1].view(-1, *cache[1].shape[2:])[lay.kv_slots].to(q.dtype)  # [B, Lmax, Hkv, D]
    qb = (q if lay.q_index is None else q[lay.q_index]).view(bsz, lay.qmax, hq, d)  # [B, Qmax, Hq, D]
    o = sdpa(
        qb.transpose(1, 2),
        kb.transpose(1, 2),
        vb.transpose(1, 2),  # [B, H, Q|L, D]
        attn_mask=lay.mask,
        scale=scale,
        enable_gqa=True,
    )  # [B, Hq, Qmax, D]
    o = o.transpose(1, 2).reshape(bsz * lay.qmax, hq, d)  # [B*Qmax, Hq, D]
    return o if lay.out_index is None else o[lay.out_index]  # [T, Hq, D]


def _no_cache_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """No cache, with tree masks or a sliding window: one SDPA per sequence over its new tokens -> [T, Hq, D]."""
    out = torch.empty_like(q)  # [T, Hq, D]
    start = 0
    for b, ql in enumerate(meta.query_lens):
        end = start + ql
        m = meta.tree_masks[b] if meta.tree_masks is not None else None
        mask = (
            m.to(device=q.device, dtype=torch.bool)
            if m is not None
            else torch.ones(ql, ql, dtype=torch.bool, device=q.device).tril()
        )  # [q, q]
        if window is not None:
            qpos = positions[start:end]  # [q]
            mask = mask & (qpos[None, :] > qpos[:, None] - window)
        o = sdpa(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)  # [q, Hq, D]
        start = end
    return out


def _causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: list[int], scale: float) -> torch.Tensor:
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
        o = sdpa(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)  # [n, Hq, q, D]
        out[start:end] = o.transpose(1, 2).reshape(n * ql, *q.shape[1:])
        start, b = end, b + n
    return out
