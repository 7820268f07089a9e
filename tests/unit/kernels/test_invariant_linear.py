"""The batch-invariant linear (Triton interpreter on CPU, fp32): equals its reference, a row's result does not
depend on how many rows are computed beside it, the K split depends on the weight shape only, and bad inputs
are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.invariant_linear import BLOCK_K, invariant_linear, invariant_linear_reference, plan


@pytest.mark.parametrize("n,k,bias,residual", [(96, 200, True, True), (70, 384, False, False), (130, 64, True, False)])
def test_equals_reference_and_rows_are_invariant(n, k, bias, residual):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(21, k, generator=g)
    r = torch.randn(21, n, generator=g) if residual else None
    y = invariant_linear(x, w, b, residual=r)
    torch.testing.assert_close(y, invariant_linear_reference(x, w, b, r), atol=1e-4, rtol=1e-4)
    for m in (1, 5):
        part = invariant_linear(x[:m], w, b, residual=None if r is None else r[:m])
        assert torch.equal(part, y[:m])
    one = invariant_linear(x[17:18], w, b, residual=None if r is None else r[17:18])
    assert torch.equal(one, y[17:18])


def test_split_depends_on_the_weight_shape_only():
    p = plan(576, 1536)
    assert p.splits > 1 and p.k_per_split % BLOCK_K == 0 and p.splits * p.k_per_split >= 1536
    assert (p.splits - 1) * p.k_per_split < 1536  # no empty split
    assert plan(128256, 4096).splits == 1  # wide weights: enough tiles already, epilogue fused


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(x=torch.randn(3, 8), w=torch.randn(4, 9)), "the same K"),
        (dict(x=torch.randn(8, 3).T, w=torch.randn(4, 8)), "contiguous"),
        (dict(x=torch.randn(3, 8, dtype=torch.float64), w=torch.randn(4, 8)), "dtype and device"),
        (dict(x=torch.randn(3, 8), w=torch.randn(4, 8), bias=torch.randn(5)), "bias"),
        (dict(x=torch.randn(3, 8), w=torch.randn(4, 8), residual=torch.randn(3, 5)), "residual"),
    ],
)
def test_bad_inputs_are_refused_by_name(bad, match):
    with pytest.raises(KernelInputError, match=match):
        invariant_linear(bad["x"], bad["w"], bad.get("bias"), residual=bad.get("residual"))


@pytest.mark.parametrize(
    "mode,n,k,residual", [("silu", 96, 200, True), ("silu", 70, 384, False), ("norm", 96, 120, True), ("norm", 300, 64, False)]
)
def test_prologue_modes_equal_the_unfused_ops_and_rows_are_invariant(mode, n, k, residual):
    """norm: rmsnorm(x) @ W.T; silu: silu(gate) * up @ W.T - one launch, the same rows at any M."""
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(21, 2 * k if mode == "silu" else k, generator=g)
    nw = torch.randn(k, generator=g) if mode == "norm" else None
    r = torch.randn(21, n, generator=g) if residual else None
    kw = dict(mode=mode, norm_weight=nw, eps=1e-5)
    y = invariant_linear(x, w, residual=r, **kw)
    torch.testing.assert_close(y, invariant_linear_reference(x, w, None, r, **kw), atol=1e-3, rtol=1e-3)
    for m in (1, 5):
        assert torch.equal(invariant_linear(x[:m], w, residual=None if r is None else r[:m], **kw), y[:m])


def test_the_prologues_compute_the_element_wise_kernels_formulas():
    """The folded left operand is bitwise what the decode step's own element-wise kernels compute (fp32 here: the
    interpreter's bf16 products are not exact; tests/gpu checks bf16)."""
    from eagleray.kernels.decode_ops import add_rmsnorm, silu_mul

    g = torch.Generator().manual_seed(3)
    gu = torch.randn(16, 256, generator=g) * 3
    eye = torch.eye(128)  # the product returns its left operand exactly
    assert torch.equal(invariant_linear(gu, eye, mode="silu"), silu_mul(gu))
    nw = torch.randn(128, generator=g)
    normed, _ = add_rmsnorm(gu[:, :128].contiguous(), None, nw, 1e-5)
    torch.testing.assert_close(invariant_linear(gu[:, :128].contiguous(), eye, mode="norm", norm_weight=nw, eps=1e-5), normed)


def test_measured_plans_are_read_by_device_name_and_shape(tmp_path, monkeypatch):
    import eagleray.kernels.invariant_linear as il

    table = {"GPU X": {"576x1536": {"splits": 1, "block_n": 32, "block_k": 64, "warps": 8, "stages": 4}}}
    (tmp_path / "plans.json").write_text(json.dumps(table))
    monkeypatch.setattr(il, "PLANS_FILE", tmp_path / "plans.json")
    il.measured_plans.cache_clear()
    try:
        got = il.measured_plans("GPU X")[(576, 1536)]
        assert (got.splits, got.k_per_split, got.block_n, got.block_k, got.warps, got.stages) == (1, 1536, 32, 64, 8, 4)
        assert il.measured_plans("GPU Y") == {}
        assert plan(576, 1536) == il.make_plan(576, 1536)  # no device: the default plan
    finally:
        il.measured_plans.cache_clear()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(mode="gelu"), "mode"),
        (dict(mode="norm"), "norm_weight"),
        (dict(norm_weight=torch.randn(8)), "norm_weight"),
        (dict(mode="norm", norm_weight=torch.randn(9)), "norm_weight"),
        (dict(mode="silu"), "the same K"),
        (dict(mode="norm", norm_weight=torch.randn(200), k=200), "does not split K"),
    ],
)
def test_bad_prologues_are_refused_by_name(kw, match):
    k = kw.pop("k", 8)  # K = 200 is split in two ranges: a norm needs all of K in one
    with pytest.raises(KernelInputError, match=match):
        invariant_linear(torch.randn(3, k), torch.randn(4, k), **kw)
