"""Batch-1 Triton GEMVs with folded element-wise ops (interpreter on CPU) equal their unfused references."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import decode_gemv
from eagleray.kernels.decode_gemv import gemv, gemv_reference, qkv_rope_gemv, qkv_rope_gemv_reference
from eagleray.kernels.decode_ops import KVWrite, add_rmsnorm_reference, silu_mul_reference
from eagleray.kernels.errors import KernelInputError


def test_gemv_modes_match_references():
    g = torch.Generator().manual_seed(0)
    k, n = 96, 40  # K not a multiple of the tile: masked path
    x, w, b = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    res, nw = torch.randn(1, n, generator=g), torch.randn(k, generator=g)
    xn, _ = add_rmsnorm_reference(x, None, nw, 1e-5)  # [1, K]
    gu = torch.randn(1, 2 * k, generator=g)
    cases = [
        ({}, x, x @ w.T),
        (dict(bias=b, residual=res), x, res + (x @ w.T + b)),
        (dict(mode="norm", norm_weight=nw, eps=1e-5), x, xn @ w.T),
        (dict(mode="silu"), gu, silu_mul_reference(gu) @ w.T),
    ]
    for kwargs, xin, want in cases:
        ref = gemv_reference(xin, w, **kwargs)
        torch.testing.assert_close(ref, want, atol=1e-4, rtol=1e-5)  # the reference is the unfused step
        torch.testing.assert_close(gemv(xin, w, **kwargs), ref, atol=1e-4, rtol=1e-5)


def _qkv_case(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, k = 4, 2, 16, 64
    h, nw = torch.randn(1, k, generator=g), torch.randn(k, generator=g)
    w = torch.randn((hq + 2 * hkv) * d, k, generator=g)
    pos, slots = torch.tensor([9]), torch.tensor([6])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    caches = [torch.randn(4, 4, hkv, d, generator=g) for _ in range(2)]
    return h, nw, w, pos, inv, caches, slots, hq, hkv


def test_qkv_rope_gemv_matches_reference():
    h, nw, w, pos, inv, caches, slots, hq, hkv = _qkv_case()
    got_caches = [c.clone() for c in caches]
    q_ref = qkv_rope_gemv_reference(h, nw, 1e-5, w, None, KVWrite(pos, inv, caches[0], caches[1], slots, hq, hkv))
    q_got = qkv_rope_gemv(h, nw, 1e-5, w, None, KVWrite(pos, inv, got_caches[0], got_caches[1], slots, hq, hkv))
    torch.testing.assert_close(q_got, q_ref, atol=1e-4, rtol=1e-5)
    for got, ref in zip(got_caches, caches):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


def test_bad_inputs_are_refused_by_name():
    w = torch.randn(40, 96)
    with pytest.raises(KernelInputError, match="gemv: x, weight"):
        gemv(torch.randn(2, 96), w)  # batch 2
    with pytest.raises(KernelInputError, match="gemv: x, weight"):
        gemv(torch.randn(1, 64), w)  # K differs
    with pytest.raises(KernelInputError, match="gemv: x, weight"):
        gemv(torch.randn(1, 96), torch.randn(96, 40).T)  # weight rows not contiguous
    h, nw, w, pos, inv, caches, slots, hq, hkv = _qkv_case()
    with pytest.raises(KernelInputError, match="qkv_rope_gemv: weight"):
        qkv_rope_gemv(h, nw, 1e-5, w[:-16], None, KVWrite(pos, inv, caches[0], caches[1], slots, hq, hkv))  # one head short


def test_without_triton_the_wrappers_name_the_reference(monkeypatch):
    monkeypatch.setattr(decode_gemv, "triton", None)
    with pytest.raises(KernelInputError, match="use gemv_reference"):
        gemv(torch.randn(1, 96), torch.randn(40, 96))
