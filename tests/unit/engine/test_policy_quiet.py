"""The adaptive policy's plain choices counted off while a plain decision is kept (``quiet_due``): the same choices as scoring every step, for less
host time a plain step."""

from __future__ import annotations

import random

import pytest

from eagleray.serve.engine import policy as mod
from eagleray.serve.engine.policy import AdaptivePolicy


def _drive(seed: int, fast: bool, steps: int = 6000) -> tuple[list[int], AdaptivePolicy]:
    """A run of choices and observations: the batch size wanders over three buckets, the draft turns from useless to
    good to useless, a new draft is installed once; ``fast`` False forgets the choices decided in advance before
    every choice (what :meth:`AdaptivePolicy.choose` did before them)."""
    rng = random.Random(seed)
    p = AdaptivePolicy(4, probe_interval=8, max_probe_interval=256)
    ks, batch = [], 1
    for step in range(steps):
        if rng.random() < 0.01:
            batch = rng.choice([1, 1, 2, 8])
        if step == steps // 2:
            p.enable()
        good = steps // 4 <= step < steps // 3
        if not fast:
            for c in p.costs.values():
                c.quiet_due = 0.0
        k = p.choose(batch)
        ks.append(k)
        plain = 0.001 * batch**0.2 * rng.uniform(0.9, 1.3)
        if k == 0:
            p.observe_plain(batch, plain)
        else:
            accepted = [sum(rng.random() < 0.8 for _ in range(k)) if good else 0 for _ in range(batch)]
            p.observe_spec(batch, k, plain * 1.05, 0.0001 * k, accepted)
    return ks, p


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_choices_decided_in_advance_are_the_choices_scored_every_step(seed):
    fast_ks, fast = _drive(seed, True)
    slow_ks, slow = _drive(seed, False)
    assert fast_ks == slow_ks
    assert {b: c.chosen for b, c in fast.costs.items()} == {b: c.chosen for b, c in slow.costs.items()}
    assert (fast._since_probe, fast._probe_interval) == (slow._since_probe, slow._probe_interval)
    assert 0 < fast_ks.count(0) < len(fast_ks) and len(set(fast_ks)) > 2  # plain, probes and speculation all ran


def test_steady_plain_decoding_scores_once_per_redecide_choices(monkeypatch):
    """With a useless draft the policy scores every k once per REDECIDE plain choices and otherwise counts the choices
    off (the per-step cost a plain engine does not pay)."""
    p = AdaptivePolicy(4, probe_interval=100_000, max_probe_interval=100_000)
    for _ in range(mod.EVIDENCE):
        p.observe_spec(1, 4, 0.020, 0.004, [0], 0.0)
        p.observe_plain(1, 0.010)
    slow = []
    real = AdaptivePolicy._choose
    monkeypatch.setattr(AdaptivePolicy, "_choose", lambda self, c, b: slow.append(b) or real(self, c, b))
    assert [p.choose(1) for _ in range(4 * mod.REDECIDE)] == [0] * (4 * mod.REDECIDE)
    assert len(slow) == 4
    assert p.costs[1].chosen[0] == 4 * mod.REDECIDE


def test_a_plain_step_queues_its_time_and_the_median_is_taken_when_read():
    p = AdaptivePolicy(4)
    for seconds in (0.003, 0.001, 0.002):
        p.observe_plain(2, seconds)
    c = p.costs[2]
    assert c.plain_stale and c.plain == 0.002 and not c.plain_stale
    p.observe_plain(2, 0.0005)
    assert c.plain == pytest.approx(0.0015)  # a new step makes the kept median stale
    assert c.plain_steps == 4 and c.wall[0][:3] == [4, 8, 8]


def test_a_kept_plain_decision_that_turns_speculative_when_rescored_speculates_from_then_on():
    """Plain steps that grow dearer make speculation pay at the next scoring: from there on the choices are
    speculative (nothing counted off from the plain decision before)."""
    p = AdaptivePolicy(4, probe_interval=100_000, max_probe_interval=100_000)
    for _ in range(mod.EVIDENCE):  # every draft accepted, but verifying costs 5 plain steps: plain pays more
        p.observe_spec(1, 4, 0.050, 0.004, [4], 0.0)
        p.observe_plain(1, 0.010)
    assert p.choose(1) == 0
    for _ in range(mod.REDECIDE):
        p.observe_plain(1, 0.030)  # now 5 tokens for 0.054 s beat 0.030 s a token
    ks = [p.choose(1) for _ in range(mod.REDECIDE + 3)]
    assert ks[: mod.REDECIDE - 1] == [0] * (mod.REDECIDE - 1)  # the kept decision, until its rescoring
    assert ks[mod.REDECIDE - 1 :] == [4] * 4
