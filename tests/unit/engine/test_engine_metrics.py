"""The engine's step metrics as /health shows them: steps, whole-step time and busy seconds by step kind."""

from eagleray.serve.engine.metrics import EngineMetrics


def test_snapshot_has_steps_and_their_times_by_kind():
    m = EngineMetrics()
    m.prefill.add(tokens=2, seconds=0.5, whole_seconds=0.6)
    for _ in range(4):
        m.plain.add(tokens=8, seconds=0.09, whole_seconds=0.1)
    m.speculative.add(tokens=20, seconds=0.3, whole_seconds=0.4)
    s = m.snapshot()
    assert (s["prefill_steps"], s["plain_decode_steps"], s["spec_decode_steps"]) == (1, 4, 1)
    assert (s["prefill_step_ms"], s["plain_decode_step_ms"], s["spec_decode_step_ms"]) == (600.0, 100.0, 400.0)
    assert s["busy_seconds"] == 1.4 and s["generation_tokens"] == 54
    assert EngineMetrics().snapshot()["plain_decode_step_ms"] == 0.0  # no step yet: no division by zero
