"""The paired batch-invariant products (Triton interpreter on CPU, fp32): SiLU * up and rotary + K/V write in the
product's epilogue equal the product followed by the separate op, a row's result does not depend on the rows beside
it (K split or not, normed or not), and bad inputs are refused by name."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import invariant_plans
from eagleray.kernels.decode_ops import KVWrite
from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.invariant_linear import fold_norm_weight, invariant_linear
from eagleray.kernels.invariant_pairs import gated_linear, gated_linear_reference, rope_linear, rope_linear_reference

HQ, HKV, D, K = 4, 2, 16, 48
ALL = slice(None)


@pytest.fixture(params=[(1, 64), (2, 8)], ids=["one-split", "two-splits-narrow-tiles"])
def tiles(request, monkeypatch):
    """The default plan, or K in two splits with 8-column tiles (4-column halves: two tiles a rotary half)."""
    splits, block_n = request.param
    import eagleray.kernels.invariant_pairs as ip

    monkeypatch.setattr(
        ip, "plan", lambda n, k, device=None: invariant_plans.make_plan(n, k, splits=splits, block_n=block_n, block_k=16)
    )
    return request.param


def _normed(g: torch.Generator, rows: int = 21) -> tuple[torch.Tensor, tuple[torch.Tensor, float], torch.Tensor]:
    """(h, (h's sums of squares, eps), the norm weight): h made by a product with squares=True, as in the step."""
    x, w, res = torch.randn(rows, K, generator=g), torch.randn(K, K, generator=g), torch.randn(rows, K, generator=g)
    h, sq = invariant_linear(x, w, residual=res, squares=True)
    return h, (sq, 1e-5), torch.rand(K, generator=g) + 0.5


@pytest.mark.parametrize("normed", [False, True])
def test_gated_equals_the_product_then_silu_mul_and_rows_are_invariant(tiles, normed):
    g = torch.Generator().manual_seed(7)
    h, norm, nw = _normed(g)
    w, b = torch.randn(2 * 40, K, generator=g), torch.randn(2 * 40, generator=g)  # I = 40: a partial last tile
    if normed:
        w = fold_norm_weight(w, nw)
    y = gated_linear(h, w, b, norm=norm if normed else None)  # [21, 40]
    ref = gated_linear_reference(h, w, b, norm_eps=1e-5 if normed else None)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    for rows in (slice(0, 1), slice(0, 5), slice(17, 18)):
        part_norm = (norm[0][rows].contiguous(), norm[1]) if normed else None
        assert torch.equal(gated_linear(h[rows], w, b, norm=part_norm), y[rows])


def _kv(rows: int, g: torch.Generator) -> KVWrite:
    pos = torch.randint(0, 500, (rows,), generator=g)
    slots = torch.randperm(8 * 4, generator=g)[:rows]
    caches = torch.zeros(8, 4, HKV, D), torch.zeros(8, 4, HKV, D)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))  # [D/2]
    return KVWrite(pos, inv_freq, *caches, slots, HQ, HKV)


def _fresh(kv: KVWrite, rows: slice = ALL) -> KVWrite:
    return kv._replace(
        k_cache=torch.zeros_like(kv.k_cache),
        v_cache=torch.zeros_like(kv.v_cache),
        positions=kv.positions[rows],
        slots=kv.slots[rows],
    )


@pytest.mark.parametrize("normed", [False, True])
def test_rope_equals_the_product_then_rotary_and_kv_write_and_rows_are_invariant(tiles, normed):
    g = torch.Generator().manual_seed(11)
    h, norm, nw = _normed(g)
    w, b = torch.randn((HQ + 2 * HKV) * D, K, generator=g), torch.randn((HQ + 2 * HKV) * D, generator=g)
    if normed:
        w = fold_norm_weight(w, nw)
    kv, kv_ref = _fresh(_kv(21, g)), None
    kv_ref = _fresh(kv)
    q = rope_linear(h, w, b, kv, norm=norm if normed else None)  # [21, Hq, D]
    q_ref = rope_linear_reference(h, w, b, kv_ref, norm_eps=1e-5 if normed else None)
    torch.testing.assert_close(q, q_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv.k_cache, kv_ref.k_cache, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv.v_cache, kv_ref.v_cache, atol=1e-4, rtol=1e-4)
    assert kv.v_cache.abs().sum() > 0 and kv.k_cache.abs().sum() > 0
    for rows in (slice(0, 1), slice(0, 5), slice(17, 18)):
        part_kv = _fresh(kv, rows)
        part_norm = (norm[0][rows].contiguous(), norm[1]) if normed else None
        assert torch.equal(rope_linear(h[rows], w, b, part_kv, norm=part_norm), q[rows])
        for got, full in ((part_kv.k_cache, kv.k_cache), (part_kv.v_cache, kv.v_cache)):
            slots = kv.slots[rows]
            assert torch.equal(got.flatten(0, 1)[slots], full.flatten(0, 1)[slots])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda g: gated_linear(torch.randn(3, K), torch.randn(81, K)), "gated_linear: weight"),
        (lambda g: gated_linear(torch.randn(3, K), torch.randn(80, K + 1)), "gated_linear: x, weight"),
        (lambda g: gated_linear(torch.randn(3, K), torch.randn(80, K), norm=(torch.zeros(2, 1), 1e-5)), "gated_linear: norm"),
        (lambda g: rope_linear(torch.randn(3, K), torch.randn((HQ + HKV) * D, K), None, _kv(3, g)), "rope_linear: weight"),
        (lambda g: rope_linear(torch.randn(3, K), torch.randn((HQ + 2 * HKV) * D, K), None, _kv(4, g)), "rope_linear: kv"),
    ],
)
def test_bad_inputs_are_refused_by_name(call, match):
    with pytest.raises(KernelInputError, match=match):
        call(torch.Generator().manual_seed(0))


def test_a_plan_whose_tiles_do_not_halve_into_powers_of_two_is_refused(monkeypatch):
    import eagleray.kernels.invariant_pairs as ip

    monkeypatch.setattr(ip, "plan", lambda n, k, device=None: invariant_plans.make_plan(n, k, block_n=6, block_k=16))
    with pytest.raises(KernelInputError, match="gated_linear: plan"):
        gated_linear(torch.randn(3, K), torch.randn(80, K))
