"""The EAGLE-3 draft's layer on the CPU decode path in one native call (platform/models/native_layer, eagle3.Eagle3Layer):
the draft's decode-sized forwards (catch-up rows, chain rows) on it equal its PyTorch layer (atol/rtol 1e-4 on hidden
states of magnitude ~1-10, either residual), a row is bitwise the same alone or beside others, and the draft layers
the rule keeps on PyTorch (unfused, tensor parallelism, a non-fp32 hidden norm, head shapes, a prefill) run their own
forward, each for the reason it names."""

from __future__ import annotations

import pytest
import torch

from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.kernels import cpu_layer as kernel
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.models import native_layer
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.eagle3 import Eagle3Draft, Eagle3Layer
from eagleray.platform.models.layers import fuse_for_inference
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.tp import TPInfo
from eagleray.tests.support.tiny import make_tiny_llama

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)
AUX = [1, 2, 4]
PROMPT = 7  # positions of each sequence the draft's cache holds before the forwards under test
TABLES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture
def calls(monkeypatch):
    """(rows, has embeds) of every native layer call (the real kernel runs)."""
    seen: list[tuple[int, bool]] = []
    real = kernel.decoder_layer

    def spy(h, step, weights, embeds=None):
        seen.append((h.shape[0], embeds is not None))
        return real(h, step, weights, embeds)

    monkeypatch.setattr(kernel, "decoder_layer", spy)
    return seen


def _make_draft(tmp_path_factory, hidden: int = 64) -> Eagle3Draft:
    root = tmp_path_factory.mktemp("draft")
    target_dir = make_tiny_llama(root / "target", num_layers=4, hidden_size=hidden, num_heads=4, num_kv_heads=2)
    target = LlamaModel.from_dir(target_dir, aux_layer_ids=AUX)
    draft = Eagle3Draft.from_checkpoint(make_random_draft(TargetSpec.from_dir(target_dir), root / "d", aux_layer_ids=AUX), target)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g)) if "norm" in name else p.mul_(4.0)  # unequal norms
    return fuse_for_inference(draft)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Eagle3Draft:
    return _make_draft(tmp_path_factory)


def _prefilled(draft: Eagle3Draft, dtype=None):
    """The draft's cache holding PROMPT positions of 3 sequences (written by its PyTorch layer, as a prefill)."""
    kv = draft.make_kv_cache(12, 4, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids, hidden = torch.randint(0, 96, (3 * PROMPT,), generator=g), torch.randn(3 * PROMPT, 64, generator=g)
    meta = AttentionMetadata.build([PROMPT] * 3, [0] * 3, TABLES, 4)
    with torch.inference_mode(), cpu_decode.blas_gemms():
        draft(ids, torch.arange(PROMPT).repeat(3), hidden, meta, kv)
    return kv


def _forward(draft: Eagle3Draft, kv, query_lens: list[int], seed: int = 1):
    """query_lens[b] new positions of sequence b after the prompt -> (normed, next hidden) [T, H] each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (3, 6), generator=g)
    hidden = 3 * torch.randn(3, 6, 64, generator=g)  # [B, 6, H]: the fc-combined hidden of each position
    rows = torch.cat([ids[b, :q] for b, q in enumerate(query_lens)])  # [T]
    h = torch.cat([hidden[b, :q] for b, q in enumerate(query_lens)])  # [T, H]
    pos = torch.cat([PROMPT + torch.arange(q) for q in query_lens])  # [T]
    meta = AttentionMetadata.build(query_lens, [PROMPT] * len(query_lens), TABLES[: len(query_lens)], 4)
    with torch.inference_mode():
        return draft(rows, pos, h, meta, kv)


def _pytorch_layer(monkeypatch):
    monkeypatch.setattr(native_layer, "forward", lambda *a: None)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 2]])  # chain steps; a catch-up over accepted tokens
def test_draft_forwards_on_the_native_layer_equal_its_pytorch_layer(
    draft, native, calls, monkeypatch, norm_before_residual, query_lens
):
    monkeypatch.setattr(draft.midlayer, "norm_before_residual", norm_before_residual)
    kv_fused, kv_torch = _prefilled(draft), _prefilled(draft)
    normed, nxt = _forward(draft, kv_fused, query_lens)
    assert calls == [(sum(query_lens), True)], "the draft's layer took one native call, with the token embeddings"
    _pytorch_layer(monkeypatch)
    want_normed, want_next = _forward(draft, kv_torch, query_lens)
    torch.testing.assert_close(nxt, want_next, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(normed, want_normed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_fused.k, kv_torch.k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_fused.v, kv_torch.v, atol=1e-4, rtol=1e-4)


def test_a_draft_row_is_bitwise_the_same_alone_or_beside_others(draft, native, calls):
    together = _forward(draft, _prefilled(draft), [3, 3, 3])[1]  # rows 0..2 of each sequence, K/V written
    alone = _forward(draft, _prefilled(draft), [1, 1, 1])[1]  # the first row of each sequence alone
    assert torch.equal(alone, together[[0, 3, 6]])
    assert len(calls) == 2


def _unfused(draft):
    layer = Eagle3Layer(draft.arch, TPInfo(), False)
    return layer, "q/k/v or gate/up not fused"


def _tensor_parallel(draft):
    return fuse_for_inference(Eagle3Layer(draft.arch, TPInfo(rank=0, world=2), False)), "tensor parallelism"


def _bf16_hidden_norm(draft):
    layer = fuse_for_inference(Eagle3Layer(draft.arch, TPInfo(), False))
    layer.hidden_norm.weight.data = layer.hidden_norm.weight.data.bfloat16()  # only the norm the Llama rule lacks
    return layer, "weights or cache not fp32"


@pytest.mark.parametrize("case", [_unfused, _tensor_parallel, _bf16_hidden_norm])
def test_draft_layers_the_rule_keeps_on_pytorch(draft, case):
    layer, reason = case(draft)
    cache = (torch.zeros(12, 4, 2, 16), torch.zeros(12, 4, 2, 16))
    assert reason in (native_layer.layer_reason(layer, cache) or "")


def test_a_draft_of_an_unsupported_head_dim_runs_its_own_forward(tmp_path_factory, native, calls, monkeypatch):
    wide = _make_draft(tmp_path_factory, hidden=96)  # 4 heads of 24
    assert "head_dim 24" in (native_layer.layer_reason(wide.midlayer, (wide.make_kv_cache(12, 4).k[0],) * 2) or "")
    g = torch.Generator().manual_seed(3)
    ids, h = torch.randint(0, 96, (3,), generator=g), torch.randn(3, 96, generator=g)
    meta = lambda: AttentionMetadata.build([1, 1, 1], [0] * 3, TABLES, 4)  # noqa: E731
    with torch.inference_mode():
        got = wide(ids, torch.zeros(3, dtype=torch.int64), h, meta(), wide.make_kv_cache(12, 4))[1]
        assert calls == [], "the native layer must not run"
        _pytorch_layer(monkeypatch)
        assert torch.equal(got, wide(ids, torch.zeros(3, dtype=torch.int64), h, meta(), wide.make_kv_cache(12, 4))[1])


def test_the_draft_prefill_keeps_the_pytorch_layer(draft, native, calls):
    _prefilled(draft)
    assert calls == [], "a prefill (BLAS GEMMs) is not decode-sized: the forward rule keeps PyTorch"
    assert native_layer.unfused_reason(draft.midlayer, torch.zeros(3, 64), AttentionMetadata.build([1] * 3, [PROMPT] * 3, TABLES, 4),
                                    (torch.zeros(12, 4, 2, 16),) * 2) is None  # fmt: skip


def test_a_draft_layers_kept_kernel_weights_follow_a_replaced_hidden_norm(tmp_path_factory, native, calls, monkeypatch):
    """The hidden norm only the draft's layer has is part of what its kept handle was made from."""
    draft = _make_draft(tmp_path_factory)
    kv, kv_torch = _prefilled(draft), _prefilled(draft)  # the prompts' K/V written with the old norm in both
    _forward(draft, kv, [1, 1, 1])  # the handle is made and kept (for this cache)
    norm = draft.midlayer.hidden_norm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.5)
    normed, nxt = _forward(draft, kv, [1, 1, 1])  # the same rows again: their K/V are written before they are read
    assert len(calls) == 2, "both forwards took the native layer"
    _pytorch_layer(monkeypatch)
    want_normed, want_next = _forward(draft, kv_torch, [1, 1, 1])
    torch.testing.assert_close(nxt, want_next, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(normed, want_normed, atol=1e-4, rtol=1e-4)
