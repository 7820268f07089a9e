"""A request the engine cannot run fails alone; the step loop survives it and the requests in flight complete.

The poison is the one the HTTP probe found (``top_k = 2**63``: it passes SamplingParams but overflows
the int64 tensor the step builds). The HTTP edge refuses it now (tests/unit/serve/test_protocol.py);
here it is handed to the engine directly, as a caller that skips the edge would.
"""

from __future__ import annotations

import asyncio

import pytest

from eagleray.serve.engine import AsyncEngine, SamplingParams
from eagleray.serve.engine.async_engine import RequestFailed

from .conftest import PROMPTS, make_engine

GOOD = SamplingParams(max_tokens=12, ignore_eos=True)
POISON = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_k=2**63)  # sampled: greedy rows skip top-k


def _poison_breaks_a_step(target, tokenizer) -> None:
    engine = make_engine(target, tokenizer)
    engine.add_request("poison", POISON)
    with pytest.raises(Exception):  # noqa: B017 - whatever the step raises; the point is that it raises
        while engine.has_unfinished():
            engine.step()


async def _consume(engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str):
    try:
        return [o async for o in engine.add_request(prompt, params, rid)]
    except RequestFailed as err:
        return err


@pytest.mark.parametrize("poison_at", ["with_the_first", "while_running"])
def test_poisoned_request_fails_alone_while_8_others_complete(target, tokenizer, random_draft, poison_at):
    _poison_breaks_a_step(target, tokenizer)  # the premise: the poison really fails an engine step
    engine = AsyncEngine(make_engine(target, tokenizer, random_draft, k=3, max_num_seqs=16))
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(8)]
    reference = make_engine(target, tokenizer).generate(prompts, GOOD)

    async def main():
        good = [asyncio.create_task(_consume(engine, p, GOOD, f"good-{i}")) for i, p in enumerate(prompts)]
        if poison_at == "while_running":  # the good ones are through prefill and decoding when the poison arrives
            while engine.steps < 3:
                await asyncio.sleep(0.01)
        bad = asyncio.create_task(_consume(engine, "poison", POISON, "poison"))
        results = await asyncio.gather(*good, bad)
        after = await _consume(engine, "after", GOOD, "after")  # the loop still serves new requests
        assert engine.alive and not engine.died
        return results, after

    results, after = asyncio.run(main())
    *good, bad = results
    assert isinstance(bad, RequestFailed) and bad.request_id == "poison" and bad.alone, bad
    for stream, ref in zip(good, reference):
        assert not isinstance(stream, Exception), stream
        assert stream[-1].finished and [t for o in stream for t in o.delta_token_ids] == ref.token_ids
    assert not isinstance(after, Exception) and after[-1].finished
    assert engine.step_errors >= 1 and engine.requests_failed == 1 and engine.last_error
    engine.shutdown()


def test_died_is_true_only_after_a_started_loop_stopped(target, tokenizer):
    """``died`` (the Serve health check's question): never started -> False, running -> False, stopped -> True."""
    engine = AsyncEngine(make_engine(target, tokenizer))

    async def main():
        assert not engine.died and not engine.alive
        engine.ensure_started()
        await asyncio.sleep(0)
        assert engine.alive and not engine.died
        engine._task.cancel()
        await asyncio.sleep(0.05)
        assert engine.died and not engine.alive
        engine.ensure_started()  # restarts it
        assert engine.alive and not engine.died

    asyncio.run(main())
    engine.shutdown()
