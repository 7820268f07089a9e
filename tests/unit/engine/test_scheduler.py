from __future__ import annotations

from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.sampling import SamplingParams
from eagleray.serve.engine.scheduler import Scheduler
from eagleray.serve.engine.sequence import Sequence, SequenceStatus


def _seq(n):
    return Sequence(list(range(n)), SamplingParams())


def test_join_and_leave_between_steps():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=1000)
    a, b, c = _seq(5), _seq(6), _seq(7)
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule(lookahead=1)
    assert first.is_prefill and first.seqs == [a, b]  # max_num_seqs caps admission
    for s in first.seqs:  # pretend the prefill produced one token
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1
    decode = sched.schedule(lookahead=3)
    assert not decode.is_prefill and decode.seqs == [a, b]
    sched.finish(a)  # a leaves ...
    joined = sched.schedule(lookahead=1)
    assert joined.is_prefill and joined.seqs == [c]  # ... and c joins
    assert a.status is SequenceStatus.FINISHED and a.block_table == []


def test_token_budget_and_kv_capacity():
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_num_batched_tokens=10)
    big, small = _seq(12), _seq(8)
    sched.add(big)
    sched.add(small)
    batch = sched.schedule(lookahead=1)
    assert batch.seqs == [big]  # small would exceed the token budget and the free blocks
    big.output_token_ids.append(1)
    big.num_cached = big.num_tokens - 1
    nxt = sched.schedule(lookahead=1)  # small still does not fit next to big: big decodes alone
    assert not nxt.is_prefill and nxt.seqs == [big] and list(sched.waiting) == [small]


def test_preempts_newest_when_cache_is_short():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _seq(7), _seq(7)
    sched.add(a)
    sched.add(b)
    assert sched.schedule(lookahead=1).seqs == [a, b]  # 2 blocks each, cache full
    for s in (a, b):
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1
    batch = sched.schedule(lookahead=4)  # a needs a third block: b is preempted
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and sched.num_preemptions == 1
    assert sched.waiting[0] is b


def _running(sched: Scheduler, n: int) -> list[Sequence]:
    """``n`` sequences admitted and decoded once (each has its first token)."""
    seqs = [_seq(4) for _ in range(n)]
    for s in seqs:
        sched.add(s)
    assert sched.schedule(lookahead=1).seqs == seqs
    for s in seqs:
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1
    return seqs


def test_at_saturation_free_slots_wait_for_company_then_join_in_one_prefill():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=16, max_num_batched_tokens=1000, join_wait_steps=3)
    assert sched.join_min == 2
    running = _running(sched, 16)
    queued = [_seq(4) for _ in range(5)]
    for s in queued:
        sched.add(s)
    sched.finish(running[0])  # one slot free, five waiting: a join of one would be a prefill step of its own
    assert not sched.schedule(lookahead=1).is_prefill
    sched.finish(running[1])  # a second slot frees up while it waits: both join in one prefill step
    joined = sched.schedule(lookahead=1)
    assert joined.is_prefill and joined.seqs == queued[:2]


def test_free_slots_wait_at_most_join_wait_steps():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=16, max_num_batched_tokens=1000, join_wait_steps=3)
    running = _running(sched, 16)
    queued = [_seq(4) for _ in range(5)]
    for s in queued:
        sched.add(s)
    sched.finish(running[0])
    kinds = [sched.schedule(lookahead=1).is_prefill for _ in range(4)]
    assert kinds == [False, False, False, True]  # three decode steps held, then the lone join goes in


def test_joins_go_in_at_once_below_saturation_or_without_a_wait():
    # waiting fits the free slots (no queue beyond them): no waiting, whatever join_wait_steps says
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=16, max_num_batched_tokens=1000, join_wait_steps=8)
    running = _running(sched, 16)
    sched.finish(running[0])
    lone = _seq(4)
    sched.add(lone)
    assert sched.schedule(lookahead=1).seqs == [lone]
    # join_wait_steps 0 (the CPU default): a lone join at saturation goes in at once
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=16, max_num_batched_tokens=1000, join_wait_steps=0)
    running = _running(sched, 16)
    for _ in range(5):
        sched.add(_seq(4))
    sched.finish(running[0])
    assert sched.schedule(lookahead=1).is_prefill


def test_join_wait_steps_default_is_per_device():
    import torch

    from eagleray.serve.engine import EngineConfig

    bm = BlockManager(8, 4)
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cuda")).join_wait_steps == 8
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cpu")).join_wait_steps == 0
    assert Scheduler.for_engine(bm, EngineConfig(join_wait_steps=2), torch.device("cpu")).join_wait_steps == 2


def test_an_engine_whose_joins_wait_emits_the_same_tokens_in_fewer_prefill_steps(target, tokenizer, copy_draft):
    from eagleray.serve.engine import SamplingParams as Params

    from .conftest import PROMPTS, make_engine

    prompts = [p + f" {i}" for i in range(6) for p in PROMPTS]  # 24 requests, 16 slots: a queue
    params = [Params(max_tokens=4 + (i * 7) % 13, ignore_eos=True) for i in range(len(prompts))]  # finish at different steps
    runs = {}
    for wait in (0, 6):
        engine = make_engine(target, tokenizer, copy_draft, k=2, max_num_seqs=16, join_wait_steps=wait)
        runs[wait] = ([o.token_ids for o in engine.generate(prompts, params)], engine.metrics.prefill.steps)
    assert runs[6][0] == runs[0][0]
    assert runs[6][1] < runs[0][1], runs


def _queue(sched: Scheduler, *lengths: int) -> list[Sequence]:
    """Sequences with prompts of ``lengths`` tokens, queued in order."""
    seqs = [_seq(n) for n in lengths]
    for s in seqs:
        sched.add(s)
    return seqs


def _chunked(num_blocks: int = 64, budget: int = 10, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs, budget, chunked_prefill=True)


def _prefilled(batch) -> None:
    """Pretend a prefill step ran: the partial prompt's chunk committed, every other sequence got a token."""
    if batch.chunk:
        batch.seqs[-1].num_cached += batch.chunk
    for s in batch.completing:
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1


def test_a_prompt_longer_than_the_budget_prefills_in_chunks_holding_its_blocks():
    sched = _chunked(budget=10)
    (long,) = _queue(sched, 25)
    chunks = []
    for _ in range(3):
        batch = sched.schedule(lookahead=1)
        assert batch.is_prefill and batch.seqs == [long]
        chunks.append(batch.chunk)
        if batch.chunk:  # partial: first in line, all 7 blocks held, not running
            assert list(sched.waiting) == [long] and sched.running == [] and len(long.block_table) == 7
        _prefilled(batch)
    assert chunks == [10, 10, 0]  # 10 + 10 tokens, then the last 5 complete the prompt and draw its first token
    assert sched.running == [long] and not sched.waiting and long.num_cached == 25


def test_the_budget_left_is_filled_by_the_next_prompts_first_tokens_and_running_sequences_decode_in_and_between_chunks():
    sched = _chunked(budget=10)
    a, b = _queue(sched, 6, 9)
    first = sched.schedule(lookahead=1)
    assert first.seqs == [a, b] and first.chunk == 4 and first.completing == first.joining == [a]  # 6 + 4 of b
    _prefilled(first)
    assert sched.running == [a] and sched.waiting[0] is b and b.num_cached == 4
    between = sched.schedule(lookahead=1)
    assert not between.is_prefill and between.seqs == [a]  # a decode step between two chunks
    a.output_token_ids.append(1)
    a.num_cached = a.num_tokens - 1
    (c,) = _queue(sched, 3)
    rest = sched.schedule(lookahead=1)  # a's token in the prompts' forward, b's last 5 tokens, c whole (1 + 5 + 3)
    assert rest.is_prefill and rest.seqs == [a, b, c] and rest.decoding == 1 and rest.chunk == 0
    assert rest.joining == [b, c] and len(a.block_table) == 2  # a's next position has its slot
    _prefilled(rest)
    assert sched.running == [a, b, c] and not sched.waiting


def test_running_sequences_take_their_next_slots_before_a_prompt_takes_blocks():
    sched = _chunked(num_blocks=3, budget=10)
    (a,) = _queue(sched, 4)  # one block: its first token's position needs a second
    _prefilled(sched.schedule(lookahead=1))
    (b,) = _queue(sched, 7)  # two blocks: with a's second, more than the two free
    batch = sched.schedule(lookahead=1)
    assert not batch.is_prefill and batch.seqs == [a] and len(a.block_table) == 2 and list(sched.waiting) == [b]
    sched.finish(a)
    assert sched.schedule(lookahead=1).seqs == [b]


def test_running_sequences_decode_in_a_prefill_step_only_if_the_cache_has_a_slot_for_each():
    sched = _chunked(num_blocks=3, budget=10)
    a, b = _queue(sched, 4, 4)  # a block each; both need a second for their first token's position, one is free
    _prefilled(sched.schedule(lookahead=1))
    (c,) = _queue(sched, 3)
    batch = sched.schedule(lookahead=1)
    assert batch.is_prefill and batch.seqs == [c] and batch.decoding == 0 and len(a.block_table) == 1


def test_without_chunked_prefill_a_step_admits_whole_prompts():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b, long = _queue(sched, 6, 9, 25)
    first = sched.schedule(lookahead=1)
    assert first.seqs == [a] and first.chunk == 0  # b would exceed the budget: it waits whole
    _prefilled(first)
    second = sched.schedule(lookahead=1)
    assert second.is_prefill and second.seqs == [b]  # prefill first: no decode step in between
    _prefilled(second)
    alone = sched.schedule(lookahead=1)
    assert alone.seqs == [long] and alone.chunk == 0  # longer than the budget: it prefills whole, alone


def test_a_partial_prompt_gives_its_blocks_back_before_a_running_sequence_is_preempted():
    sched = _chunked(num_blocks=6, budget=8)
    a, long = _queue(sched, 7, 13)  # a: 2 blocks; long: 4 blocks (13 positions), the cache's 6 all held
    first = sched.schedule(lookahead=1)
    assert first.seqs == [a, long] and first.chunk == 1
    _prefilled(first)
    assert len(long.block_table) == 4 and long.num_cached == 1
    decode = sched.schedule(lookahead=4)  # a needs a third block: the partial prompt frees its four
    assert decode.seqs == [a] and sched.num_preemptions == 0
    assert long.block_table == [] and long.num_cached == 0 and sched.waiting[0] is long  # it starts again later


def test_a_draft_swap_releases_a_partial_prompt():
    sched = _chunked(budget=8)
    a, long = _queue(sched, 7, 13)
    _prefilled(sched.schedule(lookahead=1))
    long.pending_aux.append(None, 0, 1)  # rows of the old draft's aux layers
    sched.preempt_all()
    assert long.block_table == [] and long.num_cached == 0 and len(long.pending_aux) == 0
    assert list(sched.waiting) == [a, long] and sched.running == []


def test_chunked_prefill_default_is_per_device():
    import torch

    from eagleray.serve.engine import EngineConfig

    bm = BlockManager(8, 4)
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cpu")).chunked_prefill is True
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cuda")).chunked_prefill is False
    assert Scheduler.for_engine(bm, EngineConfig(chunked_prefill=False), torch.device("cpu")).chunked_prefill is False


def test_running_sequences_that_fill_the_budget_leave_no_room_for_a_prompt():
    sched = _chunked(budget=16, max_num_seqs=20)
    running = _queue(sched, *[1] * 16)
    _prefilled(sched.schedule(lookahead=1))  # 16 one-token prompts: the whole budget
    (prompt,) = _queue(sched, 4)
    batch = sched.schedule(lookahead=1)
    assert not batch.is_prefill and len(batch.seqs) == 16  # 16 decode rows fill the budget: the prompt waits
    for s in running:
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1
    sched.finish(running[0])
    mixed = sched.schedule(lookahead=1)  # one token of room: the prompt's first
    assert mixed.is_prefill and mixed.decoding == 15 and mixed.seqs[-1] is prompt and mixed.chunk == 1
