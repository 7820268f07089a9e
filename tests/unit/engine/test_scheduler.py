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
