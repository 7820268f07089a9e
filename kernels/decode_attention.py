"""Paged decode attention (one new token per sequence) with no host synchronisation: a Triton kernel
and its PyTorch reference, for CUDA graphs.

- :data:`decode_attention_reference` (``decode_attention(..., reference=True)``): gathers every sequence's
  blocks by block table (fixed width ``max_blocks``) and runs SDPA with a length mask. Any device; the CPU path.
- :func:`decode_attention`: a split-K paged decode kernel (flash-decoding) that reads only the valid
  tokens of each sequence: grid (B, Hkv, splits), each program takes the Hq/Hkv query heads of one
  KV head over a range of TILE-token tiles, then a second kernel merges the splits by their
  log-sum-exp. GPU (or the Triton interpreter in tests). With ``split_tokens`` the splits have a fixed
  length, so a row's result does not depend on the batch (:func:`split_plan`).

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
        scale,
        window,
        HQ,
        stride_qb,
        stride_qh,
        stride_kn,
        stride_ks,
        stride_kh,
        stride_bt,
        S: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
        TILE: tl.constexpr,
        TILES_PER_SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
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


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    def bad(arg: str, expected: str, got, fix: str) -> KernelInputError:
        return KernelInputError(f"decode_attention: {arg}", expected, str(got), fix)

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
) -> torch.Tensor:
    """Paged decode attention: q [B, Hq, D] -> [B, Hq, D]; no host sync.

    The split-K Triton kernel reads only valid tokens (``tile``, ``split_tokens``: its plan, :func:`split_plan`).
    ``reference=True`` (:data:`decode_attention_reference`): gather by block table + masked SDPA, on any device."""
    if reference:
        b, max_blocks = block_tables.shape
        bs, hkv, d = k_cache.shape[1:]
        blocks = block_tables.clamp(min=0).long()  # [B, MB]; -1 entries lie past the length (masked)
        kb = k_cache[blocks].reshape(b, max_blocks * bs, hkv, d).to(q.dtype)  # [B, L, Hkv, D]
        vb = v_cache[blocks].reshape(b, max_blocks * bs, hkv, d).to(q.dtype)  # [B, L, Hkv, D]
        pos = torch.arange(max_blocks * bs, device=q.device)  # [L]
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
    _check(q, k_cache, v_cache, block_tables, seq_lens)
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    per_split, splits = split_plan(block_tables.shape[1] * bs, b, hkv, tile, split_tokens)
    launch = pdl_launch(q.device)
    part = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)  # [B, Hq, S, D]
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)  # [B, Hq, S]
    _decode_split_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        float(scale),
        int(sliding_window or 0),
        hq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        S=splits,
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        D=d,
        BS=bs,
        TILE=tile,
        TILES_PER_SPLIT=per_split,
        HAS_WINDOW=sliding_window is not None,
        num_warps=4,
        **launch,
    )
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    _decode_merge_kernel[(b * hq,)](part, lse, out, d, S=splits, SP=triton.next_power_of_2(splits), D=d, num_warps=1, **launch)
    return out


decode_attention_reference = functools.partial(decode_attention, reference=True)  # gather + masked SDPA, any device
