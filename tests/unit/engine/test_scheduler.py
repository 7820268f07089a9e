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
