"""GET /health's probe: one engine status call in flight, and it holds /health for ``wait_s`` in all.

The engine stand-in is the engine client's shape (``await engine.health()``); its answer is
released by the test, as a saturated engine handle releases a status call queued behind generation.
"""

import asyncio
import time

from eagleray.serve.ingress import HealthProbe


class Engine:
    """The engine client's ``health()``: each call waits for ``gate`` (set = an engine that answers at once)."""

    def __init__(self):
        self.gate, self.calls = asyncio.Event(), 0

    async def health(self) -> dict:
        self.calls += 1
        n = self.calls
        await self.gate.wait()
        return {"status": "ok", "steps": n}


async def _timed(probe: HealthProbe) -> tuple[float, int, dict]:
    t = time.perf_counter()
    code, body = await probe.status()
    return time.perf_counter() - t, code, body


def test_an_idle_engine_gives_a_fresh_status():
    async def run():
        engine = Engine()
        engine.gate.set()
        probe = HealthProbe(engine, wait_s=5.0)
        first, second = await _timed(probe), await _timed(probe)
        return first, second, engine.calls

    (s1, code1, body1), (s2, _, body2), calls = asyncio.run(run())
    assert code1 == 200 and body1["steps"] == 1 and body2["steps"] == 2 and calls == 2
    assert s1 < 2.5 and s2 < 2.5  # answered, not timed out


def test_a_slow_engine_holds_health_once_then_it_answers_from_the_last_status():
    async def run():
        engine = Engine()
        engine.gate.set()
        probe = HealthProbe(engine, wait_s=1.0)
        await probe.status()  # a status to fall back on
        engine.gate = asyncio.Event()  # now the status call queues
        first = await _timed(probe)
        second = await _timed(probe)  # the same call is still in flight: its window is spent
        calls_in_flight = engine.calls
        engine.gate.set()
        await asyncio.sleep(0.05)
        third = await _timed(probe)  # the queued call answered: its status is the one shown
        return first, second, calls_in_flight, third

    (s1, code1, body1), (s2, code2, body2), calls, (_, _, body3) = asyncio.run(run())
    assert s1 >= 0.9 and code1 == 200 and body1["steps"] == 1 and body1["status_age_s"] >= 0.9
    assert s2 < 0.5 and code2 == 200 and body2["steps"] == 1, s2  # no second wait on the same call
    assert calls == 2  # one call in flight at a time, not one per /health
    assert body3["steps"] >= 2


def test_no_status_yet_is_starting():
    async def run():
        probe = HealthProbe(Engine(), wait_s=0.05)
        return await probe.status()

    code, body = asyncio.run(run())
    assert code == 503 and body["status"] == "starting"
