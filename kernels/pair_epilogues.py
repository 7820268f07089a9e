"""Epilogues of the batch-invariant linear that pair two of its output columns: SiLU*up and rotary + KV write.

A decode layer's gate/up product is followed by ``silu(gate) * up`` and its q/k/v product by rotary on q and k
and the k/v store into the paged cache: each a kernel of its own that reads back what the product just wrote
(two of the ~10 launches a layer, a few microseconds each at batch 1 on an H200). Both ops combine output column
``c`` with one partner column: gate ``j`` with up ``j`` (``I + j``), and within a head, ``d`` with ``d + D/2``.
So the linear computes the columns of each pair side by side (:func:`pair_source`: which weight row feeds tile
column ``j``; the weight stays as it is) and its epilogue applies the op to the two halves of the tile
(:func:`pair_store`). The products are the same per-row sums as the unfused linear (the main loop is untouched,
so a row's result still does not depend on the number of rows), rounded to the weight's dtype before the op,
which then rounds as :mod:`eagleray.kernels.decode_ops` does: the fused result equals linear-then-op.

    EPI_NONE: the plain linear; EPI_GLU: out [M, I] = silu(x @ gate.T) * (x @ up.T) of a fused [2I, K] weight;
    EPI_ROPE: q [M, Hq*D] = rotary(x @ Wq.T), rotary(x @ Wk.T) and x @ Wv.T written at the rows' cache slots.

``half``: the distance of a pair's partner (I for GLU, D/2 for rotary). ``EAGLERAY_PAIR_EPILOGUES`` ``on``
(default) or ``off`` (the ops as kernels of their own: the A/B of the fused step).
"""

from __future__ import annotations

from eagleray.kernels.launch import switch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional on CPU machines
    triton = None

EPI_NONE, EPI_GLU, EPI_ROPE = 0, 1, 2
PAIR_ENV = "EAGLERAY_PAIR_EPILOGUES"


def pair_epilogues_enabled() -> bool:
    """Whether the batch-invariant decode step fuses SiLU*up and rotary + KV write into its products."""
    return switch(PAIR_ENV)


if triton is not None:

    @triton.jit
    def pair_source(p, second, half, EPI: tl.constexpr):
        """The weight row of pair ``p``'s first (``second`` 0) or second (1) column, as [n] int."""
        if EPI == 1:  # gate j, up I + j
            return p + second * half
        else:  # head h = p // half: columns h*D + d and h*D + d + D/2
            return (p // half) * (2 * half) + p % half + second * half

    @triton.jit
    def pair_store(
        a,
        b,  # [BM, BP] fp32: the two columns of each pair, rounded to the output dtype
        rm,  # [BM] rows
        p,  # [BP] pairs
        mmask,
        pmask,
        out_ptr,  # GLU: [M, I]; ROPE: q [M, Hq*D] (row stride stride_o)
        stride_o,
        half,
        pos_ptr,  # [M] int64 positions (ROPE)
        inv_ptr,  # [D/2] fp32 rotary frequencies (ROPE)
        slot_ptr,  # [M] int64 cache slots (ROPE)
        k_ptr,
        v_ptr,  # [num_slots, Hkv, D] (slot stride stride_slot), one layer's caches (ROPE)
        stride_slot,
        HQ,
        HKV,
        EPI: tl.constexpr,
    ):
        dt = out_ptr.dtype.element_ty
        mask = mmask[:, None] & pmask[None, :]
        if EPI == 1:  # silu(gate) * up, rounded as decode_ops.silu_mul
            act = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * stride_o + p[None, :], (act * b).to(dt), mask=mask)
        else:  # rotary on q and k heads (rounded as decode_ops.rotary_halves), k and v to their cache slots
            head = p // half  # [BP]
            d = p % half  # [BP]
            f = (
                tl.load(pos_ptr + rm, mask=mmask, other=0).to(tl.float32)[:, None]
                * tl.load(inv_ptr + d, mask=pmask, other=0.0)[None, :]
            )
            c = tl.cos(f).to(dt).to(tl.float32)
            s = tl.sin(f).to(dt).to(tl.float32)
            o1 = ((a * c).to(dt).to(tl.float32) + (-(b * s)).to(dt).to(tl.float32)).to(dt)  # [BM, BP]
            o2 = ((b * c).to(dt).to(tl.float32) + (a * s).to(dt).to(tl.float32)).to(dt)  # [BM, BP]
            col = head * (2 * half) + d  # [BP]: the first column of the pair within its head's group
            is_q = pmask & (head < HQ)
            is_k = pmask & (head >= HQ) & (head < HQ + HKV)
            is_v = pmask & (head >= HQ + HKV)
            q_at = out_ptr + rm[:, None] * stride_o + col[None, :]
            tl.store(q_at, o1, mask=mmask[:, None] & is_q[None, :])
            tl.store(q_at + half, o2, mask=mmask[:, None] & is_q[None, :])
            slot = tl.load(slot_ptr + rm, mask=mmask, other=0).to(tl.int64)[:, None] * stride_slot  # [BM, 1]
            k_at = k_ptr + slot + (col - HQ * 2 * half)[None, :]
            tl.store(k_at, o1.to(k_ptr.dtype.element_ty), mask=mmask[:, None] & is_k[None, :])
            tl.store(k_at + half, o2.to(k_ptr.dtype.element_ty), mask=mmask[:, None] & is_k[None, :])
            v_at = v_ptr + slot + (col - (HQ + HKV) * 2 * half)[None, :]
            tl.store(v_at, a.to(v_ptr.dtype.element_ty), mask=mmask[:, None] & is_v[None, :])
            tl.store(v_at + half, b.to(v_ptr.dtype.element_ty), mask=mmask[:, None] & is_v[None, :])
