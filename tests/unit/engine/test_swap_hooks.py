"""AsyncEngine.between_steps runs in the engine thread between steps; watchdog rollback restores aux layers."""

from __future__ import annotations

import asyncio
import threading

from eagleray.serve.engine import AsyncEngine, SamplingParams
from tests.unit.engine.conftest import NUM_LAYERS, PROMPTS, make_engine

PARAMS = SamplingParams(max_tokens=12)


def test_between_steps_runs_in_engine_thread_between_steps(target, tokenizer, copy_draft):
    engine = make_engine(target, tokenizer, copy_draft, k=2)
    aengine = AsyncEngine(engine)
    in_step, seen = threading.Event(), []
    step = engine.step

    def traced_step():
        in_step.set()
        try:
            return step()
        finally:
            in_step.clear()

    engine.step = traced_step

    def probe():
        seen.append((threading.current_thread().name, in_step.is_set()))
        return len(seen)

    async def main():
        streams = [asyncio.ensure_future(aengine.generate(p, PARAMS)) for p in PROMPTS[:2]]
        results = []
        for _ in range(5):
            await asyncio.sleep(0)
            results.append(await aengine.between_steps(probe))
        return results, await asyncio.gather(*streams)

    results, outs = asyncio.run(main())
    aengine.shutdown()
    assert results == [1, 2, 3, 4, 5]
    assert all(name.startswith("eagleray-engine") and not stepping for name, stepping in seen)
    assert all(o.finished for o in outs)


def test_watchdog_rollback_restores_aux_layers(target, tokenizer, copy_draft, random_draft):
    """Draft A reads layers [1, 2, N]; draft B (swapped in) reads others; the rollback to A must restore A's."""
    engine = make_engine(target, tokenizer, copy_draft, k=2)
    plain = make_engine(target, tokenizer).generate(PROMPTS[:2], PARAMS)
    a_aux = [1, 2, NUM_LAYERS]
    assert target.aux_layer_ids == a_aux
    try:
        engine.swap_draft(random_draft, aux_layer_ids=[0, 1, 3])  # B captures different layers
        assert target.aux_layer_ids == [0, 1, 3] and engine.drafts.previous_aux == a_aux and engine.previous_draft is copy_draft
        engine._on_low_acceptance("rollback", 0.1)
        outs = engine.generate(PROMPTS[:2], PARAMS)  # the first step rolls back to A
        assert engine.current_draft is copy_draft
        assert target.aux_layer_ids == a_aux
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    finally:
        target.set_aux_layers(a_aux)
