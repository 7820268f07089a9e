"""The native linear's weight layout (:func:`eagleray.kernels.cpu_decode.linear`, the fused layer's products): panels
of the kernel's column count, made once per weight and kept on the tensor.

    p = cpu_panels.packed(w)        # [ceil(N / P), K, P] (P: 48, AVX2 16): fp32, or bf16 where every value of w is a bf16 value
    cpu_panels.forget_packed(w)     # made again on next use

A weight whose fp32 values are all bf16 values (a draft saved in bf16 and loaded as fp32) is packed in bf16: the kernel
widens each back to the same fp32 value before the same FMA chain, so the product is bit for bit the fp32 panels', from
half the bytes a decode step streams.
"""

from __future__ import annotations

import torch

from eagleray.kernels import weight_cache


def pack(w: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """w [N, K] -> [ceil(N / cols), K, cols]: panels of `cols` output columns (the kernel's, by default),
    p[i, k, j] = w[i * cols + j, k], zeros past N."""
    if cols is None:
        from eagleray.kernels import cpu_decode  # the kernel's panel width (cpu_decode imports this module)

        cols = cpu_decode.library().linear_panel_cols()
    n, k = w.shape
    panels = -(-n // cols)
    padded = torch.zeros(panels * cols, k, dtype=w.dtype)  # [N_pad, K]
    padded[:n] = w
    return padded.view(panels, cols, k).transpose(1, 2).contiguous()


def bf16_values(w: torch.Tensor) -> torch.Tensor | None:
    """fp32 ``w`` in bf16 where every one of its values is a bf16 value (the same numbers in half the bytes), else None."""
    if w.dtype != torch.float32:
        return None
    low = w.to(torch.bfloat16)
    return low if torch.equal(low.to(torch.float32), w) else None


def pack_exact(w: torch.Tensor) -> torch.Tensor:
    """:func:`pack` of w, in bf16 where :func:`bf16_values` gives its values in bf16, else in w's dtype."""
    low = bf16_values(w)
    return pack(w if low is None else low)


_PACKED = "_eagleray_packed"  # attribute on the weight tensor
# The packed layout of w, made once and kept on the tensor (its memory beside w's); made again when w changes
# (weight_cache says when; forget_packed(w) after a change it cannot see).
packed = weight_cache.Layout(_PACKED, lambda w: pack_exact(w))  # looked up per use (tests replace it)
forget_packed = packed.forget
