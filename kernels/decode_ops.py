"""Fused element-wise ops of the decode step: each a Triton kernel with its PyTorch reference.

The references (``*_reference``) are exactly what :mod:`eagleray.platform.models.layers` computes
(same op order and roundings), so the fused step equals the model's own forward on any device. The
kernels reproduce those roundings (bf16 results of bf16 products, fp32 norm statistics) in one
launch each, which matters at batch 1 where a decode step is hundreds of tiny kernels around the
weight reads.

- :func:`add_rmsnorm`: h' = h + delta (rounded to h's dtype), y = w * rmsnorm(h') -> (y, h')
- :func:`rope_write_kv`: rotary on q and k of a fused qkv row, k/v stored at their cache slots -> q
- :func:`silu_mul`: silu(gate) * up of a fused gate_up row
- :func:`rotary_halves` (``@triton.jit``): rotary on one head's two halves, shared with
  :mod:`eagleray.kernels.decode_gemv`
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from eagleray.kernels.errors import KernelInputError, no_triton
from eagleray.kernels.launch import pdl_launch
from eagleray.kernels.reference_ops import rotary_cos_sin, rotate_half, write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def add_rmsnorm_reference(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, H] -> (normed [T, H], h + delta [T, H]); RMSNorm as layers.RMSNorm."""
    if delta is not None:
        h = h + delta
    x32 = h.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(h.dtype), h


class KVWrite(NamedTuple):
    """Where one layer's new k and v go this step, and the rotary applied to q and k on the way."""

    positions: torch.Tensor  # [T] int64
    inv_freq: torch.Tensor  # [D/2] fp32
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] (slot stride: stride(1))
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], strides of k_cache
    slots: torch.Tensor  # [T] int64 cache slot of each token
    hq: int  # query heads
    hkv: int  # key/value heads


def rope_write_kv_reference(qkv: torch.Tensor, kv: KVWrite) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)*D] -> rotated q [T, Hq, D]; rotated k and v written to ``kv.slots`` [T]."""
    t, d, hq, hkv = qkv.shape[0], kv.k_cache.shape[-1], kv.hq, kv.hkv
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
    cos, sin = rotary_cos_sin(kv.positions, kv.inv_freq, q.dtype)  # [T, 1, D] each
    q = q * cos + rotate_half(q) * sin  # [T, Hq, D]
    k = k * cos + rotate_half(k) * sin  # [T, Hkv, D]
    write_kv(kv.k_cache, kv.v_cache, k, v, kv.slots)
    return q


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    from eagleray.kernels.grid import program_range
    from eagleray.kernels.launch import await_inputs

    @triton.jit
    def rotary_halves(a1, a2, pos_ptr, inv_ptr, j, dt):
        """Rotary on one head's halves a1, a2 [n] (fp32 holding ``dt`` values) at the position ``*pos_ptr``, for
        the frequencies ``inv_ptr[j]``: the bf16 roundings of q*cos + rotate_half(q)*sin -> (o1, o2) in ``dt``."""
        f = tl.load(pos_ptr).to(tl.float32) * tl.load(inv_ptr + j)  # [n] fp32
        c = tl.cos(f).to(dt).to(tl.float32)
        s = tl.sin(f).to(dt).to(tl.float32)
        o1 = ((a1 * c).to(dt).to(tl.float32) + (-(a2 * s)).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        return o1, o2

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
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
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
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)
        base = qkv_ptr + t * stride_row + h * D
        slot = tl.load(slot_ptr + t)
        if h < HQ + HKV:
            i = tl.arange(0, HALF)
            x1 = tl.load(base + i)  # [HALF]
            x2 = tl.load(base + HALF + i)  # [HALF]
            o1, o2 = rotary_halves(x1.to(tl.float32), x2.to(tl.float32), pos_ptr + t, inv_ptr, i, x1.dtype)
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
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        t = tl.program_id(0)
        c, mask = program_range(1, BLOCK, inter)
        g = tl.load(gu_ptr + t * 2 * inter + c, mask=mask, other=0.0)
        dt = g.dtype
        u = tl.load(gu_ptr + t * 2 * inter + inter + c, mask=mask, other=0.0).to(tl.float32)
        g = g.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + t * inter + c, (a * u).to(dt), mask=mask)


def _require_triton(op: str) -> None:
    if triton is None:
        raise no_triton(op)


def _require_rows(op: str, arg: str, x: torch.Tensor, dims: int) -> None:
    """``x`` is a ``dims``-D tensor whose rows are contiguous (what the kernels' pointer arithmetic assumes)."""
    if x.dim() != dims or not x.is_contiguous():
        raise KernelInputError(
            f"{op}: {arg}", f"a contiguous {dims}-D tensor", f"shape {tuple(x.shape)}, strides {x.stride()}", "pass .contiguous()"
        )


def add_rmsnorm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w * rmsnorm(h + delta), h + delta) for h, delta [T, H] contiguous."""
    _require_triton("add_rmsnorm")
    for arg, x in (("h", h), ("delta", delta)):
        if x is not None:
            _require_rows("add_rmsnorm", arg, x, 2)
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
        **pdl_launch(h.device),
    )
    return out, h_new


def rope_write_kv(qkv: torch.Tensor, kv: KVWrite) -> torch.Tensor:
    """qkv [T, (Hq+2Hkv)*D] -> q [T, Hq, D] (rotary applied); k (rotary) and v stored at ``kv.slots`` [T]."""
    _require_triton("rope_write_kv")
    t, d, hq, hkv = qkv.shape[0], kv.k_cache.shape[-1], kv.hq, kv.hkv
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (hq + 2 * hkv) * d:
        raise KernelInputError(
            "rope_write_kv: qkv",
            f"[T, (Hq+2Hkv)*D] = [T, {(hq + 2 * hkv) * d}] with contiguous rows",
            f"shape {tuple(qkv.shape)}, strides {qkv.stride()}",
            "pass the fused qkv product of this layer (hq, hkv and the cache's head_dim must match it)",
        )
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)  # [T, Hq, D]
    _rope_kv_kernel[(t, hq + 2 * hkv)](
        qkv,
        kv.positions,
        kv.inv_freq,
        q,
        kv.k_cache,
        kv.v_cache,
        kv.slots,
        qkv.stride(0),
        kv.k_cache.stride(1),
        hq,
        hkv,
        D=d,
        HALF=d // 2,
        num_warps=1,
        **pdl_launch(qkv.device),
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    _require_triton("silu_mul")
    _require_rows("silu_mul", "gate_up", gate_up, 2)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4, **pdl_launch(gate_up.device))
    return out
