"""The windowed token rate matches what clients measure (was 896 tok/s on /health while clients measured 6.4)."""

from __future__ import annotations

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
