"""Paged decode attention (one new token per sequence) with no host synchronisation: a Triton kernel
and its PyTorch reference, for CUDA graphs.

- :data:`decode_attention_reference` (``decode_attention(..., reference=True)``): gathers every sequence's
  blocks by block table (fixed width ``max_blocks``) and runs SDPA with a length mask. Any device; the CPU path.
- :func:`decode_attention`: a split-K paged decode kernel (flash-decoding) that reads only the valid
  tokens of each sequence: grid (B, Hkv, splits), each program takes the Hq/Hkv query heads of one
  KV head over a range of TILE-token tiles, then a second kernel merges the splits by their
  log-sum-exp. GPU (or the Triton interpreter in tests). With ``split_tokens`` the splits have a fixed
  length, so a row's result does not depend on the batch (:func:`split_plan`).

A *tail* (``tail_start`` [B] int32, ``tail_slots`` [B, W] int64) redirects a row's last positions: position
``tail_start[b] + j`` (j < W) is read from cache slot ``tail_slots[b, j]`` instead of its block table's slot. A
draft tree's node then attends to the committed prefix and to its own ancestors (written at scratch slots) in
exactly the tiles, splits and order of a plain row at its position: only where K/V are loaded from changes.

The caches are one layer's [num_blocks, block_size, Hkv, D]; ``block_tables`` [B, max_blocks] int32
(-1 past a sequence's blocks) and ``seq_lens`` [B] int32 count the new token.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from eagleray.kernels.errors import KernelInputError, no_triton
from eagleray.kernels.launch import pdl_launch

try:  # Triton is optional on CPU machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None

SPLIT_TARGET_PROGRAMS = 256  # aim for about two programs per SM of an H100/H200


def split_plan(max_len: int, batch: int, kv_heads: int, tile: int, split_tokens: int | None = None) -> tuple[int, int]:
    """(tiles_per_split, splits) so that B * Hkv * splits is about :data:`SPLIT_TARGET_PROGRAMS`.

    With ``split_tokens`` every split covers that many tokens whatever the batch: a row's online
    softmax then runs over the same ranges and merges in the same order alone or in any batch."""
    tiles = max(1, -(-max_len // tile))
    if split_tokens is not None:
        if split_tokens % tile or split_tokens <= 0:
            raise KernelInputError(
                "split_tokens", f"a positive multiple of the tile ({tile})", str(split_tokens), "pick a multiple of the tile"
            )
        per_split = split_tokens // tile
        return per_split, -(-tiles // per_split)
    want = max(1, min(tiles, -(-SPLIT_TARGET_PROGRAMS // max(1, batch * kv_heads))))
    per_split = -(-tiles // want)
    return per_split, -(-tiles // per_split)


if triton is not None:
    from eagleray.kernels.launch import await_inputs

    @triton.jit
    def _decode_split_kernel(
        q_ptr,  # [B, Hq, D] (strides qb, qh; last dim contiguous)
        k_ptr,
        v_ptr,  # [num_blocks, BS, Hkv, D] (same strides)
        bt_ptr,  # [B, MB] int32 (stride bt)
        len_ptr,  # [B] int32
        o_ptr,  # [B, Hq, S, D] fp32 partial outputs
        lse_ptr,  # [B, Hq, S] fp32 partial log-sum-exp
        tail_start_ptr,  # [B] int32 first tail position (HAS_TAIL)
        tail_ptr,  # [B, W] int64 cache slot of tail position j (HAS_TAIL; stride tail)
        scale,
        window,
        HQ,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_ks,
        stride_kh,
        stride_bt,
        stride_tail,
        S: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        TILE: tl.constexpr,
        TILES_PER_SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_TAIL: tl.constexpr,
        TAIL_W: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        s = tl.program_id(2)
        seq_len = tl.load(len_ptr + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        t = tl.arange(0, TILE)
        heads = hkv * G + g  # [GP]
        gmask = g < G
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        lo = s * TILES_PER_SPLIT * TILE
        hi = tl.minimum(lo + TILES_PER_SPLIT * TILE, seq_len)
        if HAS_WINDOW:
            lo = tl.maximum(lo, (tl.maximum(seq_len - window, 0) // TILE) * TILE)
        tail0 = 0
        if HAS_TAIL:
            tail0 = tl.load(tail_start_ptr + b)
        m = tl.full([GP], float("-inf"), tl.float32)
        l_sum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(lo, hi, TILE):
            tok = start + t  # [TILE]
            valid = tok < seq_len
            if HAS_WINDOW:
                valid = valid & (tok > seq_len - 1 - window)
            blk = tl.load(bt_ptr + b * stride_bt + tok // BS, mask=valid, other=0).to(tl.int64)  # [TILE]
            off = blk * stride_kn + (tok % BS) * stride_ks + hkv * stride_kh  # [TILE]
            if HAS_TAIL:  # positions tail_start.. read the row's own slots (a tree node's ancestors)
                rel = tok - tail0  # [TILE]
                in_tail = valid & (rel >= 0) & (rel < TAIL_W)
                slot = tl.load(tail_ptr + b * stride_tail + rel, mask=in_tail, other=0)  # [TILE] int64
                off = tl.where(in_tail, (slot // BS) * stride_kn + (slot % BS) * stride_ks + hkv * stride_kh, off)
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [TILE, D]
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [TILE, D]
            sc = tl.dot(q.to(k.dtype), tl.trans(k)) * scale  # [GP, TILE]
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])  # [GP, TILE]
            l_sum = l_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        row = (b * HQ + heads) * S + s  # [GP]
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc / safe[:, None], mask=gmask[:, None])
        tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log(safe), float("-inf")), mask=gmask)

    @triton.jit
    def _decode_merge_kernel(
        o_ptr,  # [B*Hq, S, D] fp32
        lse_ptr,  # [B*Hq, S] fp32
        out_ptr,  # [B*Hq, D] (stride out)
        stride_out,
        S: tl.constexpr,
        SP: tl.constexpr,
        D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        row = tl.program_id(0)
        si = tl.arange(0, SP)
        d = tl.arange(0, D)
        smask = si < S
        lse = tl.load(lse_ptr + row * S + si, mask=smask, other=float("-inf"))  # [SP]
        w = tl.exp(lse - tl.max(lse, 0))
        w = tl.where(smask, w, 0.0)
        o = tl.load(o_ptr + (row * S + si[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)  # [SP, D]
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)  # [D]
        tl.store(out_ptr + row * stride_out + d, out.to(out_ptr.dtype.element_ty))


def _bad(arg: str, expected: str, got, fix: str) -> KernelInputError:
    return KernelInputError(f"decode_attention: {arg}", expected, str(got), fix)


def _check_tail(b: int, tail_start: torch.Tensor | None, tail_slots: torch.Tensor | None) -> None:
    """A tail is both tensors or neither: tail_start [B] int32, tail_slots [B, W] int64 with W >= 1, rows contiguous."""
    if tail_start is None and tail_slots is None:
        return
    if (
        tail_start is None
        or tail_slots is None
        or tail_start.dtype != torch.int32
        or tuple(tail_start.shape) != (b,)
        or tail_slots.dtype != torch.int64
        or tail_slots.dim() != 2
        or tail_slots.shape[0] != b
        or tail_slots.shape[1] < 1
        or tail_slots.stride(-1) != 1
    ):
        got = lambda t: None if t is None else f"{t.dtype} {tuple(t.shape)}"  # noqa: E731
        raise _bad(
            "tail_start, tail_slots",
            f"both or neither: tail_start int32 [{b}], tail_slots int64 [{b}, W >= 1] with contiguous rows",
            f"{got(tail_start)} / {got(tail_slots)}",
            "pass both (a tree's rows) or neither (plain rows)",
        )


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    bad = _bad
    if triton is None:
        raise no_triton("decode_attention")
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise bad(
            "k_cache, v_cache",
            "the same shape and strides",
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, strides {k_cache.stride()} / {v_cache.stride()}",
            "pass one layer's K and V of the same KVCache",
        )
    if hq % hkv or d & (d - 1) or d < 16 or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise bad(
            "q, k_cache",
            "Hq % Hkv == 0, head_dim a power of two >= 16, contiguous last dims",
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)}",
            "use decode_attention_reference for this shape",
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
        raise bad(
            "block_tables, seq_lens",
            f"int32 tensors, seq_lens [{b}]",
            f"{block_tables.dtype}, {seq_lens.dtype} {tuple(seq_lens.shape)}",
            "cast them with .to(torch.int32), one length a sequence",
        )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tile: int = 64,
    split_tokens: int | None = None,
    reference: bool = False,
    tail_start: torch.Tensor | None = None,
    tail_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention: q [B, Hq, D] -> [B, Hq, D]; no host sync.

    The split-K Triton kernel reads only valid tokens (``tile``, ``split_tokens``: its plan, :func:`split_plan`).
    ``reference=True`` (:data:`decode_attention_reference`): gather by block table + masked SDPA, on any device.
    ``tail_start`` [B] int32, ``tail_slots`` [B, W] int64: the rows' tails (the module docstring), both or neither."""
    _check_tail(q.shape[0], tail_start, tail_slots)
    if reference:
        return _reference(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, tail_start, tail_slots)
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    per_split, splits = split_plan(block_tables.shape[1] * bs, b, hkv, tile, split_tokens)
    launch = pdl_launch(q.device)
    part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)  # [B, Hq, S, D]
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)  # [B, Hq, S]
    has_tail = tail_slots is not None
    _decode_split_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        tail_start if has_tail else seq_lens,  # unread without a tail
        tail_slots if has_tail else seq_lens,
        float(scale),
        int(sliding_window or 0),
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        tail_slots.stride(0) if has_tail else 0,
        S=splits,
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        D=d,
        BS=bs,
        TILE=tile,
        TILES_PER_SPLIT=per_split,
        HAS_WINDOW=sliding_window is not None,
        HAS_TAIL=has_tail,
        TAIL_W=tail_slots.shape[1] if has_tail else 1,
        num_warps=4 if tile <= 64 else 8,  # a 256-token tile: [256, D] of K and of V a program
        **launch,
    )
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    _decode_merge_kernel[(b * hq,)](part, lse, out, d, S=splits, SP=triton.next_power_of_2(splits), D=d, num_warps=1, **launch)
    return out


def _reference(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, tail_start, tail_slots) -> torch.Tensor:
    """Gather every row's keys and values by block table (its tail from its own slots), then masked SDPA."""
    b, max_blocks = block_tables.shape
    bs, hkv, d = k_cache.shape[1:]
    blocks = block_tables.clamp(min=0).long()  # [B, MB]; -1 entries lie past the length (masked)
    kb = k_cache[blocks].reshape(b, max_blocks * bs, hkv, d).to(q.dtype)  # [B, L, Hkv, D]
    vb = v_cache[blocks].reshape(b, max_blocks * bs, hkv, d).to(q.dtype)  # [B, L, Hkv, D]
    pos = torch.arange(max_blocks * bs, device=q.device)  # [L]
    if tail_slots is not None:
        kb, vb = _with_tail(kb, vb, k_cache, v_cache, pos, tail_start, tail_slots)
    lens = seq_lens.to(torch.int64).unsqueeze(1)  # [B, 1]
    mask = pos.unsqueeze(0) < lens  # [B, L]
    if sliding_window is not None:
        mask = mask & (pos.unsqueeze(0) > lens - 1 - sliding_window)  # key > pos_q - window
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        kb.transpose(1, 2),
        vb.transpose(1, 2),  # [B, H, 1|L, D]
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [B, Hq, 1, D]
    return o.squeeze(2)


def _with_tail(kb, vb, k_cache, v_cache, pos, tail_start, tail_slots) -> tuple[torch.Tensor, torch.Tensor]:
    """kb, vb [B, L, Hkv, D] with position tail_start[b] + j (j < W) taken from slot tail_slots[b, j]."""
    hkv, d = k_cache.shape[2:]
    rel = pos.unsqueeze(0) - tail_start.to(torch.int64).unsqueeze(1)  # [B, L]
    in_tail = ((rel >= 0) & (rel < tail_slots.shape[1]))[:, :, None, None]  # [B, L, 1, 1]
    slots = tail_slots.gather(1, rel.clamp(0, tail_slots.shape[1] - 1))  # [B, L]
    k_tail = k_cache.reshape(-1, hkv, d)[slots].to(kb.dtype)  # [B, L, Hkv, D]
    v_tail = v_cache.reshape(-1, hkv, d)[slots].to(vb.dtype)  # [B, L, Hkv, D]
    return torch.where(in_tail, k_tail, kb), torch.where(in_tail, v_tail, vb)


decode_attention_reference = functools.partial(decode_attention, reference=True)  # gather + masked SDPA, any device
