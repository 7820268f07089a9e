"""Prefill-sized fp32 GEMMs on CPU through oneDNN (bundled with PyTorch) with weights packed once.

    from eagleray.kernels import cpu_gemm
    y = cpu_gemm.linear(x, w, b)      # x [M, K], w [N, K], b [N] or None -> [M, N]; M large (a prompt's tokens)
    y = cpu_gemm.linear_add(x, w, r)  # x w^T + r [M, N], the add in oneDNN's post-op
    cpu_gemm.available()              # False where PyTorch was built without oneDNN (then callers use MKL)

A prompt's prefill is GEMM-bound: at 560 tokens SmolLM2's gate/up product ([560, 576] x [576, 3072]) ran at
92-165 GFLOP/s through ``torch.nn.functional.linear`` (MKL's sgemm, the weight transposed on every call) and at
~210 GFLOP/s through oneDNN's linear on a weight reordered once into its blocked layout (a 2-core AMD EPYC VM,
BENCHMARKS.md). The reordered copy is made on first use and kept on the tensor like the native kernel's
:func:`~eagleray.kernels.cpu_panels.packed` layout (the weight's memory again); it is made again when the weight
changes in place or moves. The reference is :func:`torch.nn.functional.linear` (``linear_reference``); the two
differ by fp32 rounding only (a different summation order), so both the plain and the speculative engine must
take the same path for a prompt (they do: every prefill goes here).
"""

from __future__ import annotations

import torch

from eagleray.kernels import weight_cache
from eagleray.kernels.errors import KernelInputError

BATCH_HINT = 512  # the row count oneDNN plans the packed layout for (a few prompts' tokens); any M works


def available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear (x86-64 and aarch64 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], w [N, K], b [N] -> [M, N] (PyTorch)."""
    return torch.nn.functional.linear(x, w, b)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32, w [N, K] fp32, b [N] fp32 or None -> y [M, N] fp32 (oneDNN, w in its packed layout)."""
    _check(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed(w), b, "none", [], "")  # [M, N]


def linear_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ w [N, K]^T + residual [M, N] fp32 -> a new [M, N] (the add is oneDNN's post-op on the product)."""
    _check(x, w, None)
    if residual.dtype != torch.float32 or tuple(residual.shape) != (x.shape[0], w.shape[0]) or residual.device.type != "cpu":
        raise KernelInputError("residual", f"[{x.shape[0]}, {w.shape[0]}] fp32 on the CPU",
                               f"{tuple(residual.shape)} {residual.dtype}", "pass the rows the product adds to")  # fmt: skip
    return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual.contiguous(), packed(w), None, "add")


def linear_add_reference(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w) + residual


def _reorder(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), BATCH_HINT)


_PACKED = "_eagleray_onednn"  # attribute on the weight tensor
# oneDNN's layout of w [N, K], made once and kept on the tensor; made again when w changes (weight_cache says when;
# forget_packed(w) after a change it cannot see).
packed = weight_cache.Layout(_PACKED, _reorder)
forget_packed = packed.forget


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("w", w)):
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 2:
            raise KernelInputError(
                name, "a 2-D fp32 CPU tensor", f"{tuple(t.shape)} {t.dtype} on {t.device}", "use torch.nn.functional.linear"
            )
    if x.shape[1] != w.shape[1]:
        raise KernelInputError("x", f"[M, {w.shape[1]}] (w is {tuple(w.shape)})", str(tuple(x.shape)), "pass matching widths")
    if b is not None and (b.dtype != torch.float32 or tuple(b.shape) != (w.shape[0],)):
        raise KernelInputError("b", f"[{w.shape[0]}] fp32", f"{tuple(b.shape)} {b.dtype}", "pass the layer's bias or None")
    if not available():
        raise KernelInputError("torch", "a build with oneDNN (mkldnn)", "none", "check cpu_gemm.available() first")
