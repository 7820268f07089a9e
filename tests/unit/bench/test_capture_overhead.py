"""The capture-overhead benchmark (jobs/bench/capture_overhead): how passes become the overhead it reports."""

import pytest

from eagleray.jobs.bench import capture_overhead as co


def _pass(tokens: int, seconds: float) -> dict:
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "failed": 0}


def test_overhead_over_all_passes_per_round_and_between_medians():
    off = [_pass(100, 1.0), _pass(100, 2.0), _pass(100, 1.25)]  # 100, 50, 80 tok/s
    on = [_pass(90, 1.0), _pass(100, 2.0), _pass(100, 1.0)]  # 90, 50, 100 tok/s
    got = co.summary({"off": off, "on": on})
    assert got["overhead"] == pytest.approx(1 - (290 / 4.0) / (300 / 4.25))
    assert got["per_round"] == pytest.approx([0.1, 0.0, -0.25])
    assert got["median_tok_s"] == {"off": 80.0, "on": 90.0}
    assert got["overhead_of_medians"] == pytest.approx(1 - 90 / 80)


def test_bad_rounds_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--overhead-rounds"):
        co.shift.overhead_plan(0)
    assert co.parse(["--overhead-rounds", "2"]).overhead_rounds == 2
