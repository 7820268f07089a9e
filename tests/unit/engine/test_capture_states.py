"""Serving capture in the engine: a request with ``capture_states`` gets the target's hidden states of
every position it ran, equal to a fresh forward over the same tokens; output and other requests unchanged."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine import SamplingParams
from eagleray.tests.unit.engine.conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CAPTURE = GREEDY.model_copy(update={"capture_states": True})


def _fresh(target, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, A], logits [T, V]) of one no-cache forward over ``ids``."""
    logits, aux = target.forward_full(torch.tensor([ids]))
    return aux[0], logits[0]


@pytest.mark.parametrize("tree", [None, {"depth": 3, "topk": 2, "num_draft_tokens": 5}], ids=["chain", "tree"])
def test_captured_states_equal_a_fresh_forward(target, tokenizer, copy_draft, tree):
    engine = make_engine(target, tokenizer, copy_draft, tree=tree)
    engine.enable_capture()
    plain = make_engine(target, tokenizer).generate(PROMPTS, GREEDY)
    params = [CAPTURE, GREEDY, CAPTURE, GREEDY]
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # capture does not change output
    assert engine.metrics.spec.num_accepted_tokens > 0  # speculative steps committed several rows at once
    for out, p in zip(outs, params):
        if not p.capture_states:
            assert out.hidden is None
            continue
        ids = out.prompt_token_ids + out.token_ids[:-1]  # the last token was never run through the target
        aux, logits = _fresh(target, ids)
        assert out.hidden.aux.shape == aux.shape and out.hidden.final.shape == (len(ids), target.hidden_size)
        assert out.hidden.aux_layer_ids == target.aux_layer_ids
        torch.testing.assert_close(out.hidden.aux, aux, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(target.compute_logits(out.hidden.final), logits, atol=1e-2, rtol=1e-3)


def test_plain_steps_of_a_speculative_engine_capture_every_position(target, tokenizer, copy_draft):
    """With speculation off (the adaptive policy's k = 0) every decode step is plain: each step's row is queued for
    the draft and, for a captured request, copied into its capture."""
    engine = make_engine(target, tokenizer, copy_draft)
    engine.enable_capture()
    engine.policy.disable("plain steps only")
    outs = engine.generate(PROMPTS[:2], [CAPTURE, GREEDY])
    assert engine.metrics.speculative.steps == 0 and engine.metrics.plain.steps > 0
    out = outs[0]
    ids = out.prompt_token_ids + out.token_ids[:-1]
    aux, logits = _fresh(target, ids)
    assert out.hidden.aux.shape == aux.shape
    torch.testing.assert_close(out.hidden.aux, aux, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(target.compute_logits(out.hidden.final), logits, atol=1e-2, rtol=1e-3)
    assert outs[1].hidden is None


def test_captured_requests_reuse_a_shared_prefix_with_its_hidden_states(target, tokenizer, copy_draft):
    """Captured requests that begin as an earlier captured one take its cached blocks with the hidden states it left
    beside them: prompt tokens are found in the prefix cache, and each request's rows still equal a fresh forward."""
    engine = make_engine(target, tokenizer, copy_draft, max_num_seqs=1)
    engine.enable_capture()
    shared = "You are a careful assistant who answers in one short sentence, plainly and without lists. "
    prompts = [shared + q for q in ("Why is the sky blue?", "Name a prime.", "What is Ray?")]
    outs = engine.generate(prompts, CAPTURE)
    assert engine.metrics.prefix.hits >= 2 * 16, "the later two requests found the shared prompt's blocks"
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids[:-1]
        aux, logits = _fresh(target, ids)
        assert out.hidden.aux.shape == aux.shape
        torch.testing.assert_close(out.hidden.aux, aux, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(target.compute_logits(out.hidden.final), logits, atol=1e-2, rtol=1e-3)


def test_preempted_request_captures_every_position_once(target, tokenizer, copy_draft):
    """A KV cache too small for all four forces preemption (recompute): rows must not be doubled."""
    engine = make_engine(target, tokenizer, copy_draft, num_kv_blocks=9, block_size=4)
    engine.enable_capture()
    outs = engine.generate(PROMPTS, CAPTURE)
    assert engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.hidden.aux.shape[0] == len(out.prompt_token_ids) + len(out.token_ids) - 1


def test_capture_states_needs_enable_capture(target, tokenizer, copy_draft):
    engine = make_engine(target, tokenizer, copy_draft)
    with pytest.raises(EaglerayError, match="enable_capture"):
        engine.add_request("hi", CAPTURE)


def test_enable_capture_needs_a_draft(target, tokenizer):
    with pytest.raises(EaglerayError, match="capture needs a draft"):
        make_engine(target, tokenizer).enable_capture()


def test_enable_capture_refuses_the_row_path(target, tokenizer, copy_draft):
    with pytest.raises(EaglerayError, match="decode_path: varlen"):
        make_engine(target, tokenizer, copy_draft, decode_path="rows").enable_capture()
