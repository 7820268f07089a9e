"""Batch-invariant products whose epilogue pairs two column halves (Triton), with their PyTorch references.

Two element-wise ops of the decode step read pairs of a product's columns: SiLU * up pairs gate column j with up
column I + j, and rotary pairs column i of a head with column i + D/2. A tile of these products computes the two
halves side by side (two ``tl.dot`` a K step, ``block_n / 2`` columns each), so the op runs in the product's
epilogue and its launch and the [M, N] round trip through memory are gone (one kernel a layer fewer each):

- :func:`gated_linear`: x @ [gate; up].T -> silu(gate) * up [M, I]
- :func:`rope_linear`: x @ [q; k; v].T -> q [M, Hq, D] rotated; k rotated and v stored at their cache slots

Invariance is :mod:`eagleray.kernels.invariant_linear`'s: the same plan by weight shape (splits, ``block_k``), the
same K loop for every row, split partials added in split order, RMSNorm from the sums of squares of the product
before (``norm=``); a row's result never depends on the rows beside it. Roundings are the separate kernels': the
product is rounded to the weight's dtype, then the op runs on those values (:func:`~eagleray.kernels.decode_ops.
silu_times`, :func:`~eagleray.kernels.decode_ops.rotate_pair`).

    act = gated_linear(h, w_gate_up, norm=(sq, eps))          # [M, I]
    q = rope_linear(h, w_qkv, b_qkv, kv_write, norm=(sq, eps))   # [M, Hq, D]; k, v written to kv_write's caches
"""

from __future__ import annotations

import torch

from eagleray.kernels.decode_ops import KVWrite, rope_write_kv_reference, silu_mul_reference
from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.invariant_linear import check_inputs, check_norm, invariant_linear_reference
from eagleray.kernels.invariant_plans import BLOCK_M, REDUCE_BM, plan
from eagleray.kernels.launch import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional on CPU machines
    triton = None


def gated_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias=None, norm_eps: float | None = None) -> torch.Tensor:
    """silu(gate) * up of the product x [M, K] @ weight [2I, K].T (see invariant_linear_reference) -> [M, I]."""
    return silu_mul_reference(invariant_linear_reference(x, weight, bias, norm_eps=norm_eps))


def rope_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias, kv: KVWrite, norm_eps: float | None = None
) -> torch.Tensor:
    """Rotary q of the product x @ weight [(Hq+2Hkv)*D, K].T; rotated k and v written at ``kv.slots`` -> [M, Hq, D]."""
    return rope_write_kv_reference(invariant_linear_reference(x, weight, bias, norm_eps=norm_eps), kv)


if triton is not None:
    from eagleray.kernels.decode_ops import rotate_pair, silu_times
    from eagleray.kernels.launch import await_inputs

    @triton.jit
    def _pair_cols(t, TPH, STRIDE, OFF, SEG, HB: tl.constexpr):
        """Tile t's two column halves [HB] each and their mask: half 1 at (t // TPH) * STRIDE + (t % TPH) * HB + i,
        half 2 OFF columns after it; a half holds SEG columns in all (gated: one segment of I; rope: a head's D/2)."""
        i = (t % TPH) * HB + tl.arange(0, HB)  # [HB]
        c1 = (t // TPH) * STRIDE + i
        return c1, c1 + OFF, i < SEG

    @triton.jit
    def _pair_partial_kernel(
        x_ptr,  # [M, K] (row stride stride_x)
        w_ptr,  # [N, K] (row stride stride_w)
        part_ptr,  # [S, M, N] fp32 partial sums (S > 1)
        b_ptr,
        out_ptr,  # [N]; [M, I] (gated) or q [M, Hq*D] (rope)
        sq_in_ptr,  # [M, T_IN] x's rows' sums of squares (HAS_RMS)
        pos_ptr,
        inv_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,  # rope: [M] int64, [D/2] fp32, the caches [slots, Hkv, D] (slot stride), [M] int64
        M,
        K,
        N,
        stride_x,
        stride_w,
        stride_o,
        stride_slot,
        K_PER_SPLIT,
        T_IN,
        eps,
        TPH,
        STRIDE,
        OFF,
        SEG,
        HQ,
        HKV,
        FUSED: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RMS: tl.constexpr,
        TP_IN: tl.constexpr,
        ROPE: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        HB: tl.constexpr,
        BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        pid_m = tl.program_id(0)
        t = tl.program_id(1)
        s = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)  # [BM]
        mmask = rm < M
        c1, c2, cmask = _pair_cols(t, TPH, STRIDE, OFF, SEG, HB)  # [HB] x3
        acc1 = tl.zeros([BM, HB], tl.float32)
        acc2 = tl.zeros([BM, HB], tl.float32)
        k_lo = s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)  # [BK]
            kmask = rk < k_hi
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
            wmask = cmask[:, None] & kmask[None, :]
            w1 = tl.load(
                w_ptr + c1[:, None] * stride_w + rk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first"
            )  # [HB, BK]
            w2 = tl.load(
                w_ptr + c2[:, None] * stride_w + rk[None, :], mask=wmask, other=0.0, eviction_policy="evict_first"
            )  # [HB, BK]
            if IEEE:  # fp32 weights: full fp32 products, not TF32
                acc1 = tl.dot(a, tl.trans(w1), acc1, input_precision="ieee")  # [BM, HB]
                acc2 = tl.dot(a, tl.trans(w2), acc2, input_precision="ieee")
            else:
                acc1 = tl.dot(a, tl.trans(w1), acc1)
                acc2 = tl.dot(a, tl.trans(w2), acc2)
        if FUSED:
            _pair_epilogue(
                acc1, acc2, rm, c1, c2, cmask, t, M, K, b_ptr, out_ptr, stride_o, sq_in_ptr, T_IN, eps, pos_ptr,
                inv_ptr, k_ptr, v_ptr, slot_ptr, stride_slot, TPH, HQ, HKV, HAS_BIAS, HAS_RMS, TP_IN, ROPE, D,
            )  # fmt: skip
        else:
            omask = mmask[:, None] & cmask[None, :]
            base = part_ptr + (s * M + rm[:, None]) * N
            tl.store(base + c1[None, :], acc1, mask=omask)
            tl.store(base + c2[None, :], acc2, mask=omask)

    @triton.jit
    def _pair_reduce_kernel(
        part_ptr,  # [S, M, N] fp32
        b_ptr,
        out_ptr,
        sq_in_ptr,
        pos_ptr,
        inv_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,  # as _pair_partial_kernel's
        M,
        K,
        N,
        stride_o,
        stride_slot,
        T_IN,
        eps,
        TPH,
        STRIDE,
        OFF,
        SEG,
        HQ,
        HKV,
        S: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RMS: tl.constexpr,
        TP_IN: tl.constexpr,
        ROPE: tl.constexpr,
        D: tl.constexpr,
        BM: tl.constexpr,
        HB: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        t = tl.program_id(1)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
        c1, c2, cmask = _pair_cols(t, TPH, STRIDE, OFF, SEG, HB)
        omask = (rm < M)[:, None] & cmask[None, :]
        acc1 = tl.zeros([BM, HB], tl.float32)
        acc2 = tl.zeros([BM, HB], tl.float32)
        for s in tl.static_range(S):  # split order: the fixed summation order
            base = part_ptr + (s * M + rm[:, None]) * N
            acc1 += tl.load(base + c1[None, :], mask=omask, other=0.0)
            acc2 += tl.load(base + c2[None, :], mask=omask, other=0.0)
        _pair_epilogue(
            acc1, acc2, rm, c1, c2, cmask, t, M, K, b_ptr, out_ptr, stride_o, sq_in_ptr, T_IN, eps, pos_ptr,
            inv_ptr, k_ptr, v_ptr, slot_ptr, stride_slot, TPH, HQ, HKV, HAS_BIAS, HAS_RMS, TP_IN, ROPE, D,
        )  # fmt: skip

    @triton.jit
    def _pair_epilogue(
        acc1, acc2, rm, c1, c2, cmask, t, M, K, b_ptr, out_ptr, stride_o, sq_in_ptr, T_IN, eps, pos_ptr, inv_ptr,
        k_ptr, v_ptr, slot_ptr, stride_slot, TPH, HQ, HKV,
        HAS_BIAS: tl.constexpr, HAS_RMS: tl.constexpr, TP_IN: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        """acc1, acc2 [BM, HB] fp32 (-> * 1/rms) (-> + bias) -> the weight's dtype -> silu(1) * 2, stored at half 1's
        columns (gated); or rotated (q and k heads), stored to q or the k/v cache at the rows' slots (rope)."""
        mmask = rm < M
        omask = mmask[:, None] & cmask[None, :]
        if HAS_RMS:  # x's T_IN partial sums of squares, added in tile order (as invariant_linear's epilogue)
            ti = tl.arange(0, TP_IN)
            sq = tl.load(sq_in_ptr + rm[:, None] * T_IN + ti[None, :], mask=mmask[:, None] & (ti < T_IN)[None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / K + eps)  # [BM]
            acc1 = acc1 * rstd[:, None]
            acc2 = acc2 * rstd[:, None]
        if HAS_BIAS:
            acc1 += tl.load(b_ptr + c1, mask=cmask, other=0.0)[None, :].to(tl.float32)
            acc2 += tl.load(b_ptr + c2, mask=cmask, other=0.0)[None, :].to(tl.float32)
        dt = out_ptr.dtype.element_ty
        y1 = acc1.to(dt)
        y2 = acc2.to(dt)
        if ROPE:  # a tile lies in one head: q, k or v
            head = t // TPH
            if head < HQ + HKV:
                j = c1 - head * D  # [HB] the frequency index
                pos = tl.load(pos_ptr + rm, mask=mmask, other=0).to(tl.float32)  # [BM]
                f = pos[:, None] * tl.load(inv_ptr + j)[None, :]  # [BM, HB]
                y1, y2 = rotate_pair(y1.to(tl.float32), y2.to(tl.float32), f, dt)
            if head < HQ:
                tl.store(out_ptr + rm[:, None] * stride_o + c1[None, :], y1, mask=omask)
                tl.store(out_ptr + rm[:, None] * stride_o + c2[None, :], y2, mask=omask)
            else:
                slot = tl.load(slot_ptr + rm, mask=mmask, other=0)  # [BM]
                if head < HQ + HKV:
                    dst = k_ptr + slot[:, None] * stride_slot + (c1 - HQ * D)[None, :]
                else:
                    dst = v_ptr + slot[:, None] * stride_slot + (c1 - (HQ + HKV) * D)[None, :]
                tl.store(dst, y1.to(k_ptr.dtype.element_ty), mask=omask)
                tl.store(dst + D // 2, y2.to(k_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(
                out_ptr + rm[:, None] * stride_o + c1[None, :], silu_times(y1.to(tl.float32), y2.to(tl.float32), dt), mask=omask
            )


def _bad(op: str, arg: str, expected: str, got, fix: str) -> KernelInputError:
    return KernelInputError(f"{op}: {arg}", expected, str(got), fix)


def _half_block(op: str, n: int, k: int, device: torch.device, cap: int) -> tuple:
    """The plan of the weight [N, K] and its tiles' half width: block_n / 2, at most ``cap`` (a power of two)."""
    p = plan(n, k, device)
    hb = min(p.block_n // 2, cap)
    if hb < 1 or hb & (hb - 1):
        raise _bad(op, "plan", "block_n a power of two >= 2", p.block_n, "retune the plan of this shape")
    return p, hb


def _launch(op: str, x, weight, bias, norm, out, cols, rope=None) -> None:
    """Both kernels of a paired product: ``cols`` = (tiles, TPH, STRIDE, OFF, SEG, HB, plan); ``rope`` = (kv, D)."""
    tiles, tph, stride, off, seg, hb, p = cols
    m, k = x.shape
    n = weight.shape[0]
    fused = p.splits == 1
    part = out if fused else torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    sq_in, eps = norm if norm is not None else (out, 0.0)  # [M, T_IN]
    kv, d = rope if rope is not None else (None, 2)
    ptrs = (kv.positions, kv.inv_freq, kv.k_cache, kv.v_cache, kv.slots) if kv is not None else (out,) * 5
    stride_slot = kv.k_cache.stride(1) if kv is not None else 0
    t_in = sq_in.shape[1] if norm is not None else 1
    hq, hkv = (kv.hq, kv.hkv) if kv is not None else (0, 0)
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_RMS=norm is not None,
        TP_IN=triton.next_power_of_2(t_in),
        ROPE=kv is not None,
        D=d,
        **pdl_launch(x.device),
    )
    b = bias if bias is not None else out
    _pair_partial_kernel[(triton.cdiv(m, BLOCK_M), tiles, p.splits)](
        x, weight, part, b, out, sq_in, *ptrs, m, k, n, x.stride(0), weight.stride(0), out.stride(0), stride_slot,
        p.k_per_split, t_in, float(eps), tph, stride, off, seg, hq, hkv,
        FUSED=fused, IEEE=weight.dtype == torch.float32, BM=BLOCK_M, HB=hb, BK=p.block_k, num_warps=p.warps,
        num_stages=p.stages, **flags,
    )  # fmt: skip
    if not fused:
        _pair_reduce_kernel[(triton.cdiv(m, REDUCE_BM), tiles)](
            part, b, out, sq_in, *ptrs, m, k, n, out.stride(0), stride_slot, t_in, float(eps), tph, stride, off, seg,
            hq, hkv, S=p.splits, BM=REDUCE_BM, HB=hb, num_warps=4, **flags,
        )  # fmt: skip


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, norm=None) -> torch.Tensor:
    """silu(gate) * up of x [M, K] @ weight [2I, K].T (gate rows first, then up; + bias) -> [M, I], batch-invariant;
    ``norm=(sq, eps)`` as in :func:`~eagleray.kernels.invariant_linear.invariant_linear`."""
    op = "gated_linear"
    check_inputs(x, weight, bias, None, op)
    if norm is not None:
        check_norm(x, norm, op)
    n, k = weight.shape
    if n % 2:
        raise _bad(op, "weight", "[2I, K]: gate rows then up rows", tuple(weight.shape), "pass the fused gate_up weight")
    inter = n // 2
    p, hb = _half_block(op, n, k, x.device, n)
    out = torch.empty(x.shape[0], inter, dtype=weight.dtype, device=x.device)  # [M, I]
    tiles = triton.cdiv(inter, hb)
    _launch(op, x, weight, bias, norm, out, (tiles, tiles, 0, inter, inter, hb, p))
    return out


def rope_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kv: KVWrite, *, norm=None) -> torch.Tensor:
    """q of x [M, K] @ weight [(Hq+2Hkv)*D, K].T (+ bias), rotated at ``kv.positions``; k rotated and v stored at
    ``kv.slots`` of ``kv``'s caches -> q [M, Hq, D]. Batch-invariant; ``norm`` as in :func:`gated_linear`."""
    op = "rope_linear"
    check_inputs(x, weight, bias, None, op)
    if norm is not None:
        check_norm(x, norm, op)
    d, heads = kv.k_cache.shape[-1], kv.hq + 2 * kv.hkv
    if weight.shape[0] != heads * d or d % 2 or (d // 2) & (d // 2 - 1):
        raise _bad(
            op, "weight", f"[(Hq+2Hkv)*D, K] = [{heads * d}, K], D/2 a power of two", tuple(weight.shape),
            "pass this layer's fused qkv weight (kv.hq, kv.hkv and the cache's head_dim must match it)",
        )  # fmt: skip
    if kv.positions.shape != (x.shape[0],) or kv.slots.shape != (x.shape[0],):
        raise _bad(
            op,
            "kv",
            f"positions and slots [{x.shape[0]}]",
            (tuple(kv.positions.shape), tuple(kv.slots.shape)),
            "one per row of x",
        )
    p, hb = _half_block(op, weight.shape[0], x.shape[1], x.device, d // 2)
    q = torch.empty(x.shape[0], kv.hq, d, dtype=weight.dtype, device=x.device)  # [M, Hq, D]
    tph = d // 2 // hb
    _launch(op, x, weight, bias, norm, q.view(x.shape[0], -1), (heads * tph, tph, d, d // 2, d // 2, hb, p), (kv, d))
    return q
