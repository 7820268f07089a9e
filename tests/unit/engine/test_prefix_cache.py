"""Automatic prefix caching (serve/engine/prefix_cache, BlockManager.match_prefix / register): whole blocks reused by
the hash of every token up to their end, the last token always computed, shared blocks held by several sequences,
idle ones evicted oldest first; with a draft, blocks registered once the draft caught up, keyed with the next token;
in the engine, greedy output equal with and without it, plain and speculative."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.scheduler import Scheduler
from eagleray.serve.engine.sequence import Sequence
from tests.unit.engine.conftest import make_engine

BS = 4


def _blocks(num_blocks: int = 16) -> BlockManager:
    bm = BlockManager(num_blocks, BS)
    bm.prefix_caching = True
    return bm


def _prefilled(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence admitted (matching what it can), its prompt computed and committed (registered)."""
    seq = Sequence(list(tokens), SamplingParams())
    bm.match_prefix(seq)
    bm.ensure(seq, seq.num_tokens)
    seq.num_cached = seq.num_tokens - 1
    bm.register(seq)
    return seq


def test_a_prompt_that_begins_as_an_earlier_one_takes_its_blocks_and_computes_the_rest():
    bm = _blocks()
    first = _prefilled(bm, list(range(11)))  # blocks [0-3] [4-7] committed, [8-10] partial
    second = Sequence(list(range(8)) + [50, 51, 52], SamplingParams())
    assert bm.match_prefix(second) == 8 and second.num_cached == 8
    assert second.block_table == first.block_table[:2], "the same blocks, shared"
    assert bm.match_prefix(Sequence([99] + list(range(1, 11)), SamplingParams())) == 0, "the first token differs"
    third = Sequence([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10], SamplingParams())
    assert bm.match_prefix(third) == 4, "a block matches only where every token before it does (chain hash)"


def test_the_last_token_is_always_computed():
    """A prompt of whole blocks, all cached, still computes its last block: its last token's logits are the first
    new token."""
    bm = _blocks()
    _prefilled(bm, list(range(9)))  # blocks [0-3] [4-7] registered
    again = Sequence(list(range(8)), SamplingParams())  # two whole blocks, both cached
    assert bm.match_prefix(again) == 4
    bm.ensure(again, again.num_tokens)
    assert again.num_tokens - again.num_cached == 4


def test_a_shared_block_stays_until_its_last_holder_leaves_then_idles_until_evicted_oldest_first():
    bm = _blocks(num_blocks=6)
    a = _prefilled(bm, list(range(9)))  # 3 blocks, 2 registered
    b = Sequence(list(range(8)) + [7], SamplingParams())
    bm.match_prefix(b)
    bm.ensure(b, b.num_tokens)  # shares a's 2 blocks, 1 block of its own
    assert bm.num_free == 2
    bm.free(a)  # a's partial block is free; the shared ones are b's still
    assert bm.num_free == 3 and bm.cache.num_idle == 0
    bm.free(b)
    assert bm.num_free == 6 and bm.cache.num_idle == 2, "registered blocks idle in the cache, counted free"
    c = Sequence(list(range(100, 117)), SamplingParams())  # 5 blocks: 4 never used + the oldest idle one
    bm.ensure(c, c.num_tokens)
    assert bm.cache.num_idle == 1
    hit = Sequence(list(range(9)), SamplingParams())
    assert bm.match_prefix(hit) == 0, "the first block was evicted, so the chain does not match"
    bm.unmatch(hit)
    with pytest.raises(EaglerayError, match="does not own it"):
        bm._release(hit, c.block_table[:1])


def test_matched_blocks_go_back_when_the_sequence_cannot_be_admitted():
    bm = _blocks(num_blocks=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    a = _prefilled(bm, list(range(9)))
    bm.free(a)
    big = Sequence(list(range(8)) + list(range(200, 220)), SamplingParams())  # 2 cached + 5 more blocks: no room
    sched.add(big)
    assert sched.schedule(lookahead=1) is None
    assert big.block_table == [] and big.num_cached == 0 and bm.num_free == 4 and bm.cache.num_idle == 2
    assert bm.stats.hits == 0 and bm.stats.queries == 0, "only admitted sequences are counted"


def test_clearing_forgets_every_block_and_frees_the_idle_ones():
    bm = _blocks()
    bm.free(_prefilled(bm, list(range(9))))
    assert bm.cache.num_idle == 2
    bm.use_prefix_cache(True, False)
    assert len(bm.cache) == 0 and bm.num_free == 16
    assert bm.match_prefix(Sequence(list(range(9)), SamplingParams())) == 0


def test_off_by_default_in_the_block_manager_and_per_device_in_the_engine():
    from eagleray.serve.engine import EngineConfig
    from eagleray.serve.engine.startup import prefix_caching

    bm = BlockManager(8, BS)
    seq = Sequence(list(range(9)), SamplingParams())
    assert bm.match_prefix(seq) == 0 and seq.block_table == []
    assert prefix_caching(EngineConfig(), torch.device("cpu")) is True
    assert prefix_caching(EngineConfig(), torch.device("cuda")) is False
    assert prefix_caching(EngineConfig(prefix_caching=True), torch.device("cuda")) is True
    assert prefix_caching(EngineConfig(prefix_caching=False), torch.device("cpu")) is False


SHARED = "You are a careful assistant who answers in one short sentence, plainly and without lists. "
GREEDY = SamplingParams(max_tokens=10)


def test_greedy_output_is_the_same_with_the_cache_and_later_prompts_hit_it(target, tokenizer):
    prompts = [SHARED + q for q in ("Why is the sky blue?", "Name a prime.", "What is Ray?", "Say hi.")]
    off = make_engine(target, tokenizer, prefix_caching=False, max_num_seqs=1)
    on = make_engine(target, tokenizer, max_num_seqs=1)  # None: on, on a CPU
    want = [o.token_ids for o in off.generate(prompts, GREEDY)]
    assert [o.token_ids for o in on.generate(prompts, GREEDY)] == want
    shared = len(tokenizer(SHARED)["input_ids"]) // 16 * 16
    assert off.metrics.snapshot()["prefix_cache_hits"] == 0
    assert on.metrics.snapshot()["prefix_cache_hits"] >= 3 * shared > 0, "each later prompt reuses the shared blocks"
    assert [o.token_ids for o in on.generate(prompts, GREEDY)] == want, "a whole prompt cached, its last block computed"
    assert on.blocks.num_free == on.blocks.num_blocks


def test_a_preempted_sequence_is_readmitted_on_cached_blocks(target, tokenizer):
    """Two sequences of 8 blocks in a cache of 17: the second's ninth block preempts it; it comes back on the first's
    registered prompt blocks (and its output is the plain engine's)."""
    prompts, params = [SHARED * 2] * 2, SamplingParams(max_tokens=20)
    want = [o.token_ids for o in make_engine(target, tokenizer, prefix_caching=False).generate(prompts, params)]
    eng = make_engine(target, tokenizer, max_num_seqs=2, num_kv_blocks=17)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.metrics.num_preemptions > 0 and eng.metrics.prefix.hits >= 6 * 16


def test_a_draft_swapped_in_empties_the_cache(target, tokenizer, copy_draft):
    eng = make_engine(target, tokenizer, max_num_seqs=1)
    eng.generate([SHARED + "One.", SHARED + "Two."], GREEDY)
    assert len(eng.blocks.cache) > 0 and eng.metrics.prefix.hits > 0 and not eng.blocks.draft_keyed
    eng.swap_draft(copy_draft, [1, 2, 4])
    assert len(eng.blocks.cache) == 0 and eng.blocks.draft_keyed, "the blocks hold no K/V of this draft"
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_with_a_draft_a_block_waits_for_the_drafts_catch_up_and_matches_with_the_token_after_it():
    """The draft's K/V at a block's last position were computed with the next token: registration waits until the
    draft has caught up past the block, and a block matches only where that token matches too."""
    bm = _blocks()
    bm.draft_keyed = True
    seq = Sequence(list(range(11)), SamplingParams())
    bm.ensure(seq, seq.num_tokens)
    seq.num_cached = 10
    bm.register(seq)
    assert len(bm.cache) == 0, "the draft has not seen these positions yet"
    seq.draft_cached = 9
    bm.register(seq)
    assert len(bm.cache) == 2
    same = Sequence(list(range(8)) + [8, 60, 61], SamplingParams())
    assert bm.match_prefix(same) == 8 and same.draft_cached == 8, "the draft is caught up as far as the blocks go"
    other = Sequence(list(range(8)) + [70, 60, 61], SamplingParams())
    assert bm.match_prefix(other) == 4, "token 8 differs: block 1's draft K/V at position 7 are not this prompt's"


def test_a_speculative_engine_with_the_cache_is_lossless_and_hits_it(target, tokenizer, copy_draft):
    prompts = [SHARED + q for q in ("Why is the sky blue?", "Name a prime.", "What is Ray?", "Say hi.")]
    want = [o.token_ids for o in make_engine(target, tokenizer, prefix_caching=False).generate(prompts, GREEDY)]
    eng = make_engine(target, tokenizer, copy_draft, k=2, max_num_seqs=2)
    assert eng.blocks.prefix_caching and eng.blocks.draft_keyed
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    assert eng.metrics.prefix.hits > 0 and eng.metrics.spec.num_accepted_tokens > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks


CAPTURED = SamplingParams(capture_states=True)


def test_a_captured_request_takes_only_blocks_whose_hidden_rows_were_kept_and_takes_the_rows():
    """A capture keeps every position's hidden states: a block cached without its rows is computed again; a block
    whose rows a finished captured request left beside it is taken with them, in position order; the rows leave
    with the block (evicted, the cache emptied) and with an admission undone."""
    bm = _blocks(num_blocks=6)
    plain = _prefilled(bm, list(range(9)))  # blocks [0-3] [4-7] registered, by a request not captured
    assert bm.match_prefix(Sequence(list(range(9)), CAPTURED)) == 0, "no rows beside them: computed"
    first = Sequence(list(range(9)), CAPTURED)
    bm.free(plain)
    bm.use_prefix_cache(True, False)  # empty: first registers the blocks itself
    bm.match_prefix(first)
    bm.ensure(first, first.num_tokens)
    first.num_cached = first.num_tokens - 1
    bm.register(first)
    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # [T, W]: its positions' rows
    bm.keep_captured(first, rows)
    again = Sequence(list(range(8)) + [50, 51], CAPTURED)
    assert bm.match_prefix(again) == 8
    assert len(again.captured) == 2 and torch.equal(torch.cat(again.captured), rows), "both blocks' rows, in order"
    bm.unmatch(again)
    assert again.captured == [], "rows go with the blocks when the admission is undone"
    bm.keep_captured(first, rows + 1)
    assert torch.equal(bm.cache.rows(first.block_table[0]), rows[:4]), "the rows first kept stay"
    table = list(first.block_table)
    bm.free(first)
    bm.ensure(Sequence(list(range(100, 117)), SamplingParams()), 17)  # 5 blocks: the oldest idle one evicted
    assert bm.match_prefix(Sequence(list(range(9)), CAPTURED)) == 0
    assert bm.cache.rows(table[0]) is None and bm.cache.rows(table[1]) is not None, "the evicted block's rows left"
    bm.use_prefix_cache(True, False)
    assert bm.cache.rows(table[1]) is None, "an emptied cache keeps no rows"
