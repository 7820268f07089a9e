"""The Serve engine replica (EngineServer, constructed directly: no Ray needed) builds its engine and loads a
hot-swapped draft in the thread that steps the engine (see serve/engine/async_engine.py on OpenMP teams)."""

from __future__ import annotations

import asyncio
import threading

from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.serve.engine_server import EngineServer


def test_the_replica_builds_and_swaps_its_draft_in_the_engine_thread(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path / "home"))  # the random draft's cache
    server = EngineServer(
        {
            "model_name": "tiny",
            "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": 256},
            "draft": {"source": "random", "num_speculative_tokens": 2},
            "kv_cache_gib": 0.05,
        }
    )
    loaded_in = []
    real = server.drafts.prepare
    monkeypatch.setattr(server.drafts, "prepare", lambda resolved: loaded_in.append(threading.get_ident()) or real(resolved))
    other = make_random_draft(TargetSpec.from_dir(tiny_target), tmp_path / "other-draft", seed=1)

    async def main():
        return await server.loop.in_engine_thread(threading.get_ident), await server.drafts.swap(str(other))

    try:
        engine_thread, record = asyncio.run(main())
    finally:
        server.loop.shutdown()
    assert server.loop.built_in_thread == engine_thread != threading.get_ident(), "built in the stepping thread"
    assert record.outcome == "swapped" and loaded_in == [engine_thread], "the candidate loaded in the engine thread"
