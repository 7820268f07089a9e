"""A CPU prefill's decoder layers through kernels/cpu_prefill (platform/models/native_layer.prefill_forward): the
model's prefill inside ``cpu_decode.blas_gemms`` equals the PyTorch layers (atol/rtol 1e-4 on hidden states of
magnitude ~1-10, the K/V written too) for prompts from position 0 and a later chunk after cached tokens, and the rule
keeps the PyTorch layer where it does not apply (outside a prefill, no cache, the native kernels off, biases)."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build, cpu_gemm, cpu_prefill
from eagleray.platform.models import native_layer
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.tests.support.cpu_layers import fused_model, row_calls

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None or not cpu_gemm.available(),
    reason=f"native CPU kernels or oneDNN: {cpu_decode_build.unsupported()}",
)
TABLES = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def calls(monkeypatch):
    """Row counts of the prefill layer's calls (the real kernels run)."""
    return row_calls(monkeypatch, cpu_prefill, "decoder_layer")


def _prefill(model, kv, lens, starts, prefill=True, cache=True):
    """Rows lens[b] of sequence b from position starts[b] (its earlier tokens cached) -> final hidden [T, H]."""
    ids = torch.cat([IDS[b, s : s + n] for b, (n, s) in enumerate(zip(lens, starts))])
    pos = torch.cat([s + torch.arange(n) for n, s in zip(lens, starts)])
    meta = AttentionMetadata.build(lens, starts, TABLES[: len(lens)], 4) if cache else AttentionMetadata.build(lens)
    with torch.inference_mode():
        if not prefill:
            return model(ids, pos, meta, kv)[0]
        with cpu_decode.blas_gemms():
            return model(ids, pos, meta, kv if cache else None)[0]


@pytest.mark.parametrize("lens,starts", [([20, 13], [0, 0]), ([7, 18], [0, 4]), ([5], [0])])
def test_a_prefill_equals_the_pytorch_layers(native, calls, monkeypatch, lens, starts):
    """Two prompts; a prompt beside a chunk after 4 cached tokens; 5 rows (products on the native kernel)."""
    model = fused_model()
    kv_new, kv_torch = model.make_kv_cache(12, 4), model.make_kv_cache(12, 4)
    if starts[-1]:  # the earlier chunk cached in both (on the prefill layer)
        for kv in (kv_new, kv_torch):
            _prefill(model, kv, [starts[-1]], [0])
    calls.clear()
    got = _prefill(model, kv_new, lens, starts)
    assert calls == [sum(lens)] * 3, "every layer took the prefill layer"
    monkeypatch.setattr(native_layer, "prefill_forward", lambda *a: None)
    want = _prefill(model, kv_torch, lens, starts)
    assert calls == [sum(lens)] * 3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_new.k, kv_torch.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_new.v, kv_torch.v, atol=1e-4, rtol=1e-4)


def test_the_rule_keeps_the_pytorch_layer_outside_a_prefill_and_without_a_cache(native, calls, monkeypatch):
    model = fused_model()
    _prefill(model, None, [20], [0], cache=False)
    assert calls == [], "no cache: the PyTorch layer"
    kv = model.make_kv_cache(12, 4)
    _prefill(model, kv, [20], [0])
    calls.clear()
    _prefill(model, kv, [4], [20], prefill=False)  # decode-sized rows: the fused decode layer, not this one
    monkeypatch.setattr(cpu_decode, "MAX_ROWS", 2)  # rows past the decode layer's, outside a prefill (a wide verify)
    _prefill(model, kv, [4], [20], prefill=False)
    assert calls == []
    monkeypatch.setattr(native_layer, "PREFILL_LAYER", False)  # the A/B switch
    _prefill(model, model.make_kv_cache(12, 4), [20], [0])
    assert calls == []


def test_the_rule_keeps_the_pytorch_layer_with_native_kernels_off_or_biases(native, calls):
    biased = fused_model(attention_bias=True)
    _prefill(biased, biased.make_kv_cache(12, 4), [20], [0])
    assert calls == [], "biases: the PyTorch layer"
    cpu_decode.configure("torch")
    model = fused_model()
    _prefill(model, model.make_kv_cache(12, 4), [20], [0])
    assert calls == [], "native kernels off"
    with cpu_decode.blas_gemms():
        why = native_layer.prefill_reason(torch.zeros(2, 64), AttentionMetadata.build([2], [0], TABLES[:1], 4), (1, 2))
    assert "native CPU kernels off" in why
