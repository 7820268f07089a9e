"""The CPU engine's decode-sized target forwards on the native decoder layer (platform/models/cpu_layer): plain greedy
and speculative greedy (chain and tree) both verify every row on it, and their outputs are equal token for token."""

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
    """The row count and layer (its q/k/v weight) of every native layer call (the real kernel runs)."""
    seen: list[tuple[int, int]] = []
    real = kernel.decoder_layer
    monkeypatch.setattr(
        kernel, "decoder_layer", lambda h, step, w: seen.append((h.shape[0], id(w.sources[2]))) or real(h, step, w)
    )
    return seen


@pytest.mark.parametrize("spec", [dict(k=3), dict(tree=dict(depth=3, topk=2, num_draft_tokens=5))])
def test_greedy_speculation_equals_plain_with_every_decode_row_on_the_native_layer(target, tokenizer, copy_draft, calls, spec):
    plain = make_engine(target, tokenizer, cpu_kernels="native")
    assert cpu_decode.status() == "native"
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    plain_calls, calls[:] = list(calls), []
    assert plain_calls and {rows for rows, _ in plain_calls} <= set(range(1, len(PROMPTS) + 1)), "decode rows: one a sequence"
    engine = make_engine(target, tokenizer, copy_draft, cpu_kernels="native", **spec)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want
    assert engine.metrics.spec.num_accepted_tokens > 0
    assert max(rows for rows, _ in calls) > len(PROMPTS), "verification rows (k+1 or a tree's nodes a sequence)"
    assert len({layer for _, layer in plain_calls + calls}) == NUM_LAYERS, "the target's layers only (not the draft's)"
