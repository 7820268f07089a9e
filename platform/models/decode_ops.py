"""Fused element-wise ops of the decode step: each a PyTorch reference and a Triton kernel.

The references are exactly what :mod:`eagleray.platform.models.layers` computes (same op order and
roundings), so the fused step equals the model's own forward on any device. The kernels reproduce
those roundings (bf16 results of bf16 products, fp32 norm statistics) in one launch each, which
matters at batch 1 where a decode step is hundreds of tiny kernels around the weight reads.

- :func:`add_rmsnorm`: h' = h + delta (rounded to h's dtype), y = w * rmsnorm(h') -> (y, h')
- :func:`rope_write_kv`: rotary on q and k of a fused qkv row, k/v stored at their cache slots -> q
- :func:`silu_mul`: silu(gate) * up of a fused gate_up row
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagleray.platform.models.attention import write_kv
from eagleray.platform.models.rope import rotate_half

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def add_rmsnorm_torch(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, H] -> (normed [T, H], h + delta [T, H]); RMSNorm as layers.RMSNorm."""
    if delta is not None:
        h = h + delta
    x32 = h.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(h.dtype), h


def rope_write_kv_torch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    hq: int,
    hkv: int,
) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)*D] -> rotated q [T, Hq, D]; rotated k and v written to ``slots`` [T]."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [T, 1, D]
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    q = q * cos + rotate_half(q) * sin  # [T, Hq, D]
    k = k * cos + rotate_half(k) * sin  # [T, Hkv, D]
    write_kv(k_cache, v_cache, k, v, slots)
    return q


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(
        h_ptr,
        delta_ptr,
        w_ptr,
        out_ptr,
        hout_ptr,  # [T, N] each, w [N]
        eps,
        N,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        mask = c < N
        x = tl.load(h_ptr + row * N + c, mask=mask, other=0.0)
        dt = x.dtype
        x = x.to(tl.float32)
        if HAS_DELTA:
            x = (x + tl.load(delta_ptr + row * N + c, mask=mask, other=0.0).to(tl.float32)).to(dt)
            tl.store(hout_ptr + row * N + c, x, mask=mask)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        y = (x * rstd).to(dt).to(tl.float32)
        w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + c, (w * y).to(dt), mask=mask)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr,  # [T, (HQ+2HKV)*D] (row stride)
        pos_ptr,  # [T] int64
        inv_ptr,  # [D/2] fp32
        q_ptr,  # [T, HQ, D] out
        k_ptr,
        v_ptr,  # [num_slots, HKV, D] (slot stride)
        slot_ptr,  # [T] int64
        stride_row,
        stride_slot,
        HQ,
        HKV,
        D: tl.constexpr,
        HALF: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        base = qkv_ptr + t * stride_row + h * D
        slot = tl.load(slot_ptr + t)
        if h < HQ + HKV:
            i = tl.arange(0, HALF)
            f = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + i)  # [HALF] fp32
            x1 = tl.load(base + i)
            x2 = tl.load(base + HALF + i)
            dt = x1.dtype
            c = tl.cos(f).to(dt).to(tl.float32)
            s = tl.sin(f).to(dt).to(tl.float32)
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            o1 = ((a1 * c).to(dt).to(tl.float32) + (-(a2 * s)).to(dt).to(tl.float32)).to(dt)
            o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
            if h < HQ:
                qd = q_ptr + (t * HQ + h) * D
                tl.store(qd + i, o1.to(q_ptr.dtype.element_ty))
                tl.store(qd + HALF + i, o2.to(q_ptr.dtype.element_ty))
            else:
                kd = k_ptr + slot * stride_slot + (h - HQ) * D
                tl.store(kd + i, o1.to(k_ptr.dtype.element_ty))
                tl.store(kd + HALF + i, o2.to(k_ptr.dtype.element_ty))
        else:
            j = tl.arange(0, D)
            x = tl.load(base + j)
            tl.store(v_ptr + slot * stride_slot + (h - HQ - HKV) * D + j, x.to(v_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr,  # [T, 2I]
        out_ptr,  # [T, I]
        inter,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < inter
        g = tl.load(gu_ptr + t * 2 * inter + c, mask=mask, other=0.0)
        dt = g.dtype
        u = tl.load(gu_ptr + t * 2 * inter + inter + c, mask=mask, other=0.0).to(tl.float32)
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * inter + c, (a * u).to(dt), mask=mask)


def add_rmsnorm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w * rmsnorm(h + delta), h + delta) for h, delta [T, H] contiguous."""
    if not use_triton:
        return add_rmsnorm_torch(h, delta, weight, eps)
    t, n = h.shape
    out = torch.empty_like(h)  # [T, H]
    h_new = torch.empty_like(h) if delta is not None else h  # [T, H]
    _add_rmsnorm_kernel[(t,)](
        h,
        delta if delta is not None else h,
        weight,
        out,
        h_new,
        float(eps),
        n,
        HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=8,
    )
    return out, h_new


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    hq: int,
    hkv: int,
    use_triton: bool,
) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)*D] -> q [T, Hq, D] (rotary applied); k (rotary) and v stored at ``slots``."""
    if not use_triton:
        return rope_write_kv_torch(qkv, positions, inv_freq, k_cache, v_cache, slots, hq, hkv)
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)  # [T, Hq, D]
    _rope_kv_kernel[(t, hq + 2 * hkv)](
        qkv,
        positions,
        inv_freq,
        q,
        k_cache,
        v_cache,
        slots,
        qkv.stride(0),
        k_cache.stride(1),
        hq,
        hkv,
        D=d,
        HALF=d // 2,
        num_warps=1,
    )
    return q


def silu_mul(gate_up: torch.Tensor, use_triton: bool) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if not use_triton:
        return silu_mul_torch(gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
