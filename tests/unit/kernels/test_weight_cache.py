"""A weight's derived layout (a kernel's packed copy) is made once, kept on the tensor, and made again when the
weight changes in a way torch can see; :func:`weight_cache.forget` for the ways it cannot."""

from __future__ import annotations

import torch

from eagleray.kernels import weight_cache

ATTR = "_test_layout"


def _counting():
    made = []

    def make(w: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return w.t().contiguous() * 1.0

    return made, make


def test_made_once_and_again_after_an_in_place_change():
    made, make = _counting()
    w = torch.randn(5, 3)
    first = weight_cache.cached(w, ATTR, make)
    assert weight_cache.cached(w, ATTR, make) is first and len(made) == 1, "kept on the tensor"
    with torch.no_grad():
        w.mul_(2)  # in place (a load_state_dict copy is too)
    again = weight_cache.cached(w, ATTR, make)
    assert again is not first and torch.equal(again, w.t()) and len(made) == 2


def test_a_change_through_data_is_seen_only_after_forget():
    made, make = _counting()
    w = torch.randn(5, 3)
    weight_cache.cached(w, ATTR, make)
    w.data.add_(1)  # .data has its own version counter: not seen ...
    assert not torch.equal(weight_cache.cached(w, ATTR, make), w.t()) and len(made) == 1
    weight_cache.forget(w, ATTR)  # ... until forgotten
    assert torch.equal(weight_cache.cached(w, ATTR, make), w.t()) and len(made) == 2
    weight_cache.forget(torch.randn(2), ATTR)  # nothing kept: nothing to drop


def test_an_inference_tensor_keeps_its_copy():
    made, make = _counting()
    with torch.inference_mode():
        w = torch.randn(5, 3)  # a TP worker's weights: no version counter to read
    assert weight_cache.cached(w, ATTR, make) is weight_cache.cached(w, ATTR, make) and len(made) == 1
