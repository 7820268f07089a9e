"""The windowed token rate matches what clients measure (was 896 tok/s on /health while clients measured 6.4)."""

from __future__ import annotations

import collections

import pytest

from eagleray.serve.prometheus import ServeMetrics


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def metrics():
    m = ServeMetrics("window-test")
    m._clock = Clock()
    return m


def _stream(m: ServeMetrics, tokens: int, seconds: float) -> None:
    """One request streaming ``tokens`` tokens evenly over ``seconds``, then finishing."""
    for _ in range(tokens):
        m._clock.t += seconds / tokens
        m.record_tokens(1)
    m.record_request(tokens, {"num_drafts": tokens, "num_draft_tokens": 3 * tokens, "num_accepted_tokens": tokens})


def test_rate_is_tokens_over_the_time_they_took(metrics):
    _stream(metrics, 64, 10.0)  # 6.4 tokens/s, as the client measured
    assert metrics.to_dict()["tokens_per_s"] == pytest.approx(6.4, rel=0.05)
    assert metrics.to_dict()["tau"] == pytest.approx(2.0)


def test_rate_decays_when_idle(metrics):
    _stream(metrics, 64, 10.0)
    metrics._clock.t += 31.0  # past the 30 s window
    assert metrics.to_dict()["tokens_per_s"] == 0.0


class NoWalk(collections.deque):
    """The window's deque, refusing to be walked: the per-event path must not pass over the window's entries."""

    def __iter__(self):
        raise AssertionError("the window was walked on a streamed event")


def test_a_streamed_event_does_not_walk_the_window(metrics):
    _stream(metrics, 3000, 20.0)  # a busy replica's 30 s window holds thousands of events
    metrics._recent = NoWalk(metrics._recent)
    _stream(metrics, 640, 40.0)  # all of it expires on the way: dropped from the sums, not summed again
    rate = metrics.to_dict()["tokens_per_s"]
    tokens_in_window = sum(r[1] for r in collections.deque.__iter__(metrics._recent))
    assert metrics._sums[0] == tokens_in_window
    assert metrics._sums[1:] == [640, 640]  # the first request's drafts left the window with it
    assert rate == pytest.approx(tokens_in_window / (metrics._clock.t - metrics._recent[0][0]))


def test_gauges_set_at_most_once_a_second_while_streaming_and_at_every_finish(metrics):
    for _ in range(100):  # 100 events in 0.5 s
        metrics._clock.t += 0.005
        metrics.record_tokens(1)
    assert metrics.gauge_sets == 1  # the first event; the snapshot follows every event
    assert metrics.snapshot["tokens_per_s"] == pytest.approx(100.0)
    metrics._clock.t += 0.6
    metrics.record_tokens(1)
    assert metrics.gauge_sets == 2
    metrics.record_request(101, {"num_drafts": 2, "num_accepted_tokens": 2})
    assert metrics.gauge_sets == 3 and metrics.snapshot["tau"] == pytest.approx(2.0)


def test_health_reports_the_rates_two_terms(metrics):
    _stream(metrics, 64, 10.0)
    d = metrics.to_dict()
    assert d["window_tokens"] == 64 and d["window_s"] == pytest.approx(10.0 - 10.0 / 64)  # from the first token
    assert d["tokens_per_s"] == pytest.approx(d["window_tokens"] / d["window_s"])
    metrics._clock.t += 31.0
    d = metrics.to_dict()
    assert d["window_tokens"] == 0 and d["window_s"] == 0.0 and d["tokens_per_s"] == 0.0
