"""The decode step's fused element-wise Triton kernels (interpreter on CPU) equal their PyTorch references,
and their wrappers refuse inputs the kernels' pointer arithmetic cannot take."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import decode_ops
from eagleray.kernels.decode_ops import (
    KVWrite,
    add_rmsnorm,
    add_rmsnorm_reference,
    rope_write_kv,
    rope_write_kv_reference,
    silu_mul,
    silu_mul_reference,
)
from eagleray.kernels.errors import KernelInputError

HQ, HKV, D = 4, 2, 16


def _inv_freq(d: int = D) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))  # [D/2]


def test_kernels_match_references():
    g = torch.Generator().manual_seed(1)
    h, delta, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    for d_ in (None, delta):
        for got, ref in zip(add_rmsnorm(h, d_, w, 1e-5), add_rmsnorm_reference(h, d_, w, 1e-5)):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 48, generator=g)
    torch.testing.assert_close(silu_mul(gu), silu_mul_reference(gu), atol=1e-6, rtol=1e-6)
    qkv = torch.randn(3, (HQ + 2 * HKV) * D, generator=g)
    pos, slots = torch.tensor([0, 7, 30]), torch.tensor([5, 0, 11])
    caches = [torch.zeros(4, 4, HKV, D) for _ in range(4)]
    q_ref = rope_write_kv_reference(qkv, KVWrite(pos, _inv_freq(), caches[0], caches[1], slots, HQ, HKV))
    q_got = rope_write_kv(qkv, KVWrite(pos, _inv_freq(), caches[2], caches[3], slots, HQ, HKV))
    torch.testing.assert_close(q_got, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[2], caches[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[3], caches[1])


def _kv_write() -> KVWrite:
    return KVWrite(torch.zeros(3), _inv_freq(), torch.zeros(4, 4, HKV, D), torch.zeros(4, 4, HKV, D), torch.zeros(3), HQ, HKV)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: add_rmsnorm(torch.randn(40, 3).T, None, torch.randn(40), 1e-5), "add_rmsnorm: h"),
        (lambda: add_rmsnorm(torch.randn(3, 40), torch.randn(40, 3).T, torch.randn(40), 1e-5), "add_rmsnorm: delta"),
        (lambda: add_rmsnorm(torch.randn(40), None, torch.randn(40), 1e-5), "add_rmsnorm: h"),
        (lambda: silu_mul(torch.randn(96, 3).T), "silu_mul: gate_up"),
        (lambda: rope_write_kv(torch.randn(3, (HQ + HKV) * D), _kv_write()), "rope_write_kv: qkv"),
        (lambda: rope_write_kv(torch.randn((HQ + 2 * HKV) * D, 3).T, _kv_write()), "rope_write_kv: qkv"),
    ],
)
def test_bad_inputs_are_refused_by_name(call, match):
    with pytest.raises(KernelInputError, match=match):
        call()


@pytest.mark.parametrize("op", ["add_rmsnorm", "silu_mul", "rope_write_kv"])
def test_without_triton_the_wrappers_name_the_reference(monkeypatch, op):
    monkeypatch.setattr(decode_ops, "triton", None)
    args = {
        "add_rmsnorm": (torch.randn(3, 40), None, torch.randn(40), 1e-5),
        "silu_mul": (torch.randn(3, 96),),
        "rope_write_kv": (torch.randn(3, (HQ + 2 * HKV) * D), _kv_write()),
    }[op]
    with pytest.raises(KernelInputError, match=f"use {op}_reference"):
        getattr(decode_ops, op)(*args)
