"""Decode attention with no host synchronisation (one new token per sequence), for CUDA graphs.

:class:`DecodeMetadata` is the decode-only counterpart of
:class:`~eagleray.platform.models.attention.AttentionMetadata`: every field is a device tensor of a
fixed shape, nothing is read back to the host, so a decode step can be captured once per batch size
and replayed. ``paged_attention`` hands attention to the metadata when it carries its own
(``meta.attend``), so ``LlamaModel.forward`` runs unchanged on this path.

Two implementations of the same function:

- :func:`decode_attention_torch`: gathers every sequence's blocks by block table (fixed width
  ``max_blocks``) and runs SDPA with a length mask. Any device; the CPU reference.
- :func:`decode_attention_triton`: a split-K paged decode kernel (flash-decoding) that reads only
  the valid tokens of each sequence: grid (B, Hkv, splits), each program takes the Hq/Hkv query
  heads of one KV head over a range of TILE-token tiles, then a second kernel merges the splits by
  their log-sum-exp. GPU (or the Triton interpreter in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagleray.platform.errors import EaglerayError

try:  # Triton is optional on CPU machines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None

SPLIT_TARGET_PROGRAMS = 256  # aim for about two programs per SM of an H100/H200


@dataclass
class DecodeMetadata:
    """A decode batch of B sequences, one new token each; all tensors live on the model's device."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, entries past a sequence's length are ignored
    seq_lens: torch.Tensor  # [B] int32 tokens in the cache after writing the new one (>= 1)
    slot_mapping: torch.Tensor  # [B] int64 cache slot of each new token
    block_size: int
    use_triton: bool = False
    split_tokens: int | None = None  # fixed split-K length (a multiple of the tile): batch-invariant attention

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
        from eagleray.platform.models.attention import write_kv

        write_kv(cache[0], cache[1], k, v, self.slot_mapping)
        return decode_attention(q, cache[0], cache[1], self, scale, sliding_window)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over one layer's paged cache [num_blocks, block_size, Hkv, D] -> [B, Hq, D]."""
    if meta.use_triton:
        return decode_attention_triton(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, split_tokens=meta.split_tokens
        )
    return decode_attention_torch(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Gather by block table + masked SDPA: q [B, Hq, D] -> [B, Hq, D]; no host sync."""
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


def split_plan(max_len: int, batch: int, kv_heads: int, tile: int, split_tokens: int | None = None) -> tuple[int, int]:
    """(tiles_per_split, splits) so that B * Hkv * splits is about :data:`SPLIT_TARGET_PROGRAMS`.

    With ``split_tokens`` every split covers that many tokens whatever the batch: a row's online
    softmax then runs over the same ranges and merges in the same order alone or in any batch."""
    tiles = max(1, -(-max_len // tile))
    if split_tokens is not None:
        if split_tokens % tile or split_tokens <= 0:
            raise EaglerayError(f"split_tokens={split_tokens} must be a positive multiple of the tile {tile}")
        per_split = split_tokens // tile
        return per_split, -(-tiles // per_split)
    want = max(1, min(tiles, -(-SPLIT_TARGET_PROGRAMS // max(1, batch * kv_heads))))
    per_split = -(-tiles // want)
    return per_split, -(-tiles // per_split)


if triton is not None:

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
    ):
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
    ):
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


def _check_triton_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if triton is None:
        raise EaglerayError("decode_attention_triton needs the triton package\n    fix: pip install triton, or use_triton=False")
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise EaglerayError("decode attention: K and V caches must have the same shape and strides")
    if hq % hkv or d & (d - 1) or d < 16 or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise EaglerayError(
            f"decode attention: unsupported q {tuple(q.shape)} / cache {tuple(k_cache.shape)} "
            f"(need Hq % Hkv == 0, head_dim a power of two >= 16, contiguous last dims)"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
        raise EaglerayError("decode attention: block_tables and seq_lens must be int32, seq_lens [B]")


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tile: int = 64,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Split-K paged decode attention: q [B, Hq, D] -> [B, Hq, D]; reads only valid tokens."""
    _check_triton_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    per_split, splits = split_plan(block_tables.shape[1] * bs, b, hkv, tile, split_tokens)
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
    )
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)  # [B, Hq, D]
    _decode_merge_kernel[(b * hq,)](part, lse, out, d, S=splits, SP=triton.next_power_of_2(splits), D=d, num_warps=1)
    return out
