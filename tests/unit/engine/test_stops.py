"""Stop conditions: max_tokens, stop token ids, stop strings (with and without speculation)."""

from __future__ import annotations

import pytest

from eagleray.serve.engine import SamplingParams

from .conftest import PROMPTS, make_engine


@pytest.fixture(scope="module")
def reference(target, tokenizer):
    return make_engine(target, tokenizer).generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True))[0]


@pytest.mark.parametrize("spec", [False, True])
def test_max_tokens(target, tokenizer, copy_draft, spec):
    engine = make_engine(target, tokenizer, copy_draft if spec else None, k=4)
    out = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [5, 5]
    assert all(o.finish_reason == "length" for o in out)


@pytest.mark.parametrize("spec", [False, True])
def test_stop_token_id(target, tokenizer, copy_draft, reference, spec):
    stop_id = reference.token_ids[6]
    first = reference.token_ids.index(stop_id)
    engine = make_engine(target, tokenizer, copy_draft if spec else None, k=4)
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == reference.token_ids[: first + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("spec", [False, True])
def test_stop_string(target, tokenizer, copy_draft, reference, spec):
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    engine = make_engine(target, tokenizer, copy_draft if spec else None, k=4)
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text and len(out.token_ids) <= len(reference.token_ids)


def test_eos_stops_unless_ignored(target, tokenizer, reference):
    engine = make_engine(target, tokenizer)
    engine.eos_id = reference.token_ids[3]
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=16))[0]
    assert out.token_ids[-1] == engine.eos_id and out.finish_reason == "stop"
