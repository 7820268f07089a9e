"""The acceptance watchdog and the adaptive speculation policy."""

from __future__ import annotations

import logging

from eagleray.platform.schemas import PolicyConfig
from eagleray.serve.engine import SamplingParams
from eagleray.serve.engine.policy import AcceptanceWatchdog, AdaptivePolicy

from .conftest import PROMPTS, make_engine


def test_watchdog_fires_with_untrained_draft(target, tokenizer, random_draft, caplog):
    engine = make_engine(target, tokenizer, random_draft, k=2, policy={"watchdog_window": 8, "on_low_acceptance": "disable"})
    with caplog.at_level(logging.WARNING):
        engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    snap = engine.metrics.snapshot()
    assert snap["spec_decode_watchdog_fired"] == 1 and snap["spec_decode_enabled"] == 0
    assert snap["spec_decode_mean_acceptance_length"] < 1.05
    warnings = [r for r in caplog.records if r.getMessage().startswith("speculative acceptance watchdog")]
    assert len(warnings) == 1, "the watchdog warns once"
    assert engine.metrics.plain.steps > 0, "after 'disable' the engine decodes without speculation"


def test_watchdog_quiet_when_drafts_are_accepted():
    fired = []
    dog = AcceptanceWatchdog(PolicyConfig(watchdog_window=4), lambda action, tau: fired.append((action, tau)))
    for n in [0, 2, 1, 3, 0, 2]:
        dog.observe(n)
    assert not dog.fired and not fired
    for _ in range(4):
        dog.observe(0)
    assert dog.fired and fired == [("warn", 1.0)]


def _drive(policy, rates, steps):
    """Feed the policy synthetic throughput: rates[k] tokens/s for a step with draft length k."""
    chosen = []
    for _ in range(steps):
        k = policy.choose()
        chosen.append(k)
        policy.observe(k, tokens=rates(k), seconds=1.0)
    return chosen


def test_adaptive_turns_speculation_off_when_slower_and_back_on():
    policy = AdaptivePolicy(k_max=4, probe_interval=4)
    slow = lambda k: 10 if k == 0 else 6  # noqa: E731  speculation slower at every k
    _drive(policy, slow, 80)
    assert not policy.speculating and policy.k == 1
    fast = lambda k: 10 if k == 0 else 10 + 5 * k  # noqa: E731  now it pays
    chosen = _drive(policy, fast, 80)
    assert policy.speculating and policy.k > 1
    assert sum(k > 0 for k in chosen[-20:]) >= 15, "mostly speculative steps once it pays"


def test_adaptive_lowers_k_first():
    policy = AdaptivePolicy(k_max=4, probe_interval=4)
    rates = lambda k: {0: 10, 1: 14, 2: 13, 3: 9, 4: 8, 5: 7}[k]  # noqa: E731
    _drive(policy, rates, 60)
    assert policy.speculating and policy.k in (1, 2)
