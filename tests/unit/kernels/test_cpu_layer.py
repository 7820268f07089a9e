"""The native decoder layer (kernels/cpu_layer.c) against its PyTorch reference: values (atol 1e-4, rtol 1e-4 on
outputs of magnitude ~1-10; the K/V it writes to 1e-5), each row bitwise the same alone, in any batch and on any
thread count (what keeps greedy speculation lossless), and the checked wrapper; the same for the EAGLE-3 draft's
layer (token embeddings and fc-combined hidden in, q/k/v over 2H features, either residual)."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build, cpu_layer, cpu_panels
from eagleray.kernels.errors import KernelInputError
from eagleray.tests.support.cpu_layers import layer_params

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)

H, HQ, HKV, D, INTER, BS = 70, 6, 2, 32, 100, 4  # H and INTER with tails past 16 lanes and 48-column panels
TABLES = torch.tensor([[7, 2, 9, 0, 5], [1, 11, 3, -1, -1]], dtype=torch.int32)  # non-contiguous blocks
# rows: sequence 0 verifies 3 causal rows after 5 cached tokens, sequence 1 a 3-node tree after 2
CAUSAL = [(0, 5 + i) for i in range(3)]  # (sequence, cache index)
TREE = [(1, 2 + i, vis) for i, vis in enumerate([(0,), (0, 1), (0, 2)])]


@pytest.fixture
def threads():
    before = cpu_decode.threads()
    yield cpu_decode.set_threads
    cpu_decode.set_threads(before)


def _params(seed: int = 0) -> cpu_layer.LayerParams:
    return layer_params(H, HQ, HKV, D, INTER, BS, 12, seed)


def _draft_params(norm_residual: bool = False, seed: int = 4) -> cpu_layer.LayerParams:
    """A draft layer's: q/k/v read 2H features, a hidden norm (its own eps, so a swapped eps shows)."""
    g = torch.Generator().manual_seed(seed)
    p = _params(seed)
    qkv = 0.3 * torch.randn(p.qkv.shape[0], 2 * H, generator=g)  # [(Hq + 2 Hkv) D, 2H]
    return cpu_layer.LayerParams(**{**p.__dict__, "qkv": qkv, "hidden_norm": 1 + 0.3 * torch.randn(H, generator=g),
                                    "hidden_eps": 1e-2, "norm_residual": norm_residual})  # fmt: skip


def _inputs(rows: list[int]) -> cpu_layer.StepInputs:
    """Step inputs of the chosen rows (indices into CAUSAL + TREE)."""
    seq, ctx, nnew, mask, idx = [], [], [], [], []
    for r in rows:
        if r < len(CAUSAL):
            s, i = CAUSAL[r]
            seq.append(s), ctx.append(i + 1), nnew.append(0), mask.append(0), idx.append(i)  # keys 0..i, all cached
        else:
            s, i, vis = TREE[r - len(CAUSAL)]
            seq.append(s), ctx.append(2), nnew.append(3), mask.append(sum(1 << j for j in vis)), idx.append(i)
    table = TABLES.long()
    slots = torch.tensor([int(table[s, i // BS]) * BS + i % BS for s, i in zip(seq, idx)])  # [T]
    pos = torch.tensor(idx, dtype=torch.float32) + 3.0  # [T] positions (any: rotary only)
    freqs = pos[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None]  # [T, D/2]
    emb = torch.cat([freqs, freqs], -1)  # [T, D]
    keys = cpu_decode.RowKeys(*(torch.tensor(v, dtype=torch.int64) for v in (seq, ctx, nnew, mask)))
    return cpu_layer.StepInputs(emb.cos(), emb.sin(), slots, TABLES, keys, BS)


def _run(params, rows, h, embeds=None):
    inputs = _inputs(rows)
    return cpu_layer.decoder_layer(h, cpu_layer.step(inputs, params.shape()), cpu_layer.layer_weights(params), embeds)


ALL = list(range(len(CAUSAL) + len(TREE)))


def test_matches_the_reference_and_writes_the_same_kv():
    p, ref = _params(), _params()
    h = 3 * torch.randn(len(ALL), H, generator=torch.Generator().manual_seed(1))  # [T, H]
    out = _run(p, ALL, h)
    want = cpu_layer.decoder_layer_reference(h, _inputs(ALL), ref)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(p.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.v_cache, ref.v_cache, atol=1e-5, rtol=1e-5)
    assert not torch.equal(p.k_cache, _params().k_cache), "the rows' K must be written"
    assert (out - h).abs().max() > 0.1, "the layer changes h"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_row_is_bitwise_the_same_alone_in_any_batch_and_thread_count(n, threads):
    """A row sees only cached keys and its own: run the whole batch first (its K/V in the cache), then rows alone and
    in other batches (each writes its K/V again, bitwise the same) on n threads."""
    h = 3 * torch.randn(len(ALL), H, generator=torch.Generator().manual_seed(2))
    threads(1)
    p = _params()
    full = _run(p, ALL, h)  # [T, H]
    k_after = p.k_cache.clone()
    threads(n)
    for r in ALL:
        assert torch.equal(_run(p, [r], h[r : r + 1].contiguous())[0], full[r]), f"row {r} alone, {n} threads"
    for rows in ([5, 0, 3], [1, 2], ALL[::-1]):
        got = _run(p, rows, h[rows].contiguous())
        assert torch.equal(got, full[rows]), f"rows {rows} together, {n} threads"
    assert torch.equal(p.k_cache, k_after), "rewriting a row's K/V gives the same bits"


def _draft_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token embeddings [T, H] (magnitude ~0.1, as an embedding table's) and fc-combined hidden [T, H] (~3)."""
    g = torch.Generator().manual_seed(seed)
    return 0.1 * torch.randn(len(ALL), H, generator=g), 3 * torch.randn(len(ALL), H, generator=g)


@pytest.mark.parametrize("norm_residual", [False, True])
def test_the_draft_layer_matches_its_reference_and_writes_the_same_kv(norm_residual):
    p, ref = _draft_params(norm_residual), _draft_params(norm_residual)
    e, h = _draft_rows(5)
    out = _run(p, ALL, h, e)
    want = cpu_layer.draft_layer_reference(e, h, _inputs(ALL), ref)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(p.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p.v_cache, ref.v_cache, atol=1e-5, rtol=1e-5)
    other = cpu_layer.draft_layer_reference(e, h, _inputs(ALL), _draft_params(not norm_residual))
    assert (out - other).abs().max() > 0.1, "the two residuals differ, and the test tells them apart"


def test_a_draft_layer_of_bf16_weights_is_its_fp32_packed_layer_bit_for_bit(monkeypatch):
    """A draft saved in bf16: its four products packed in bf16 (bit i of the weights' ``bf16``) give the output and
    K/V of the same weights in fp32 panels, bit for bit."""

    def bf16_params() -> cpu_layer.LayerParams:
        p = _draft_params(seed=6)
        return cpu_layer.LayerParams(**{**p.__dict__, **{n: getattr(p, n).bfloat16().float() for n in PRODUCTS}})

    e, h = _draft_rows(7)
    step = cpu_layer.step(_inputs(ALL), _draft_params().shape())
    p16 = bf16_params()
    w16 = cpu_layer.layer_weights(p16)
    assert w16.struct.bf16 == 0b1111
    out16 = cpu_layer.decoder_layer(h, step, w16, e)
    monkeypatch.setattr(cpu_panels, "bf16_values", lambda w: None)
    p32 = bf16_params()
    w32 = cpu_layer.layer_weights(p32)
    assert w32.struct.bf16 == 0
    out32 = cpu_layer.decoder_layer(h, step, w32, e)
    assert torch.equal(out16, out32) and torch.equal(p16.k_cache, p32.k_cache) and torch.equal(p16.v_cache, p32.v_cache)


PRODUCTS = ("qkv", "o", "gate_up", "down")


@pytest.mark.parametrize("n", [1, 2])
def test_each_draft_row_is_bitwise_the_same_alone_in_any_batch_and_thread_count(n, threads):
    e, h = _draft_rows(6)
    threads(1)
    p = _draft_params()
    full = _run(p, ALL, h, e)  # [T, H]
    threads(n)
    for r in ALL:
        assert torch.equal(_run(p, [r], h[r : r + 1].contiguous(), e[r : r + 1].contiguous())[0], full[r]), f"row {r}"
    for rows in ([5, 0, 3], ALL[::-1]):
        assert torch.equal(_run(p, rows, h[rows].contiguous(), e[rows].contiguous()), full[rows]), f"rows {rows}"


def test_the_wrapper_gives_embeds_exactly_to_a_draft_layer():
    p, d = _params(), _draft_params()
    llama_step, draft_step = cpu_layer.step(_inputs(ALL), p.shape()), cpu_layer.step(_inputs(ALL), d.shape())
    e, h = _draft_rows(7)
    with pytest.raises(KernelInputError, match="embeds"):
        cpu_layer.decoder_layer(h, draft_step, cpu_layer.layer_weights(d))  # a draft layer without its embeddings
    with pytest.raises(KernelInputError, match="embeds"):
        cpu_layer.decoder_layer(h, llama_step, cpu_layer.layer_weights(p), e)  # embeddings to a Llama layer
    with pytest.raises(KernelInputError, match="embeds"):
        cpu_layer.decoder_layer(h, draft_step, cpu_layer.layer_weights(d), e[:-1])
    with pytest.raises(KernelInputError, match="weights"):  # a Llama step (scratch of H features) for a draft layer
        cpu_layer.decoder_layer(h, llama_step, cpu_layer.layer_weights(d), e)
    with pytest.raises(KernelInputError, match="params.qkv"):  # a Llama q/k/v (H features) with a hidden norm
        cpu_layer.layer_weights(cpu_layer.LayerParams(**{**d.__dict__, "qkv": p.qkv}))
    with pytest.raises(KernelInputError, match="params.hidden_norm"):
        cpu_layer.layer_weights(cpu_layer.LayerParams(**{**d.__dict__, "hidden_norm": d.hidden_norm.double()}))


def test_the_wrapper_refuses_what_the_kernel_does_not_take():
    p = _params()
    step = cpu_layer.step(_inputs(ALL), p.shape())
    w = cpu_layer.layer_weights(p)
    with pytest.raises(KernelInputError, match="h"):
        cpu_layer.decoder_layer(torch.zeros(len(ALL) + 1, H), step, w)
    with pytest.raises(KernelInputError, match="h"):
        cpu_layer.decoder_layer(torch.zeros(len(ALL), H, dtype=torch.float64), step, w)
    wider = cpu_layer.LayerParams(**{**p.__dict__, "down": torch.zeros(H, INTER + 16), "gate_up": torch.zeros(2 * INTER + 32, H)})
    with pytest.raises(KernelInputError, match="weights"):  # a layer of another shape than the step's
        cpu_layer.decoder_layer(torch.zeros(1, H), cpu_layer.step(_inputs([0]), p.shape()), cpu_layer.layer_weights(wider))
    with pytest.raises(KernelInputError, match="params.qkv"):
        cpu_layer.layer_weights(cpu_layer.LayerParams(**{**p.__dict__, "qkv": p.qkv[:-1]}))
    with pytest.raises(KernelInputError, match="head_dim 24"):
        cpu_layer.step(_inputs(ALL), cpu_layer.LayerShape(H, HQ, HKV, 24, INTER))
    bad = _inputs(ALL)
    bad.cos = bad.cos.t().contiguous().t()  # [T, D] with the wrong strides
    with pytest.raises(KernelInputError, match="cos"):
        cpu_layer.step(bad, p.shape())
