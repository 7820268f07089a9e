"""t_join: the draft's catch-up over joined prompts, per token emitted (serve/engine/join_cost), in the adaptive
policy's cost of a speculative step."""

from __future__ import annotations

import pytest

from eagleray.serve.engine import SamplingParams
from eagleray.serve.engine.join_cost import LIVES, JoinCost
from eagleray.serve.engine.policy import AdaptivePolicy

from .conftest import PROMPTS, make_engine


def test_the_drafts_prefill_of_joining_sequences_counts_in_the_speculative_cost():
    """A speculative step that first catches the draft up on a joined sequence's prompt pays the draft's prefill: on
    the H200 at 32-64 sequences about one sequence joined a step and speculative steps cost 25-30% more than the
    policy predicted (1.27-1.34x predicted, 0.88-0.94x measured). That catch-up, per prompt position, times the prompt
    positions joined per token emitted, times the tokens a speculative step emits, is part of the step's cost."""
    accepted = [1] * 16 + [0] * 16  # a_0 = 0.5: a step emits 48 tokens
    policy = AdaptivePolicy(k_max=1, probe_interval=8)
    for _ in range(3):
        policy.observe_plain(32, 0.0017)
    for _ in range(40):
        policy.joins.finished(200, 50)  # 200 prompt positions, 50 tokens a sequence: 4 positions a token
    for i in range(4):
        policy.observe_spec(32, 1, 0.0018, 0.0002, accepted, *((0.004, 400) if i % 2 else (0.0, 0)))
    per_token = 0.008 / 800 * 4
    assert policy.joins.per_token == pytest.approx(per_token)
    join = per_token * 32 * policy.expected_tokens(1)
    assert policy.expected_tokens(1) == pytest.approx(1.5)
    assert policy.predicted_speedup(32, 1) == pytest.approx(1.5 * 1.7 / (1.8 + 0.2 + 1e3 * join))  # 0.77: plain
    assert policy.best(32) == (0, 1.0)
    assert policy.snapshot()["buckets"][32]["join_ms"] == pytest.approx(1e3 * join, abs=1e-3)


def test_a_rare_probes_catch_up_is_not_the_cost_of_every_speculative_step():
    """After a thousand plain steps a probe catches the draft up on the prompts of the 64 sequences running (0.3 s):
    that is the draft's prefill of 64 sequences, each paid once in its life, not the cost of each speculative step
    (counted so, it stopped speculation at 32-128 SmolLM2 sequences on the H200 for good, where k=4 steps gained)."""
    policy = AdaptivePolicy(k_max=1, probe_interval=8)
    for _ in range(1000):
        policy.observe_plain(64, 0.003)
    for _ in range(64):
        policy.joins.finished(100, 1000)  # sequences of 100 prompt positions live 1,000 tokens
    policy.observe_spec(64, 1, 0.0032, 0.0003, [1] * 64, 0.3, 64 * 100)  # the probe
    per_token = 0.3 / 6400 * 0.1
    assert policy.joins.per_token == pytest.approx(per_token)
    step = 0.0032 + 0.0003 + per_token * 64 * policy.expected_tokens(1)
    assert policy.predicted_speedup(64, 1) == pytest.approx(policy.expected_tokens(1) * 0.003 / step)
    assert policy.predicted_speedup(64, 1) > 1.03 and policy.best(64)[0] == 1


def test_the_first_catch_up_of_a_wave_of_prompts_is_spread_over_the_lives_of_its_sequences():
    """Four 512-token prompts join at once on the CPU; the first speculative step catches the draft up on all of them
    (155 ms) and emits 8 tokens. Per token emitted since the last speculative step (the rate's window before), that was
    ~20-75 ms a token, the policy decoded plain for the rest of the run and no later speculative step corrected it
    (7 speculative steps of 500, TTFT 0.54x vLLM's). The sequences' lives (64 tokens each) make it 0.6 ms a token and
    the policy speculates: plain 30 ms, k=1 steps 38 ms verifying, 1.5 ms drafting, E(1) 1.6."""
    policy = AdaptivePolicy(k_max=1, probe_interval=32)
    policy.joins.joined(530, 1)  # the load generator's first request, alone
    policy.joins.finished(530, 64)
    policy.joins.joined(4 * 530, 4)  # then four together
    accepted = [1, 1, 0, 1]  # 7 tokens a step: E(1) ~ 1.6 after the prior
    policy.observe_spec(4, 1, 0.038, 0.0015, accepted, 0.155, 4 * 530)
    policy.observe_spec(4, 1, 0.038, 0.0015, accepted)
    for _ in range(2):
        policy.observe_plain(4, 0.030)
    assert policy.joins.per_token == pytest.approx(0.155 / 2120 * 530 / 64)
    assert 0.0005 < policy.joins.per_token < 0.0007
    assert policy.best(4)[0] == 1, policy.snapshot()


def test_the_prompt_positions_per_token_come_from_finished_lives_then_from_what_joined_so_far():
    cost = JoinCost()
    assert cost.per_token == 0.0  # nothing measured
    cost.joined(1000, 2)
    cost.caught_up(0.1, 1000)  # 0.1 ms a position
    for _ in range(8):
        cost.emitted(2)
    assert cost.positions_per_token == pytest.approx(1000 / 18)  # no sequence finished: what joined over what emitted
    cost.finished(500, 50)
    assert cost.positions_per_token == pytest.approx(10.0)  # a finished life: its own ratio
    assert cost.per_token == pytest.approx(1e-4 * 10)
    cost.caught_up(0.5, 0)  # a catch-up over no prompt position (plain steps' tokens) is no join
    assert cost.seconds_per_position == pytest.approx(1e-4)
    for _ in range(LIVES):
        cost.finished(100, 100)
    assert cost.positions_per_token == pytest.approx(1.0)  # over the last LIVES lives


def test_the_engine_counts_each_joined_prompt_its_catch_up_and_its_life(target, tokenizer, copy_draft):
    """Of the positions the draft has not seen, the prompt's are its prefill (counted), the rest plain steps'
    (not); a speculative step right after a prefill records its catch-up as a join, over the prompt's positions, and
    a finished sequence its prompt positions and tokens."""
    from eagleray.serve.engine.draft_catch_up import prompt_part
    from eagleray.serve.engine.sequence import Sequence

    a = Sequence(list(range(10)), SamplingParams(max_tokens=8))
    a.output_token_ids = [1, 2, 3, 4, 5]  # 15 tokens, the draft saw none: 14 positions, 10 of them the prompt's
    b = Sequence(list(range(4)), SamplingParams(max_tokens=8))
    b.output_token_ids, b.draft_cached = [1] * 7, 4  # past its prompt: plain steps only
    assert prompt_part([a]) == (pytest.approx(10 / 14), 10)
    assert prompt_part([a, b]) == (pytest.approx(10 / 20), 10)
    assert prompt_part([b]) == (0.0, 0)
    engine = make_engine(target, tokenizer, copy_draft, k=2, max_num_seqs=1)
    caught = []
    real = engine.policy.joins.caught_up
    engine.policy.joins.caught_up = lambda s, p: caught.append((s, p)) or real(s, p)
    out = engine.generate(PROMPTS[-1:], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    prompt = len(out.prompt_token_ids)
    assert caught[0][0] > 0 and caught[0][1] == prompt  # the first step caught up the prompt
    assert all(p == 0 for _, p in caught[1:])  # no other
    assert list(engine.policy.joins._lives.pairs) == [(prompt, 6)]  # its life: its prompt's positions, 6 tokens
    assert engine.policy.joins.positions_per_token == pytest.approx(prompt / 6)
