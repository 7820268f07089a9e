"""A layout derived from a weight (a kernel's packed copy), made once and kept on the weight tensor.

    packed = weight_cache.Layout("_eagleray_packed", pack)
    p = packed(w)              # pack(w) on first use, then the kept copy
    packed.forget(w)           # made again on next use

The copy is made again when w changes in place (torch's version counter) or its storage moves; a change through
``w.data``, which has a version counter of its own, is not seen, nor one to an inference tensor (made under
torch.inference_mode, which has no version counter): call :func:`forget` after one.
"""

from __future__ import annotations

from typing import Callable

import torch


def cached(w: torch.Tensor, attr: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(w)``, kept on w under ``attr`` while w's storage and version stay the same."""
    key = (w.data_ptr(), None if w.is_inference() else w._version)
    held = getattr(w, attr, None)
    if held is None or held[0] != key:
        held = (key, make(w))
        setattr(w, attr, held)
    return held[1]


def forget(w: torch.Tensor, attr: str) -> None:
    """Drop w's copy under ``attr`` (made again on next use)."""
    if hasattr(w, attr):
        delattr(w, attr)


class Layout:
    """One kind of derived layout: ``layout(w)`` is :func:`cached` under its attribute, ``layout.forget(w)`` drops it."""

    def __init__(self, attr: str, make: Callable[[torch.Tensor], torch.Tensor]):
        self.attr, self.make = attr, make

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return cached(w, self.attr, self.make)

    def forget(self, w: torch.Tensor) -> None:
        forget(w, self.attr)
