"""A batch-invariant linear for decode and verification on GPU (Triton), with its PyTorch reference.

Lossless greedy speculative decoding in bf16 needs a position's logits to be bitwise the same
whether it is computed alone (a plain decode step at batch 1), beside 63 other sequences, or as one
of the k+1 rows a verification step scores. cuBLAS picks its algorithm (tile shape, split-K) by
the number of rows, so the summation order of a row's dot products, and its last bits, change with
the batch. This kernel fixes that order for every row count:

- one :class:`Plan` per weight shape (and GPU), never per M: tiles (``BLOCK_M`` x ``block_n`` x
  ``block_k``, warps, stages) and a split of K into ``splits`` fixed ranges. Rows only add tiles,
  each tile runs the same instructions, and a row's products are accumulated in the same sequence
  of ``tl.dot`` steps over K; partial sums are fp32 and are added in split order by the epilogue
  kernel (no atomics). Plans measured on a GPU (``jobs/bench/invariant_check --tune``) lie in
  ``invariant_linear_plans.json`` by device name and shape (``EAGLERAY_INVARIANT_PLANS`` names another
  file); other shapes get :func:`make_plan`'s;
- the epilogue adds the bias, rounds to the weight's dtype, and optionally adds a residual
  (rounded again), as the model's ``linear`` followed by ``h + delta`` does;
- RMSNorm without a launch of its own: with ``squares=True`` the epilogue also writes each output row's sum of
  squares, one fp32 partial per column tile ([M, T], no atomics); the next product, given them as ``norm=(sq, eps)``,
  reads x raw (its loads feed ``tl.dot`` untouched), adds the T partials in tile order and scales the row by
  1/rms in its epilogue. Its weight must carry the norm's weight already (:func:`fold_norm_weight`). Every sum is a
  function of the row and the plan alone, so rows stay invariant.

Cost, measured against cuBLAS in BENCHMARKS.md: at one row the K split keeps enough programs in
flight to stream the weight; at many rows (prefill sizes) it is slower than cuBLAS, so the engine
uses it only for decode and verification, where rows are few.

    y = invariant_linear(x, weight, bias, residual=h)   # x [M, K], weight [N, K] -> [M, N]
    h, sq = invariant_linear(o, w_o, residual=h, squares=True)      # h + o @ w_o.T, its rows' sums of squares
    y = invariant_linear(h, fold_norm_weight(w, norm_w), norm=(sq, eps))   # rmsnorm(h) * norm_w @ w.T

Folding the decode step's element-wise ops into the products *on load* (``nw * x`` before ``tl.dot``, silu * up)
was measured slower on the H200 (BENCHMARKS.md): the loop's loads then feed element-wise ops before ``tl.dot`` and
the step ran 1.8x (SmolLM2) to 2.5x (8B) longer than with the ops as kernels of their own. The norm above touches
no load of the loop: its weight is in the product's weight, its 1/rms in the epilogue.
"""

from __future__ import annotations

import torch

from eagleray.kernels.errors import KernelInputError, no_triton
from eagleray.kernels.invariant_plans import BLOCK_M, REDUCE_BM, REDUCE_BN, plan
from eagleray.kernels.launch import pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional on CPU machines
    triton = None


def fold_norm_weight(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] * norm_weight [K] (fp32 product, rounded to weight.dtype): the weight of a product whose input
    is normed inside it (``invariant_linear(..., norm=...)``); a new tensor, the layer's own weight unchanged."""
    return (weight.to(torch.float32) * norm_weight.to(torch.float32)).to(weight.dtype)


def invariant_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (times 1/rms(x) with ``norm_eps``) (+ bias) in fp32, rounded to weight.dtype
    (+ residual, rounded) -> [M, N]."""
    x32 = x.to(torch.float32)
    y = x32 @ weight.to(torch.float32).T  # [M, N]
    if norm_eps is not None:
        y = y * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm_eps)
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.to(weight.dtype)
    if residual is not None:
        y = (residual.to(torch.float32) + y.to(torch.float32)).to(weight.dtype)
    return y


if triton is not None:
    from eagleray.kernels.grid import program_range
    from eagleray.kernels.launch import await_inputs

    @triton.jit
    def _partial_kernel(
        x_ptr,  # [M, K] (row stride stride_x)
        w_ptr,  # [N, K] (row stride stride_w)
        part_ptr,  # [S, M, N] fp32 partial sums
        b_ptr,
        res_ptr,
        out_ptr,  # [N], [M, N], [M, N]: used when S == 1 (epilogue fused)
        sq_in_ptr,
        sq_out_ptr,  # [M, T_IN] x's rows' sums of squares (HAS_RMS), [M, T_OUT] the output's (SQ_OUT)
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_r,
        stride_o,
        K_PER_SPLIT,
        T_IN,
        T_OUT,
        eps,
        FUSED: tl.constexpr,
        IEEE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_RMS: tl.constexpr,
        SQ_OUT: tl.constexpr,
        TP_IN: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        pid_m = tl.program_id(0)  # fastest: tiles of one weight block run together and share it in L2
        pid_n = tl.program_id(1)
        s = tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)  # [BM]
        rn = pid_n * BN + tl.arange(0, BN)  # [BN]
        mmask, nmask = rm < M, rn < N
        acc = tl.zeros([BM, BN], tl.float32)
        k_lo = s * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        for k0 in range(k_lo, k_hi, BK):
            rk = k0 + tl.arange(0, BK)  # [BK]
            kmask = rk < k_hi
            a = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
            w = tl.load(
                w_ptr + rn[:, None] * stride_w + rk[None, :],
                mask=nmask[:, None] & kmask[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )  # [BN, BK]
            if IEEE:  # fp32 weights: full fp32 products, not TF32
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")  # [BM, BN]
            else:
                acc = tl.dot(a, tl.trans(w), acc)  # [BM, BN]
        omask = mmask[:, None] & nmask[None, :]
        if FUSED:
            _epilogue(
                acc, rm, rn, M, N, K, pid_n, b_ptr, res_ptr, out_ptr, sq_in_ptr, sq_out_ptr, stride_r, stride_o,
                T_IN, T_OUT, eps, HAS_BIAS, HAS_RES, HAS_RMS, SQ_OUT, TP_IN,
            )  # fmt: skip
        else:
            tl.store(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], acc, mask=omask)

    @triton.jit
    def _epilogue(
        acc, rm, rn, M, N, K, tile, b_ptr, res_ptr, out_ptr, sq_in_ptr, sq_out_ptr, stride_r, stride_o, T_IN, T_OUT, eps,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_RMS: tl.constexpr, SQ_OUT: tl.constexpr, TP_IN: tl.constexpr,
    ):  # fmt: skip
        """acc [BM, BN] fp32 (-> * 1/rms of x's rows) -> (+ bias) -> out dtype (-> + residual -> out dtype), stored;
        with SQ_OUT the stored rows' sums of squares over this column tile go to column ``tile`` of sq_out."""
        mmask = rm < M
        omask = mmask[:, None] & (rn < N)[None, :]
        if HAS_RMS:  # x's T_IN partial sums of squares, added in tile order (a [BM, TP_IN] tile: a fixed tree)
            t = tl.arange(0, TP_IN)
            sq = tl.load(sq_in_ptr + rm[:, None] * T_IN + t[None, :], mask=mmask[:, None] & (t < T_IN)[None, :], other=0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(sq, 1) / K + eps)  # [BM]
            acc = acc * rstd[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :].to(tl.float32)
        dt = out_ptr.dtype.element_ty
        y = acc.to(dt)
        if HAS_RES:
            r = tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=omask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        if SQ_OUT:
            y32 = tl.where(omask, y.to(tl.float32), 0.0)
            tl.store(sq_out_ptr + rm * T_OUT + tile, tl.sum(y32 * y32, 1), mask=mmask)
        tl.store(out_ptr + rm[:, None] * stride_o + rn[None, :], y, mask=omask)

    @triton.jit
    def _reduce_kernel(
        part_ptr,  # [S, M, N] fp32
        b_ptr,
        res_ptr,
        out_ptr,  # [N], [M, N], [M, N]
        sq_in_ptr,
        sq_out_ptr,  # [M, T_IN], [M, T_OUT] (see _partial_kernel)
        M,
        N,
        K,
        stride_r,
        stride_o,
        T_IN,
        T_OUT,
        eps,
        S: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_RMS: tl.constexpr,
        SQ_OUT: tl.constexpr,
        TP_IN: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        PDL: tl.constexpr,
    ):
        await_inputs(PDL)
        rm, mmask = program_range(0, BM, M)
        rn, nmask = program_range(1, BN, N)
        omask = mmask[:, None] & nmask[None, :]
        acc = tl.zeros([BM, BN], tl.float32)
        for s in tl.static_range(S):  # split order: the fixed summation order
            acc += tl.load(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], mask=omask, other=0.0)
        _epilogue(
            acc, rm, rn, M, N, K, tl.program_id(1), b_ptr, res_ptr, out_ptr, sq_in_ptr, sq_out_ptr, stride_r, stride_o,
            T_IN, T_OUT, eps, HAS_BIAS, HAS_RES, HAS_RMS, SQ_OUT, TP_IN,
        )  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    def bad(arg: str, expected: str, got, fix: str) -> KernelInputError:
        return KernelInputError(f"invariant_linear: {arg}", expected, str(got), fix)

    if triton is None:
        raise no_triton("invariant_linear")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise bad(
            "x, weight",
            "x [M, K] and weight [N, K] (the same K)",
            f"{tuple(x.shape)} and {tuple(weight.shape)}",
            "pass 2-D tensors with matching inner dimensions",
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise bad(
            "x, weight",
            "contiguous rows (stride 1 in the last dim)",
            f"strides {x.stride()}, {weight.stride()}",
            "pass .contiguous() tensors",
        )
    if x.dtype != weight.dtype or x.device != weight.device:
        raise bad(
            "x",
            f"the weight's dtype and device ({weight.dtype}, {weight.device})",
            f"{x.dtype}, {x.device}",
            "cast x to the weight's dtype and device",
        )
    n = weight.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.stride(0) != 1):
        raise bad("bias", f"a contiguous [{n}] tensor", tuple(bias.shape), "pass the layer's own bias")
    if residual is not None and (tuple(residual.shape) != (x.shape[0], n) or residual.stride(1) != 1):
        raise bad(
            "residual",
            f"[{x.shape[0]}, {n}] with contiguous rows",
            tuple(residual.shape),
            "pass the residual stream of the same rows",
        )


def _check_norm(x: torch.Tensor, norm) -> None:
    sq = norm[0]
    if sq.dtype != torch.float32 or sq.dim() != 2 or sq.shape[0] != x.shape[0] or not sq.is_contiguous():
        raise KernelInputError(
            "invariant_linear: norm",
            f"(x's rows' sums of squares [{x.shape[0]}, T] fp32, contiguous; eps)",
            f"{tuple(sq.shape)} {sq.dtype}",
            "pass the squares returned by the product that made x (squares=True)",
        )


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    squares: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] @ weight [N, K].T (+ bias) -> weight.dtype (+ residual [M, N]) -> [M, N]; row results do not
    depend on M (see the module docstring).

    ``norm=(sq, eps)``: the product of rmsnorm(x) (no norm weight: fold it into ``weight``, :func:`fold_norm_weight`),
    ``sq`` [M, T] fp32 being x's rows' sums of squares in partials, as a product with ``squares=True`` returns them.
    ``squares``: return (out, the output's rows' sums of squares [M, T] fp32) instead of out."""
    _check(x, weight, bias, residual)
    if norm is not None:
        _check_norm(x, norm)
    m, k = x.shape
    n = weight.shape[0]
    p = plan(n, k, x.device)
    out = torch.empty(m, n, dtype=weight.dtype, device=x.device)  # [M, N]
    fused = p.splits == 1
    launch = pdl_launch(x.device)
    part = out if fused else torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    b = bias if bias is not None else out
    r = residual if residual is not None else out
    t_out = triton.cdiv(n, p.block_n if fused else REDUCE_BN)  # the epilogue's column tiles
    sq_out = torch.empty(m, t_out, dtype=torch.float32, device=x.device) if squares else out  # [M, T_OUT]
    sq_in, eps = norm if norm is not None else (out, 0.0)  # [M, T_IN]
    t_in = sq_in.shape[1] if norm is not None else 1
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        HAS_RMS=norm is not None,
        SQ_OUT=squares,
        TP_IN=triton.next_power_of_2(t_in),
    )
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, p.block_n), p.splits)
    _partial_kernel[grid](
        x,
        weight,
        part,
        b,
        r,
        out,
        sq_in,
        sq_out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        r.stride(0),
        out.stride(0),
        p.k_per_split,
        t_in,
        t_out,
        float(eps),
        FUSED=fused,
        IEEE=weight.dtype == torch.float32,
        BM=BLOCK_M,
        BN=p.block_n,
        BK=p.block_k,
        num_warps=p.warps,
        num_stages=p.stages,
        **flags,
        **launch,
    )
    if not fused:
        _reduce_kernel[(triton.cdiv(m, REDUCE_BM), t_out)](
            part,
            b,
            r,
            out,
            sq_in,
            sq_out,
            m,
            n,
            k,
            r.stride(0),
            out.stride(0),
            t_in,
            t_out,
            float(eps),
            S=p.splits,
            BM=REDUCE_BM,
            BN=REDUCE_BN,
            num_warps=4,
            **flags,
            **launch,
        )
    return (out, sq_out) if squares else out
