"""A prefill's decoder layer on a CPU (kernels/cpu_prefill: oneDNN's GEMMs, the native row phases between them)
against the PyTorch reference layer: values (atol/rtol 1e-4 on outputs of magnitude ~1-10; the K/V it writes to
1e-5) for a prompt from position 0 beside a chunk after cached tokens, on both product paths (oneDNN past
``PREFILL_NATIVE_ROWS`` rows, the native kernel at or below); each phase against its reference; the checked wrapper;
and the helper threads' spin that a prefill shortens and gives back."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build, cpu_gemm, cpu_layer, cpu_prefill
from eagleray.kernels.errors import KernelInputError
from eagleray.tests.support.cpu_layers import layer_params

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None or not cpu_gemm.available(),
    reason=f"native CPU kernels or oneDNN: {cpu_decode_build.unsupported()}",
)

H, HQ, HKV, D, INTER, BS = 70, 6, 2, 32, 100, 4  # H and INTER with tails past 16 lanes
TABLES = torch.tensor([[7, 2, 9, 0, 5, 13], [1, 11, 3, 12, -1, -1]], dtype=torch.int32)  # non-contiguous blocks


def _params(seed: int = 0) -> cpu_layer.LayerParams:
    return layer_params(H, HQ, HKV, D, INTER, BS, 14, seed)


def _inputs(prompt: int, cached: int, chunk: int) -> cpu_layer.StepInputs:
    """Sequence 0: ``prompt`` rows from position 0; sequence 1: ``chunk`` rows after ``cached`` tokens (a chunked
    prefill's later chunk: its cached keys are the cache's values). Each row causal: keys 0..its position."""
    seq = [0] * prompt + [1] * chunk
    idx = list(range(prompt)) + list(range(cached, cached + chunk))
    table = TABLES.long()
    slots = torch.tensor([int(table[s, i // BS]) * BS + i % BS for s, i in zip(seq, idx)])  # [T]
    freqs = torch.tensor(idx, dtype=torch.float32)[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None]  # [T, D/2]
    emb = torch.cat([freqs, freqs], -1)  # [T, D]
    ctx = torch.tensor([i + 1 for i in idx])  # keys 0..i, all in the cache once written
    keys = cpu_decode.RowKeys(torch.tensor(seq), ctx, torch.zeros_like(ctx), torch.zeros_like(ctx))
    return cpu_layer.StepInputs(emb.cos(), emb.sin(), slots, TABLES, keys, BS)


def _products(p: cpu_layer.LayerParams) -> cpu_prefill.Products:
    return cpu_prefill.Products(p.qkv, p.o, p.gate_up, p.down)


def _run(p: cpu_layer.LayerParams, inputs: cpu_layer.StepInputs, h: torch.Tensor, causal: bool = True) -> torch.Tensor:
    step = cpu_layer.step(inputs, p.shape(), scratch=False)
    blocks = cpu_prefill.causal_blocks(inputs.keys, HQ // HKV) if causal else None
    with cpu_decode.blas_gemms():
        return cpu_prefill.decoder_layer(h, step, cpu_layer.layer_weights(p), _products(p), blocks)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("prompt,cached,chunk", [(17, 5, 6), (6, 3, 4), (22, 0, 0)])
def test_matches_the_reference_and_writes_the_same_kv(prompt, cached, chunk, causal):
    """(17, 5, 6): 23 rows, oneDNN's products; (6, 3, 4): 10 rows, the native kernel's; (22, 0, 0): one prompt. The
    attention by causal blocks (cpu_prefill.c) and row by row (the decode kernel)."""
    p, ref = _params(), _params()
    inputs = _inputs(prompt, cached, chunk)
    h = 3 * torch.randn(prompt + chunk, H, generator=torch.Generator().manual_seed(1))  # [T, H]
    out = _run(p, inputs, h, causal)
    want = cpu_layer.decoder_layer_reference(h, inputs, ref)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(p.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.v_cache, ref.v_cache, atol=1e-5, rtol=1e-5)
    assert not torch.equal(p.k_cache, _params().k_cache), "the rows' K must be written"
    assert (out - h).abs().max() > 0.1, "the layer changes h"


def test_each_phase_matches_its_reference():
    g = torch.Generator().manual_seed(2)
    x, w = 3 * torch.randn(19, H, generator=g), 1 + 0.1 * torch.randn(H, generator=g)
    torch.testing.assert_close(cpu_prefill.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (H,), w, 1e-5))
    gu = 4 * torch.randn(19, 2 * INTER, generator=g)
    torch.testing.assert_close(cpu_prefill.silu_mul(gu, INTER), cpu_prefill.silu_mul_reference(gu, INTER))
    a, wo, r = torch.randn(19, HQ * D, generator=g), 0.2 * torch.randn(H, HQ * D, generator=g), torch.randn(19, H, generator=g)
    r_before = r.clone()
    torch.testing.assert_close(cpu_gemm.linear_add(a, wo, r), cpu_gemm.linear_add_reference(a, wo, r), atol=1e-4, rtol=1e-4)
    assert torch.equal(r, r_before), "the residual is read, not written"


def test_the_wrapper_refuses_what_the_kernel_does_not_take():
    p = _params()
    inputs = _inputs(17, 5, 6)
    step, weights = cpu_layer.step(inputs, p.shape(), scratch=False), cpu_layer.layer_weights(p)
    h = torch.randn(23, H)
    with pytest.raises(KernelInputError, match="h"):
        cpu_prefill.decoder_layer(h[:, :-1].contiguous(), step, weights, _products(p))
    with pytest.raises(KernelInputError, match="products.down"):
        cpu_prefill.decoder_layer(h, step, weights, cpu_prefill.Products(p.qkv, p.o, p.gate_up, p.down.t().contiguous()))
    with pytest.raises(KernelInputError, match="qkv"):
        cpu_prefill.rope_attention(torch.randn(23, 5), step, weights)
    with pytest.raises(KernelInputError, match="x"):
        cpu_prefill.rms_norm(h.t(), torch.ones(23), 1e-5)  # not contiguous
    with pytest.raises(KernelInputError, match="gu"):
        cpu_prefill.silu_mul(torch.randn(23, 2 * INTER + 1), INTER)
    with pytest.raises(KernelInputError, match="residual"):
        cpu_gemm.linear_add(torch.randn(23, HQ * D), p.o, torch.randn(23, H + 1))
    with pytest.raises(KernelInputError, match="step"):  # the fused decode layer needs a step's scratch rows
        cpu_layer.decoder_layer(h, step, weights)


def test_a_prefill_shortens_the_helpers_spin_and_gives_it_back():
    lib = cpu_decode.library()
    before = lib.set_helper_spin(12345)
    try:
        with cpu_decode.blas_gemms():
            with cpu_decode.blas_gemms():  # nested: the outer one restores
                pass
            inside = lib.set_helper_spin(777)
            lib.set_helper_spin(inside)
        after = lib.set_helper_spin(12345)
    finally:
        lib.set_helper_spin(before)
    assert inside == cpu_decode.PREFILL_HELPER_SPIN and after == 12345


def _attention(inputs: cpu_layer.StepInputs, qkv: torch.Tensor, causal: bool) -> torch.Tensor:
    p = _params()
    step = cpu_layer.step(inputs, p.shape(), scratch=False)
    blocks = cpu_prefill.causal_blocks(inputs.keys, HQ // HKV) if causal else None
    return cpu_prefill.rope_attention(qkv.clone(), step, cpu_layer.layer_weights(p), blocks)


def test_causal_blocks_equal_the_row_kernel_and_a_row_does_not_depend_on_its_neighbours():
    """Each row's attention by blocks equals the row kernel's (1e-5), and is bitwise the same whatever else is in the
    step: a prompt prefilled alone or beside another sequence's chunk (other blocks, other keys)."""
    nqkv = (HQ + 2 * HKV) * D
    qkv = torch.randn(23, nqkv, generator=torch.Generator().manual_seed(3))  # rows of _inputs(17, 5, 6)
    both = _attention(_inputs(17, 5, 6), qkv, causal=True)
    torch.testing.assert_close(both, _attention(_inputs(17, 5, 6), qkv, causal=False), atol=1e-5, rtol=1e-5)
    alone = _attention(_inputs(17, 0, 0), qkv[:17].contiguous(), causal=True)
    assert torch.equal(alone, both[:17]), "the prompt's rows alone and beside the chunk"
    blocks = cpu_prefill.causal_blocks(_inputs(17, 5, 6).keys, HQ // HKV)
    assert blocks.spans.tolist() == [[0, 5], [5, 5], [10, 5], [15, 2], [17, 5], [22, 1]]  # 16 // G = 5 rows a block


def test_causal_blocks_refuse_tree_rows_and_blocks_of_other_rows():
    inputs = _inputs(17, 5, 6)
    tree = cpu_decode.RowKeys(inputs.keys.seq, inputs.keys.ctx, torch.ones_like(inputs.keys.ctx), inputs.keys.mask)
    assert cpu_prefill.causal_blocks(tree, HQ // HKV) is None, "draft-tree rows take the row kernel"
    assert cpu_prefill.causal_blocks(inputs.keys, 17) is None, "more query heads a kv head than lanes"
    p = _params()
    step = cpu_layer.step(inputs, p.shape(), scratch=False)
    qkv = torch.randn(23, (HQ + 2 * HKV) * D)
    other = _inputs(17, 5, 6)  # the same rows, other tensors: blocks are for the keys they were cut from
    with pytest.raises(KernelInputError, match="blocks"):
        cpu_prefill.rope_attention(qkv, step, cpu_layer.layer_weights(p), cpu_prefill.causal_blocks(other.keys, HQ // HKV))
    with pytest.raises(KernelInputError, match="blocks"):
        cpu_prefill.rope_attention(qkv, step, cpu_layer.layer_weights(p), cpu_prefill.causal_blocks(inputs.keys, 2))
