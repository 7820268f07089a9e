"""The pair epilogues of the batch-invariant linear (Triton interpreter on CPU): SiLU*up and rotary + KV write
fused into the product equal the product followed by the separate op, with and without a K split, and a row's
result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

import eagleray.kernels.invariant_linear as il
from eagleray.kernels.decode_ops import KVWrite, rope_write_kv_reference, silu_mul_reference
from eagleray.kernels.errors import KernelInputError
from eagleray.kernels.invariant_linear import invariant_linear_glu, invariant_linear_reference, invariant_linear_rope

HQ, HKV, D, K = 3, 1, 16, 96


@pytest.fixture(params=[1, 3], ids=["one-split", "k-split"])
def splits(request, monkeypatch):
    """Force the plan's K split: 1 (the epilogue in the product kernel) or 3 (in the reduction kernel)."""
    monkeypatch.setattr(il, "plan", lambda n, k, device=None: il.make_plan(n, k, splits=request.param, block_n=16, block_k=32))
    return request.param


def _inv_freq() -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))  # [D/2]


def _kv(pos, slots, caches) -> KVWrite:
    return KVWrite(pos, _inv_freq(), caches[0], caches[1], slots, HQ, HKV)


@pytest.mark.parametrize("bias", [False, True])
def test_glu_equals_the_product_then_silu_mul(splits, bias):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2 * 40, K, generator=g)  # I = 40: the last tile is partly masked
    b = torch.randn(2 * 40, generator=g) if bias else None
    x = torch.randn(7, K, generator=g)
    got = invariant_linear_glu(x, w, b)  # [7, 40]
    torch.testing.assert_close(got, silu_mul_reference(invariant_linear_reference(x, w, b)), atol=1e-4, rtol=1e-4)
    assert torch.equal(invariant_linear_glu(x[2:3], w, b), got[2:3])  # a row alone: the same bits


def test_rope_equals_the_product_then_rope_write_kv(splits):
    g = torch.Generator().manual_seed(4)
    w = torch.randn((HQ + 2 * HKV) * D, K, generator=g)
    b = torch.randn(w.shape[0], generator=g)
    x = torch.randn(5, K, generator=g)
    pos, slots = torch.tensor([0, 7, 30, 2, 11]), torch.tensor([5, 0, 11, 3, 9])
    caches = [torch.zeros(4, 4, HKV, D) for _ in range(4)]
    q_ref = rope_write_kv_reference(invariant_linear_reference(x, w, b), _kv(pos, slots, caches[:2]))
    q = invariant_linear_rope(x, w, b, _kv(pos, slots, caches[2:]))  # [5, Hq, D]
    torch.testing.assert_close(q, q_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[2], caches[0], atol=1e-4, rtol=1e-4)  # k, rotated
    torch.testing.assert_close(caches[3], caches[1], atol=1e-4, rtol=1e-4)  # v
    assert caches[2].abs().sum() > 0 and caches[3].abs().sum() > 0
    alone = [torch.zeros(4, 4, HKV, D) for _ in range(2)]
    q1 = invariant_linear_rope(x[3:4], w, b, _kv(pos[3:4], slots[3:4], alone))
    assert torch.equal(q1, q[3:4])
    k_flat, got_k = alone[0].view(16, HKV, D), caches[2].view(16, HKV, D)
    assert torch.equal(k_flat[3], got_k[3]) and k_flat[[0, 5, 9, 11]].abs().sum() == 0  # only its own slot


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: invariant_linear_glu(torch.randn(2, 8), torch.randn(5, 8)), "invariant_linear_glu: weight"),
        (
            lambda: invariant_linear_rope(
                torch.randn(2, 8),
                torch.randn(3 * D, 8),
                None,
                _kv(torch.zeros(2), torch.zeros(2), [torch.zeros(4, 4, HKV, D)] * 2),
            ),
            "invariant_linear_rope: weight",
        ),
        (lambda: invariant_linear_glu(torch.randn(2, 8), torch.randn(4, 9)), "the same K"),
    ],
)
def test_bad_inputs_are_refused_by_name(call, match):
    with pytest.raises(KernelInputError, match=match):
        call()
