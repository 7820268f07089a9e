"""Batch-1 decode matrix-vector products (Triton) with the step's element-wise work folded in.

At batch 1 a decode step streams every weight once; cuBLAS GEMV runs below copy bandwidth and the
element-wise kernels between the products cost a launch each. These kernels read each weight row
block once (split over rows, full K per program, fp32 accumulation) and fold in:

- prologue ``norm``: x = w_norm * rmsnorm(h) (each program recomputes the row's rstd from L2);
- prologue ``silu``: x = silu(gate) * up of a fused gate_up row;
- epilogue ``residual``: out = residual + x @ W.T (the next residual stream, rounded like the model);
- :func:`qkv_rope_gemv`: the fused q/k/v product with RMSNorm prologue whose epilogue applies rotary
  to q and k, stores q, and writes k and v into the paged cache (each program owns matching
  halves of one head's rows).

Roundings follow :mod:`eagleray.kernels.decode_ops` (bf16 results of each op), so results equal
the unfused step up to the summation order of the products; the references (``*_reference``) are
that unfused step. Batch 1 only: ``x`` is [1, K].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from eagleray.kernels.decode_ops import KVWrite, add_rmsnorm_reference, rope_write_kv_reference, silu_mul_reference
from eagleray.kernels.errors import KernelInputError, no_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MODES = {"plain": 0, "norm": 1, "silu": 2}
# (N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), else `config()`'s rule. Llama-3.1-8B shapes, best of
# 18 in a CUDA-graph sweep on an H200 (jobs/bench/gemv_check.py, 2026-11-30); qkv_rope_gemv looks up (N/2, K).
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (3072, 4096): (4, 512, 4, 3),
    (4096, 4096): (16, 1024, 8, 3),
    (28672, 4096): (16, 256, 4, 4),
    (4096, 14336): (8, 1024, 4, 3),
    (128256, 4096): (16, 256, 4, 4),
}


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """Tile rows/columns, warps and pipeline stages for an [N, K] weight."""
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 16 if n >= 16384 else 8
    return min(block_n, triton.next_power_of_2(n)), block_k, 4, 3


def qkv_rope_gemv_reference(
    h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None, kv: KVWrite
) -> torch.Tensor:
    """What :func:`qkv_rope_gemv` computes, unfused: RMSNorm, the qkv product, rotary and the K/V store."""
    x, _ = add_rmsnorm_reference(h, None, norm_weight, eps)  # [1, H]
    return rope_write_kv_reference(F.linear(x, weight, bias), kv)


if triton is not None:
    from eagleray.kernels.decode_ops import rotary_halves
    from eagleray.kernels.grid import program_range

    @triton.jit
    def _ld(ptrs, mask, EVEN: tl.constexpr):
        if EVEN:
            v = tl.load(ptrs)
        else:
            v = tl.load(ptrs, mask=mask, other=0.0)
        return v

    @triton.jit
    def _x_chunk(x_ptr, up_ptr, nw_ptr, k, kmask, rstd, MODE: tl.constexpr, EVEN: tl.constexpr):
        """x[k] after the prologue, fp32 holding the bf16-rounded value: [BLOCK_K]."""
        x = _ld(x_ptr + k, kmask, EVEN)
        dt = x.dtype
        x = x.to(tl.float32)
        if MODE == 1:
            y = (x * rstd).to(dt).to(tl.float32)
            x = (_ld(nw_ptr + k, kmask, EVEN).to(tl.float32) * y).to(dt).to(tl.float32)
        if MODE == 2:
            a = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
            x = (a * _ld(up_ptr + k, kmask, EVEN).to(tl.float32)).to(dt).to(tl.float32)
        return x

    @triton.jit
    def _dot_rows(
        x_ptr,
        up_ptr,
        nw_ptr,
        w_ptr,
        rows,
        rmask,
        K,
        stride_w,
        eps,
        MODE: tl.constexpr,
        KP2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        """sum_k W[rows, k] * x[k] in fp32: [BLOCK_N]."""
        rstd = 1.0
        if MODE == 1:
            kk = tl.arange(0, KP2)
            xf = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)  # [KP2]
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            kmask = k < K
            wp = w_ptr + rows[:, None] * stride_w + k[None, :]
            if EVEN:
                w = tl.load(wp, eviction_policy="evict_first")
            else:
                w = tl.load(wp, mask=rmask[:, None] & kmask[None, :], other=0.0, eviction_policy="evict_first")
            x = _x_chunk(x_ptr, up_ptr, nw_ptr, k, kmask, rstd, MODE, EVEN)
            acc += w.to(tl.float32) * x[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # [K] (the gate half for MODE 2)
        up_ptr,  # [K] up half (MODE 2)
        nw_ptr,  # [K] norm weight (MODE 1)
        w_ptr,  # [N, K] (row stride stride_w)
        b_ptr,  # [N] bias
        res_ptr,
        out_ptr,  # [N] residual in, output
        N,
        K,
        stride_w,
        eps,
        MODE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        KP2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        rows, rmask = program_range(0, BLOCK_N, N)  # [BLOCK_N] each
        acc = _dot_rows(x_ptr, up_ptr, nw_ptr, w_ptr, rows, rmask, K, stride_w, eps, MODE, KP2, BLOCK_N, BLOCK_K, EVEN)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        y = acc.to(dt)
        if HAS_RES:
            y = (tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
        tl.store(out_ptr + rows, y, mask=rmask)

    @triton.jit
    def _qkv_rope_kernel(
        x_ptr,
        nw_ptr,  # [K] residual stream, norm weight
        w_ptr,
        b_ptr,  # [(HQ+2HKV)*D, K], [(HQ+2HKV)*D]
        pos_ptr,
        inv_ptr,  # [1] int64, [D/2] fp32
        q_ptr,  # [HQ, D] out
        k_ptr,
        v_ptr,  # [num_slots, HKV, D] (slot stride)
        slot_ptr,  # [1] int64
        K,
        stride_w,
        stride_slot,
        eps,
        HQ,
        HKV,
        D: tl.constexpr,
        HALF: tl.constexpr,
        BH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        KP2: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        head = pid // (HALF // BH)
        j = (pid % (HALF // BH)) * BH + tl.arange(0, BH)  # [BH] index within the half
        r = tl.arange(0, 2 * BH)
        rows = head * D + (pid % (HALF // BH)) * BH + (r % BH) + (r // BH) * HALF  # [2BH]: first, second half
        acc = _dot_rows(x_ptr, x_ptr, nw_ptr, w_ptr, rows, rows >= 0, K, stride_w, eps, 1, KP2, 2 * BH, BLOCK_K, EVEN)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        acc = acc.to(dt).to(tl.float32)  # the qkv product's rounding
        a1, a2 = tl.split(tl.trans(tl.reshape(acc, [2, BH])))  # [BH] each
        slot = tl.load(slot_ptr)
        if head < HQ + HKV:
            o1, o2 = rotary_halves(a1, a2, pos_ptr, inv_ptr, j, dt)
            if head < HQ:
                tl.store(q_ptr + head * D + j, o1)
                tl.store(q_ptr + head * D + HALF + j, o2)
            else:
                kd = k_ptr + slot * stride_slot + (head - HQ) * D
                tl.store(kd + j, o1.to(k_ptr.dtype.element_ty))
                tl.store(kd + HALF + j, o2.to(k_ptr.dtype.element_ty))
        else:
            vd = v_ptr + slot * stride_slot + (head - HQ - HKV) * D
            tl.store(vd + j, a1.to(v_ptr.dtype.element_ty))
            tl.store(vd + HALF + j, a2.to(v_ptr.dtype.element_ty))


def _check(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if triton is None:
        raise no_triton(op)
    if x.shape[0] != 1 or x.shape[-1] != weight.shape[1] or weight.stride(1) != 1 or x.stride(-1) != 1:
        raise KernelInputError(
            f"{op}: x, weight",
            "x [1, K] and weight [N, K] with contiguous rows",
            f"{tuple(x.shape)} and {tuple(weight.shape)} (strides {x.stride()}, {weight.stride()})",
            "pass one row (batch 1) and the layer's weight; larger batches go through the batched step",
        )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    mode: str = "plain",
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """[1, K] (or [1, 2K] gate_up for ``silu``) @ weight [N, K].T (+ bias) (+ residual [1, N]) -> [1, N].

    ``reference=True`` (:data:`gemv_reference`): what the kernel computes, unfused in PyTorch on any device: the
    prologue op, the product (+ bias), the residual add."""
    if reference:
        if mode == "norm":
            x, _ = add_rmsnorm_reference(x, None, norm_weight, eps)  # [1, K]
        elif mode == "silu":
            x = silu_mul_reference(x)  # [1, 2K] -> [1, K]
        out = F.linear(x, weight, bias)  # [1, N]
        return out if residual is None else residual + out
    k = weight.shape[1]
    xin = x[:, :k] if mode == "silu" else x  # [1, K]
    _check("gemv", xin, weight)
    n = weight.shape[0]
    bn, bk, warps, stages = config(n, k)
    out = torch.empty(1, n, dtype=weight.dtype, device=weight.device)  # [1, N]
    up = x[:, k:] if mode == "silu" else x
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        up,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        float(eps),
        MODE=MODES[mode],
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        KP2=triton.next_power_of_2(k),
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN=(n % bn == 0 and k % bk == 0),
        num_warps=warps,
        num_stages=stages,
    )
    return out


gemv_reference = functools.partial(gemv, reference=True)  # the unfused step: gemv's arguments, any device


def qkv_rope_gemv(
    h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, bias: torch.Tensor | None, kv: KVWrite
) -> torch.Tensor:
    """h [1, H] -> q [1, Hq, D] of rmsnorm(h) @ W_qkv.T with rotary; k (rotary) and v stored at ``kv.slots``."""
    _check("qkv_rope_gemv", h, weight)
    d, hq, hkv = kv.k_cache.shape[-1], kv.hq, kv.hkv
    half, k = d // 2, weight.shape[1]
    if weight.shape[0] != (hq + 2 * hkv) * d or d & (d - 1):
        raise KernelInputError(
            "qkv_rope_gemv: weight",
            f"[(Hq+2Hkv)*D, K] = [{(hq + 2 * hkv) * d}, K] with D a power of two",
            f"{tuple(weight.shape)} (D={d} from the cache)",
            "pass the layer's fused qkv weight and its head counts",
        )
    bh, bk, warps, stages = config(weight.shape[0] // 2, k)
    bh = min(bh, half)
    q = torch.empty(1, hq, d, dtype=h.dtype, device=h.device)  # [1, Hq, D]
    _qkv_rope_kernel[((hq + 2 * hkv) * (half // bh),)](
        h,
        norm_weight,
        weight,
        bias if bias is not None else weight,
        kv.positions,
        kv.inv_freq,
        q,
        kv.k_cache,
        kv.v_cache,
        kv.slots,
        k,
        weight.stride(0),
        kv.k_cache.stride(1),
        float(eps),
        hq,
        hkv,
        D=d,
        HALF=half,
        BH=bh,
        HAS_BIAS=bias is not None,
        KP2=triton.next_power_of_2(k),
        BLOCK_K=bk,
        EVEN=k % bk == 0,
        num_warps=warps,
        num_stages=stages,
    )
    return q
