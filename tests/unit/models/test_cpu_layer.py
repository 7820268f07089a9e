"""The CPU decode step's decoder layer in one native call (platform/models/native_layer): the model's decode and
verification forwards on it equal the PyTorch layers (atol/rtol 1e-4 on hidden states of magnitude ~1-10), and the
rule that keeps the PyTorch layer for what it does not cover (prefill, biases, qk-norm, sliding window, tensor
parallelism, other dtypes, autograd, no cache, wide trees, head shapes), each case taking the path it names."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.kernels import cpu_layer as kernel
from eagleray.platform.models import native_layer
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.layers import DecoderLayer, fuse_for_inference
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.tp import TPInfo
from eagleray.tests.support.cpu_layers import fused_model, row_calls

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)
PROMPT = 9  # tokens of each sequence cached by the prefill
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
NEW = torch.randint(0, 96, (3, 6), generator=torch.Generator().manual_seed(1))  # each sequence's next tokens


@pytest.fixture
def calls(monkeypatch):
    """Row counts of the native layer's calls (the real kernel runs)."""
    return row_calls(monkeypatch, kernel, "decoder_layer")


def _prefilled(model: LlamaModel, cache_dtype=None):
    """A cache holding PROMPT tokens of 3 sequences (prefilled inside blas_gemms, as the engine does)."""
    kv = model.make_kv_cache(12, 4, dtype=cache_dtype)
    ids = torch.randint(0, 96, (3 * PROMPT,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), cpu_decode.blas_gemms():
        model(ids, torch.arange(PROMPT).repeat(3), AttentionMetadata.build([PROMPT] * 3, [0] * 3, TABLES, 4), kv)
    return kv


def _forward(model, kv, query_lens, tree_masks=None):
    """New tokens after the prompt: query_lens[b] rows of sequence b -> final hidden [T, H]."""
    ids = torch.cat([NEW[b, :q] for b, q in enumerate(query_lens)])  # [T]
    pos = torch.cat([PROMPT + torch.arange(q) for q in query_lens])
    meta = AttentionMetadata.build(query_lens, [PROMPT] * len(query_lens), TABLES[: len(query_lens)], 4, tree_masks)
    with torch.inference_mode():
        return model(ids, pos, meta, kv)[0]


def _pytorch_layers(monkeypatch):
    monkeypatch.setattr(native_layer, "forward", lambda *a: None)


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.mark.parametrize("query_lens,trees", [([1, 1, 1], None), ([5, 5, 5], None), ([1, 4, 2], [None, TREE, None])])
def test_decode_and_verification_equal_the_pytorch_layers(native, calls, monkeypatch, query_lens, trees):
    """Plain decode rows, k+1 verification rows a sequence and a draft tree's rows; the K/V written match too."""
    model = fused_model()
    kv_fused, kv_torch = _prefilled(model), _prefilled(model)
    fused = _forward(model, kv_fused, query_lens, trees)
    assert calls == [sum(query_lens)] * 3, "every layer took the native call"
    _pytorch_layers(monkeypatch)
    want = _forward(model, kv_torch, query_lens, trees)
    torch.testing.assert_close(fused, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_fused.k, kv_torch.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_fused.v, kv_torch.v, atol=1e-4, rtol=1e-4)


def test_a_row_is_bitwise_the_same_decoded_alone_or_verified_beside_others(native, calls):
    model = fused_model()
    kv = _prefilled(model)
    verified = _forward(model, kv, [4, 4, 4])  # rows 0..3 of each sequence, K/V written
    kv2 = _prefilled(model)
    alone = _forward(model, kv2, [1, 1, 1])  # the first row of each sequence, decoded alone
    assert torch.equal(alone, verified[[0, 4, 8]])


def _rule_cases():
    h = torch.zeros(3, 64)
    return {
        "prefill": (dict(), "prefill"),
        "rows": (dict(rows=cpu_decode.MAX_ROWS + 1), "past 128 rows"),
        "torch kernels": (dict(mode="torch"), "native kernels off"),
        "no cache": (dict(cache=False), "no paged KV cache"),
        "wide tree": (dict(tree=cpu_decode.MAX_NEW + 1), "draft tree wider"),
        "bf16 rows": (dict(h=h.bfloat16()), "hidden states torch.bfloat16"),
        "autograd": (dict(h=h.requires_grad_()), "autograd"),
    }


@pytest.mark.parametrize("case", list(_rule_cases()))
def test_forwards_the_rule_keeps_on_the_pytorch_layers(native, case):
    kw, reason = _rule_cases()[case]
    rows, q = kw.get("rows", 3), kw.get("tree", 1)
    lens = [q] if q > 1 else [rows] if rows > 3 else [1] * rows
    trees = [torch.ones(q, q, dtype=torch.bool).tril()] if q > 1 else None
    meta = AttentionMetadata.build(lens, [0] * len(lens), [list(range(40))] * len(lens), 4, trees)
    cache = None if kw.get("cache") is False else (torch.zeros(40, 4, 2, 16), torch.zeros(40, 4, 2, 16))
    h = kw.get("h", torch.zeros(sum(lens), 64))
    if kw.get("mode"):
        cpu_decode.configure(kw["mode"])
    with torch.enable_grad(), cpu_decode.blas_gemms() if case == "prefill" else contextlib.nullcontext():
        got = native_layer.forward_reason(h, meta, cache)
    assert got is not None and reason in got, got


def test_the_rule_takes_the_native_layer_for_a_plain_llama_decode(native):
    model = fused_model()
    meta = AttentionMetadata.build([1, 1], [PROMPT] * 2, TABLES[:2], 4)
    cache = (torch.zeros(12, 4, 2, 16), torch.zeros(12, 4, 2, 16))
    assert native_layer.unfused_reason(model.layers[0], torch.zeros(2, 64), meta, cache) is None


LAYER_CASES = {
    "biases": (dict(attention_bias=True), None, "biases"),
    "mlp bias": (dict(mlp_bias=True), None, "biases"),
    "qk_norm": (dict(model_type="qwen3", head_dim=16), None, "qk_norm"),
    "sliding window": (dict(model_type="mistral", sliding_window=8), None, "sliding window"),
    "head_dim": (dict(hidden_size=96), None, "head_dim 24"),
    "bf16 cache": (dict(), torch.bfloat16, "not fp32"),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layers_the_rule_keeps_on_pytorch_run_their_own_forward(native, calls, monkeypatch, case):
    """Each case's reason, and its forward equals the PyTorch layers' (the native call never made)."""
    config, cache_dtype, reason = LAYER_CASES[case]
    model = fused_model(**config)
    kv = _prefilled(model, cache_dtype)
    cache = (kv.k[0], kv.v[0])
    meta = AttentionMetadata.build([1, 1, 1], [PROMPT] * 3, TABLES, 4)
    assert reason in (native_layer.unfused_reason(model.layers[0], torch.zeros(3, model.arch.hidden_size), meta, cache) or "")
    got = _forward(model, kv, [2, 2, 2])
    assert calls == [], "the native layer must not run"
    _pytorch_layers(monkeypatch)
    assert torch.equal(got, _forward(model, _prefilled(model, cache_dtype), [2, 2, 2]))


def test_tensor_parallel_and_unfused_layers_keep_pytorch(native):
    arch = fused_model().arch
    tp_layer = fuse_for_inference(DecoderLayer(arch, TPInfo(rank=0, world=2)))
    cache = (torch.zeros(12, 4, 1, 16), torch.zeros(12, 4, 1, 16))
    assert native_layer.layer_reason(tp_layer, cache) == "tensor parallelism"
    assert native_layer.layer_reason(DecoderLayer(arch, TPInfo()), cache).startswith("q/k/v or gate/up not fused")
    assert native_layer.layer_reason(fuse_for_inference(DecoderLayer(replace(arch, dtype=torch.bfloat16), TPInfo())), cache) == (
        "weights or cache not fp32"
    )


def test_the_kept_kernel_weights_follow_changes_that_register_nothing(native, calls, monkeypatch):
    """Without a registration (the cheap check: the kept tensors' versions and storages) a weight changed in place and
    one whose ``.data`` is replaced (which does not bump its version either) are packed again."""
    model = fused_model()
    kv, kv_torch = _prefilled(model), _prefilled(model)
    _forward(model, kv, [1, 1, 1])  # the handles are made and kept
    epoch = native_layer._EPOCH[0]
    with torch.no_grad():
        model.layers[0].self_attn.qkv.weight.mul_(0.9)
    w = model.layers[1].mlp.gate_up.weight
    version = w._version
    w.data = w.detach().clone() * 0.8
    assert (w._version, native_layer._EPOCH[0]) == (version, epoch), "neither the version nor a registration tells"
    fused = _forward(model, kv, [2, 2, 2])
    _pytorch_layers(monkeypatch)
    torch.testing.assert_close(fused, _forward(model, kv_torch, [2, 2, 2]), atol=1e-4, rtol=1e-4)


def test_the_kept_kernel_weights_follow_a_weight_changed_in_place_a_replaced_weight_and_a_new_cache(native, calls, monkeypatch):
    """A layer's packed kernel weights are kept between forwards and made again when what they were made from changes;
    each change below, if missed, leaves the native forward on stale weights or writing another cache's K/V."""
    model = fused_model()
    kv, kv_torch = _prefilled(model), _prefilled(model)  # the prompts' K/V written before the changes, in both
    _forward(model, kv, [1, 1, 1])  # the handles are made and kept, for this cache
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(0.5)  # in place: a new version of the same tensor and storage
    old = model.layers[0].self_attn.o_proj.weight
    new = torch.nn.Parameter(old.detach() * 0.7)  # another tensor, brought to the same version number
    with torch.no_grad():
        while new._version < old._version:
            new.mul_(1.0)
    model.layers[0].self_attn.o_proj.weight = new
    fused = _forward(model, kv, [2, 2, 2])  # the same cache: only the weights changed (layer 2: nothing)
    other, other_torch = _prefilled(model), _prefilled(model)
    fused_other = _forward(model, other, [2, 2, 2])  # another cache (kv is alive: not its storage); layer 2: only this
    assert calls[-6:] == [6] * 6, "every layer took the native call"
    _pytorch_layers(monkeypatch)
    torch.testing.assert_close(fused, _forward(model, kv_torch, [2, 2, 2]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv.k, kv_torch.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_other, _forward(model, other_torch, [2, 2, 2]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(other.k, other_torch.k, atol=1e-4, rtol=1e-4)
