"""Programmatic dependent launch (PDL) for the kernels of the decode, verify and draft steps.

A CUDA graph of the decode step replays ~10 small kernels a layer; on an H200 each one pays a few
microseconds between the end of one kernel and the first loads of the next (grid launch, block
scheduling, prologue). With PDL (Hopper and later) a kernel launched with ``launch_pdl`` may start
while the previous kernel of the stream is still running: its programs run up to
``gdc_wait`` (which returns once every earlier kernel has finished and its writes are visible) and
the previous kernel lets them in early with ``gdc_launch_dependents``. Every kernel that takes part
calls :func:`await_inputs` before its first load or store, so the results are the same bits as
without PDL; only the gaps shrink. Kernels without it (PyTorch's) keep the ordinary stream order.

``EAGLERAY_PDL``: ``auto`` (default; on for CUDA devices of compute capability >= 9, never under the
Triton interpreter), ``on`` (an error where it is not supported) or ``off``.

    kernel[grid](..., **pdl_launch(x.device))      # adds PDL=<bool> (and launch_pdl=True when on)
"""

from __future__ import annotations

import functools
import os

import torch

from eagleray.kernels.errors import KernelInputError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional on CPU machines
    triton = None

PDL_ENV = "EAGLERAY_PDL"
MODES = ("auto", "on", "off")


def pdl_mode() -> str:
    """The ``EAGLERAY_PDL`` setting, checked."""
    mode = os.environ.get(PDL_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise KernelInputError(PDL_ENV, "one of auto, on, off", repr(mode), f"export {PDL_ENV}=auto (or unset it)")
    return mode


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``; tests on CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring)."""
    mode = pdl_mode()
    if mode == "off":
        return False
    ok = triton is not None and not interpreting() and _supported(device)
    if mode == "on" and not ok:
        raise KernelInputError(
            PDL_ENV,
            "a CUDA device of compute capability >= 9 (Hopper or later), compiled kernels",
            f"device {device}{' under the Triton interpreter' if interpreting() else ''}",
            f"export {PDL_ENV}=auto, which uses PDL only where it is supported",
        )
    return ok


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of a PDL-aware kernel: its ``PDL`` constexpr, and ``launch_pdl`` when on."""
    on = pdl_enabled(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:

    @triton.jit
    def await_inputs(PDL: tl.constexpr):
        """Call first in a PDL-aware kernel: wait for the kernels before it, then let the next one start."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
