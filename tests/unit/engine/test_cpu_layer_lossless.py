"""The CPU engine's decode-sized forwards on the native decoder layer (platform/models/native_layer): plain greedy and
speculative greedy (chain and tree) both verify every row on it, the draft's decode-sized forwards (catch-up, chain
steps, tree levels) take it too, and the outputs are equal token for token."""

from __future__ import annotations

import pytest

from eagleray.kernels import cpu_decode, cpu_decode_build
from eagleray.kernels import cpu_layer as kernel
from eagleray.serve.engine import SamplingParams

from .conftest import NUM_LAYERS, PROMPTS, make_engine

pytestmark = pytest.mark.skipif(
    cpu_decode_build.unsupported() is not None, reason=f"native CPU kernels: {cpu_decode_build.unsupported()}"
)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture
def calls(monkeypatch):
    """The row count, layer (its q/k/v weight) and whether it is a draft layer (embeds given) of every native layer
    call (the real kernel runs)."""
    seen: list[tuple[int, int, bool]] = []
    real = kernel.decoder_layer

    def spy(h, step, w, embeds=None):
        seen.append((h.shape[0], id(w.sources[2]), embeds is not None))
        return real(h, step, w, embeds)

    monkeypatch.setattr(kernel, "decoder_layer", spy)
    return seen


@pytest.mark.parametrize("draft", ["copy_draft", "random_draft"])
@pytest.mark.parametrize("spec", [dict(k=3), dict(tree=dict(depth=3, topk=2, num_draft_tokens=5))])
def test_greedy_speculation_equals_plain_with_every_decode_row_on_the_native_layer(
    target, tokenizer, request, calls, spec, draft
):
    plain = make_engine(target, tokenizer, cpu_kernels="native")
    assert cpu_decode.status() == "native"
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    plain_calls, calls[:] = list(calls), []
    assert plain_calls and {rows for rows, _, _ in plain_calls} <= set(range(1, len(PROMPTS) + 1)), "a row a sequence"
    engine = make_engine(target, tokenizer, request.getfixturevalue(draft), cpu_kernels="native", **spec)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want
    if draft == "copy_draft":
        assert engine.metrics.spec.num_accepted_tokens > 0
    target_calls = [c for c in calls if not c[2]]
    assert max(rows for rows, _, _ in target_calls) > len(PROMPTS), "verification rows (k+1 or a tree's nodes a sequence)"
    assert len({layer for _, layer, _ in plain_calls + target_calls}) == NUM_LAYERS, "every target layer"
    draft_calls = [c for c in calls if c[2]]
    assert draft_calls and len({layer for _, layer, _ in draft_calls}) == 1, "the draft's layer: its decode forwards"
    assert not any(c[2] for c in plain_calls), "plain decoding runs no draft"
