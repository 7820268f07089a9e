"""engine.wave_prefill_tokens: a wave of prompts too large for one step joins one prompt a step."""

from __future__ import annotations

import pytest

from eagleray.serve.engine import SamplingParams
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.scheduler import Scheduler
from eagleray.serve.engine.sequence import Sequence

from .conftest import make_engine


def _seq(n: int) -> Sequence:
    return Sequence(list(range(n)), SamplingParams())


def _prefilled(batch) -> None:
    for s in batch.completing:  # as the engine's commit: a token, the prompt's positions cached
        s.output_token_ids.append(1)
        s.num_cached = s.num_tokens - 1


def _scheduler(wave_tokens: int, chunked: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=1000, chunked_prefill=chunked, wave_tokens=wave_tokens
    )


def test_a_wave_over_the_threshold_joins_one_prompt_a_step_then_the_running_decode():
    sched = _scheduler(wave_tokens=25)
    old = _seq(4)
    sched.add(old)
    _prefilled(sched.schedule(lookahead=1))  # a sequence already running
    wave = [_seq(10) for _ in range(3)]  # 30 tokens > 25
    for s in wave:
        sched.add(s)
    steps = []
    for _ in range(3):
        batch = sched.schedule(lookahead=1)
        steps.append((batch.is_prefill, batch.seqs))
        _prefilled(batch)
    assert steps == [(True, [wave[0]]), (True, [wave[1]]), (True, [wave[2]])]  # no decode rows beside them
    late = _seq(5)
    sched.add(late)  # a prompt that came during the wave waits: after a wave the running sequences decode first
    after = sched.schedule(lookahead=1)
    assert not after.is_prefill and after.seqs == [old, *wave]
    _prefilled(after)
    assert sched.schedule(lookahead=1).seqs == [old, *wave, late]  # then it joins, with their decode rows


def test_one_long_prompt_is_no_wave_the_running_decode_in_its_forward():
    sched = _scheduler(wave_tokens=25)
    old = _seq(4)
    sched.add(old)
    _prefilled(sched.schedule(lookahead=1))
    long = _seq(30)
    sched.add(long)
    batch = sched.schedule(lookahead=1)
    assert batch.seqs == [old, long] and batch.decoding == 1


def test_a_wave_within_the_threshold_prefills_together_with_the_running_rows():
    sched = _scheduler(wave_tokens=30)
    old = _seq(4)
    sched.add(old)
    _prefilled(sched.schedule(lookahead=1))
    wave = [_seq(10) for _ in range(3)]
    for s in wave:
        sched.add(s)
    batch = sched.schedule(lookahead=1)
    assert batch.is_prefill and batch.seqs == [old, *wave] and batch.decoding == 1


def test_off_a_large_wave_prefills_together():
    sched = _scheduler(wave_tokens=0)
    wave = [_seq(10) for _ in range(3)]
    for s in wave:
        sched.add(s)
    assert sched.schedule(lookahead=1).seqs == wave


def test_the_wave_is_the_prompts_waiting_when_it_starts_and_ends_with_an_empty_queue():
    sched = _scheduler(wave_tokens=15)
    first = [_seq(10), _seq(10)]
    for s in first:
        sched.add(s)
    batch = sched.schedule(lookahead=1)
    assert batch.seqs == [first[0]] and sched.wave_left == 1
    _prefilled(batch)
    sched.abort(first[1])  # the wave's last member leaves before it joins
    assert sched.schedule(lookahead=1).seqs == [first[0]] and sched.wave_left == 0  # a decode step; the wave is over
    late = [_seq(5), _seq(5)]  # 10 tokens: within the threshold, together
    for s in late:
        sched.add(s)
    assert sched.schedule(lookahead=1).seqs[-2:] == late


@pytest.mark.parametrize("k", [0, 2])
def test_greedy_outputs_are_the_same_with_waves_one_prompt_a_step(target, tokenizer, copy_draft, k):
    prompts = ["hello world " * 3, "def add(a, b):\n" * 2, "The quick brown fox jumps", "Ray Serve exposes HTTP"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    kw = {"k": k} if k else {}
    draft = copy_draft if k else None
    runs = {}
    for wave in (0, 8):
        engine = make_engine(target, tokenizer, draft, wave_prefill_tokens=wave, **kw)
        runs[wave] = [o.token_ids for o in engine.generate(prompts, params)]
        if wave:
            assert engine.metrics.prefill.steps >= len(prompts)  # one prompt a step
    assert runs[0] == runs[8]


def test_the_wave_threshold_default_is_per_device():
    import torch

    from eagleray.serve.engine import EngineConfig
    from eagleray.serve.engine.startup import WAVE_PREFILL_TOKENS_CPU

    bm = BlockManager(8, 4)
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cpu")).wave_tokens == WAVE_PREFILL_TOKENS_CPU > 0
    assert Scheduler.for_engine(bm, EngineConfig(), torch.device("cuda")).wave_tokens == 0
    assert Scheduler.for_engine(bm, EngineConfig(wave_prefill_tokens=7), torch.device("cuda")).wave_tokens == 7
