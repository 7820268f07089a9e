"""A prefill's last layer past attention for the rows whose logits are wanted alone (``LlamaModel.forward``'s
``out_rows``): those rows' final hidden states equal the whole forward's (atol/rtol 1e-5), every row's K/V is
written bitwise the same, and the last layer's MLP sees only those rows, on the CPU prefill layer and on the
PyTorch layers; with the final pre-norm state as an aux id every row goes on."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build, cpu_gemm, cpu_prefill
from eagleray.kernels.errors import KernelInputError
from eagleray.platform.models import native_layer
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.tests.support.cpu_layers import fused_model, row_calls

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None or not cpu_gemm.available(),
    reason=f"native CPU kernels or oneDNN: {cpu_decode_build.unsupported()}",
)
TABLES = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
LENS = [20, 13]
LAST = torch.tensor([19, 32])  # each prompt's last row


def _prefill(model, kv, out_rows=None):
    """The two prompts of LENS from position 0 in one prefill -> (final hidden [T or S, H], aux or None)."""
    ids = torch.cat([IDS[b, :n] for b, n in enumerate(LENS)])
    pos = torch.cat([torch.arange(n) for n in LENS])
    meta = AttentionMetadata.build(LENS, [0, 0], TABLES, 4)
    with torch.inference_mode(), cpu_decode.blas_gemms():
        return model(ids, pos, meta, kv, out_rows)


def _mlp_rows(monkeypatch, model, layer: str) -> list[int]:
    """Rows each layer's MLP computes, in order: the prefill layer's SiLU x up calls, or the PyTorch MLP's inputs."""
    if layer == "prefill":
        return row_calls(monkeypatch, cpu_prefill, "silu_mul")
    monkeypatch.setattr(native_layer, "PREFILL_LAYER", False)
    seen: list[int] = []
    for block in model.layers:
        block.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("layer", ["prefill", "torch"])
def test_the_last_rows_alone_equal_the_whole_forward(native, monkeypatch, layer):
    model = fused_model()
    mlp_rows = _mlp_rows(monkeypatch, model, layer)
    kv_all, kv_rows = model.make_kv_cache(12, 4), model.make_kv_cache(12, 4)
    whole, _ = _prefill(model, kv_all)
    assert mlp_rows == [33, 33, 33]
    mlp_rows.clear()
    got, _ = _prefill(model, kv_rows, LAST)
    assert mlp_rows == [33, 33, 2], "the last layer's MLP runs for the wanted rows only"
    assert got.shape == (2, 64)
    torch.testing.assert_close(got, whole[LAST], atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_rows.k, kv_all.k) and torch.equal(kv_rows.v, kv_all.v), "every row's K/V, as before"


def test_the_final_state_as_an_aux_id_keeps_every_row(native, monkeypatch):
    model = fused_model()
    model.set_aux_layers([1, 3])  # 3: the final pre-norm state of this 3-layer model
    mlp_rows = row_calls(monkeypatch, cpu_prefill, "silu_mul")
    whole, aux_all = _prefill(model, model.make_kv_cache(12, 4))
    got, aux = _prefill(model, model.make_kv_cache(12, 4), LAST)
    assert mlp_rows == [33] * 6, "the aux rows need the last layer's every row"
    assert got.shape == (2, 64) and aux.shape == aux_all.shape == (33, 128)
    torch.testing.assert_close(got, whole[LAST], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, aux_all, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [torch.tensor([33]), torch.tensor([-1]), torch.tensor([[0]]), torch.tensor([0.0])])
def test_the_prefill_layer_checks_out_rows(native, rows):
    model = fused_model()
    with pytest.raises(KernelInputError, match="out_rows"):
        _prefill(model, model.make_kv_cache(12, 4), rows)
