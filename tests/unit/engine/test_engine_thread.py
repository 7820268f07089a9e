"""The engine's one thread: built, stepped and given its drafts there (AsyncEngine's note: on CPU, torch work
in a second thread gives libgomp a second thread team, and every prefill then paid ~3x)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from eagleray.serve.engine import AsyncEngine, SamplingParams

from .conftest import make_engine


def test_build_makes_the_engine_in_the_thread_that_steps_it(target, tokenizer, monkeypatch):
    engine = AsyncEngine.build(lambda: make_engine(target, tokenizer))
    stepped = set()
    real = engine.engine.step
    monkeypatch.setattr(engine.engine, "step", lambda: stepped.add(threading.get_ident()) or real())

    async def main():
        outs = [o async for o in engine.add_request("hello world", SamplingParams(max_tokens=4, ignore_eos=True))]
        return outs, await engine.in_engine_thread(threading.get_ident)

    try:
        outs, engine_thread = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    assert stepped == {engine_thread} and engine.built_in_thread == engine_thread != threading.get_ident()


def test_a_build_that_raises_raises_and_leaves_no_engine_thread():
    def broken():
        raise ValueError("target: no such model")

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(broken)
    left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("eagleray-engine")]
    for t in left:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in left)
