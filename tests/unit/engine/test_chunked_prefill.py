"""Chunked prefill in the engine (``engine.chunked_prefill``): prompts split across steps by the token budget, the
running sequences decoded in the prompts' forward, give the same tokens and the same captured hidden states as whole
prompts in steps of their own; a partial prompt emits nothing until its last chunk and queues its rows for the draft;
running sequences decode in and between its chunks."""

from __future__ import annotations

import pytest
import torch

from eagleray.serve.engine import SamplingParams
from eagleray.tests.unit.engine.conftest import PROMPTS, make_engine

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
BUDGET = 16  # tokens a prefill step (the least engine.max_num_batched_tokens takes)
LONG = [(p + " ") * 4 for p in PROMPTS]  # 20-76 tokens: each prompt is split, most across several steps


def _chunk_steps(engine) -> list[int]:
    """Record each prefill step's chunk (0: every prompt of the step whole)."""
    chunks, schedule = [], engine.scheduler.schedule

    def spied(lookahead):
        batch = schedule(lookahead)
        if batch is not None and batch.is_prefill:
            chunks.append(batch.chunk)
        return batch

    engine.scheduler.schedule = spied
    return chunks


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "chain-k2"])
def test_chunked_prompts_give_the_tokens_of_whole_ones(target, tokenizer, copy_draft, k):
    draft = copy_draft if k else None
    whole = make_engine(target, tokenizer, draft, k=k or 3, chunked_prefill=False)
    chunked = make_engine(target, tokenizer, draft, k=k or 3, max_num_batched_tokens=BUDGET)
    chunks = _chunk_steps(chunked)
    want, got = whole.generate(LONG, GREEDY), chunked.generate(LONG, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(c > 0 for c in chunks) >= len(LONG), chunks  # every prompt was split at least once
    if k:
        assert chunked.metrics.spec.num_accepted_tokens > 0


def test_a_partial_prompt_queues_each_chunks_rows_for_the_draft(target, tokenizer, copy_draft):
    engine = make_engine(target, tokenizer, copy_draft, k=2, max_num_batched_tokens=BUDGET)
    engine.add_request(LONG[3], GREEDY, "long")
    seq = engine.scheduler.waiting[0]
    while not seq.output_token_ids:
        engine.step()
        assert sum(seq.pending_aux.counts) == seq.num_cached - seq.draft_cached  # every scored position, once
    assert seq.num_cached == len(seq.prompt_token_ids) and seq.draft_cached == 0


def test_chunks_on_the_row_path_give_the_tokens_of_whole_prompts(target, tokenizer, copy_draft):
    """engine.decode_path 'rows' (CUDA's; eager here): chunks up to engine.prefill_rows run as rows, longer ones
    eagerly; greedy speculation and seeded sampling give the tokens of whole prompts (a partial prompt draws nothing;
    a speculative engine's sampled tokens depend on which steps speculate, so the sampled runs are plain)."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    for params, draft in ((GREEDY, copy_draft), (sampled, None)):
        for prefill_rows in (1024, 8):  # every chunk as rows; the 16-token chunks eager, the shorter rest as rows
            kw = dict(k=2, decode_path="rows", prefill_rows=prefill_rows)
            whole = make_engine(target, tokenizer, draft, chunked_prefill=False, **kw).generate(LONG, params)
            engine = make_engine(target, tokenizer, draft, chunked_prefill=True, max_num_batched_tokens=BUDGET, **kw)
            chunks = _chunk_steps(engine)
            assert [o.token_ids for o in engine.generate(LONG, params)] == [o.token_ids for o in whole]
            assert any(chunks), chunks


def test_sampled_tokens_do_not_depend_on_the_chunks(target, tokenizer):
    """A partial prompt draws no token: its request's generator is untouched until its last chunk."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    whole = make_engine(target, tokenizer, chunked_prefill=False).generate(LONG, sampled)
    chunked = make_engine(target, tokenizer, max_num_batched_tokens=BUDGET).generate(LONG, sampled)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_a_chunked_captured_request_keeps_every_positions_hidden_states(target, tokenizer, copy_draft):
    engine = make_engine(target, tokenizer, copy_draft, k=2, max_num_batched_tokens=BUDGET)
    engine.enable_capture()
    out = engine.generate([LONG[3]], GREEDY.model_copy(update={"capture_states": True}))[0]
    ids = out.prompt_token_ids + out.token_ids[:-1]
    logits, aux = target.forward_full(torch.tensor([ids]))
    assert out.hidden.aux.shape == aux[0].shape  # one row a position, each once
    torch.testing.assert_close(out.hidden.aux, aux[0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(target.compute_logits(out.hidden.final), logits[0], atol=1e-2, rtol=1e-3)


def test_a_long_prompt_does_not_stall_a_running_request_and_streams_nothing_before_its_last_chunk(target, tokenizer):
    engine = make_engine(target, tokenizer, max_num_batched_tokens=BUDGET)
    seen: dict[str, list] = {"short": [], "long": []}
    engine.add_request([1, 2, 3], GREEDY, "short", on_output=seen["short"].append)
    engine.step()  # short's prefill: it is running
    engine.add_request(list(range(1, 61)), GREEDY, "long", on_output=seen["long"].append)  # 60 tokens: 4 chunks
    kinds = []
    while not seen["long"]:
        outs = engine.step()
        kinds.append([o.request_id for o in outs])
    # short decodes in each of long's chunks (a token of the budget: 15 prompt tokens a chunk) and in a step between
    assert kinds == [["short"]] * 6 + [["short", "long"]], kinds
    assert engine.metrics.prefill.steps == 5 and engine.metrics.plain.steps == 3
    assert seen["long"][0].delta_token_ids and len(seen["long"]) == 1  # its first output carries its first token


def test_a_running_sequence_decoded_in_a_prefill_step_does_not_join_again(target, tokenizer, copy_draft):
    """The adaptive policy's t_join counts the prompt positions of sequences that join; a running sequence that takes
    a token in a prompt's forward joined long before: its count stays, and its prompt is not counted again."""
    engine = make_engine(target, tokenizer, copy_draft, k=2, max_num_batched_tokens=BUDGET)
    engine.add_request(PROMPTS[0], GREEDY, "a")
    for _ in range(3):
        engine.step()  # a's prefill, then speculative steps: the draft caught up on its prompt
    a = engine._seqs["a"]
    joined, total = a.joined_positions, engine.policy.joins._joined
    assert joined == len(a.prompt_token_ids) and a.draft_cached > 0
    engine.add_request(PROMPTS[1], GREEDY, "b")
    outs = engine.step()  # b's prefill with a's token in its forward
    b = engine._seqs["b"]
    assert [o.request_id for o in outs] == ["a", "b"] and a.joined_positions == joined
    assert engine.policy.joins._joined == total + len(b.prompt_token_ids)  # b's prompt alone
