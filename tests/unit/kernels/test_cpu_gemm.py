"""oneDNN's packed fp32 linear for prefill GEMMs (kernels/cpu_gemm.py) against torch.nn.functional.linear: values,
the packed copy made once and again after a change, the checked wrapper."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_gemm
from eagleray.kernels.errors import KernelInputError

onednn = pytest.mark.skipif(not cpu_gemm.available(), reason="this PyTorch has no oneDNN")


def _data(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@onednn
@pytest.mark.parametrize("m", [1, 17, 140, 560])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (101, 37)])
def test_matches_torch(m, n, k):
    x, w, b = _data(m, n, k)
    torch.testing.assert_close(cpu_gemm.linear(x, w, b), cpu_gemm.linear_reference(x, w, b), atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_gemm.linear(x, w), x @ w.t(), atol=2e-4, rtol=1e-5)


@onednn
def test_rows_of_a_strided_input_are_read_as_rows():
    x, w, b = _data(40, 64, 96)
    view = x[:, :64]  # rows with a stride wider than their length (a slice of a fused output)
    torch.testing.assert_close(cpu_gemm.linear(view, w[:, :64].contiguous(), b), view @ w[:, :64].t() + b)


@onednn
def test_the_packed_copy_is_kept_and_follows_an_in_place_change():
    x, w, b = _data(33, 80, 48)
    assert cpu_gemm.packed(w) is cpu_gemm.packed(w), "kept on the tensor"
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(cpu_gemm.linear(x, w, b), x @ w.t() + b, atol=2e-4, rtol=1e-5)
    cpu_gemm.forget_packed(w)
    assert not hasattr(w, cpu_gemm._PACKED)


@pytest.mark.parametrize(
    "case,field",
    [
        (lambda x, w, b: (x.double(), w, b), "x"),
        (lambda x, w, b: (x, w.half(), b), "w"),
        (lambda x, w, b: (x[:, :5], w, b), "x"),
        (lambda x, w, b: (x, w, b[:3]), "b"),
        (lambda x, w, b: (x[0], w, b), "x"),
    ],
)
def test_bad_inputs_name_the_argument(case, field):
    x, w, b = case(*_data(4, 8, 16))
    with pytest.raises(KernelInputError, match=rf"^{field}\b"):
        cpu_gemm.linear(x, w, b)


def test_without_onednn_it_says_so(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not cpu_gemm.available()
    with pytest.raises(KernelInputError, match="oneDNN"):
        cpu_gemm.linear(*_data(4, 8, 16))
