"""The batch-invariant linear (Triton interpreter on CPU, fp32): equals its reference, a row's result does not
depend on how many rows are computed beside it, the K split depends on the weight shape only, and bad inputs
are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from eagleray.kernels import invariant_plans
from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.invariant_linear import fold_norm_weight, invariant_linear, invariant_linear_reference
from eagleray.kernels.invariant_plans import BLOCK_K, plan


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


@pytest.mark.parametrize("splits", [None, 2])
def test_norm_rides_the_products_and_rows_stay_invariant(monkeypatch, splits):
    """A product writes its rows' sums of squares (squares=True); the next one, with the norm's weight folded into its
    weight, computes linear(rmsnorm(h) * nw) from them (norm=...), bitwise alike at any row count, K split or not."""
    import eagleray.kernels.invariant_linear as il

    if splits:
        monkeypatch.setattr(il, "plan", lambda n, k, device=None: invariant_plans.make_plan(n, k, splits=splits, block_k=16))
    g = torch.Generator().manual_seed(3)
    x, w1, res = torch.randn(21, 96, generator=g), torch.randn(96, 96, generator=g), 3 * torch.randn(21, 96, generator=g)
    nw, w2, b2 = torch.rand(96, generator=g) + 0.5, torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
    h, sq = invariant_linear(x, w1, residual=res, squares=True)  # [21, 96], [21, T]
    torch.testing.assert_close(h, invariant_linear_reference(x, w1, residual=res), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sq.sum(1), h.pow(2).sum(1), atol=1e-3, rtol=1e-5)
    y = invariant_linear(h, fold_norm_weight(w2, nw), b2, norm=(sq, 1e-5))
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw  # layers.RMSNorm, fp32
    torch.testing.assert_close(y, normed @ w2.T + b2, atol=1e-4, rtol=1e-4)
    for m in (1, 5):
        hm, sqm = invariant_linear(x[:m], w1, residual=res[:m], squares=True)
        assert torch.equal(hm, h[:m]) and torch.equal(sqm, sq[:m])
        assert torch.equal(invariant_linear(hm, fold_norm_weight(w2, nw), b2, norm=(sqm, 1e-5)), y[:m])
    with pytest.raises(KernelInputError, match="norm"):
        invariant_linear(h, w2, norm=(sq[:5], 1e-5))


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


def test_measured_plans_are_read_by_device_name_and_shape(tmp_path, monkeypatch):
    table = {"GPU X": {"576x1536": {"splits": 1, "block_n": 32, "block_k": 64, "warps": 8, "stages": 4}}}
    (tmp_path / "plans.json").write_text(json.dumps(table))
    monkeypatch.setattr(invariant_plans, "PLANS_FILE", tmp_path / "plans.json")
    invariant_plans.measured_plans.cache_clear()
    try:
        got = invariant_plans.measured_plans("GPU X")[(576, 1536)]
        assert (got.splits, got.k_per_split, got.block_n, got.block_k, got.warps, got.stages) == (1, 1536, 32, 64, 8, 4)
        assert invariant_plans.measured_plans("GPU Y") == {}
        assert plan(576, 1536) == invariant_plans.make_plan(576, 1536)  # no device: the default plan
    finally:
        invariant_plans.measured_plans.cache_clear()


def test_the_shipped_plans_tile_their_shapes():
    """Every plan in kernels/invariant_linear_plans.json covers its weight's K in whole, non-empty splits."""

    table = json.loads(invariant_plans.Path(invariant_plans.__file__).with_name("invariant_linear_plans.json").read_text())
    assert table, "no measured plans shipped"
    for device in table:
        invariant_plans.measured_plans.cache_clear()
        for (_, k), p in invariant_plans.measured_plans(device).items():
            assert p.k_per_split % p.block_k == 0 and p.splits * p.k_per_split >= k > (p.splits - 1) * p.k_per_split
    invariant_plans.measured_plans.cache_clear()
