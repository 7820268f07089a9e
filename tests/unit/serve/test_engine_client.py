"""The ingress's in-process engine client (``ingress: engine``): a real EngineServer on the tiny target, no Ray.

A stream the ingress stops early (``cancel()``, what it does when a client leaves before the last token) must
abort the engine request at once, not leave it generating to ``max_tokens``; a whole stream ends with its
finished delta."""

from __future__ import annotations

import asyncio

import pytest

from eagleray.serve.engine_client import LocalClient
from eagleray.serve.engine_server import EngineServer
from eagleray.serve.ingress import sampling_payload
from eagleray.serve.protocol import CompletionRequest

MAX_TOKENS = 200


@pytest.fixture
def server(tiny_target):
    srv = EngineServer(
        {
            "model_name": "tiny",
            "target": {"model": str(tiny_target), "device": "cpu", "max_model_len": 256},
            "draft": None,
            "kv_cache_gib": 0.05,
        }
    )
    yield srv
    srv.shutdown()


def _payload(rid: str) -> dict:
    req = CompletionRequest(model="tiny", prompt="count with me", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    return {**sampling_payload(req, "completion"), "request_id": rid}


async def _generated_after(client: LocalClient, stop_after: int | None) -> tuple[list[dict], int]:
    """Read a stream (cancel it after ``stop_after`` deltas); the tokens the engine made once it is idle."""
    stream = client.generate(_payload(f"r{stop_after}"))
    items = [await stream.__anext__()]
    async for item in stream:
        items.append(item)
        if stop_after is not None and len(items) > stop_after:
            stream.cancel()
            break
    before, idle_for = -1, 0
    while idle_for < 5:  # the engine made no token for 5 polls of 50 ms: it is idle
        await asyncio.sleep(0.05)
        now = client.server.engine.metrics.snapshot()["generation_tokens"]
        idle_for, before = (idle_for + 1 if now == before else 0), now
    return items, before


def test_a_cancelled_stream_aborts_its_request_and_a_whole_one_finishes(server):
    client = LocalClient(server)

    async def main():
        return await _generated_after(client, stop_after=2), await _generated_after(client, stop_after=None)

    (cut, made_cut), (whole, made_whole) = asyncio.run(main())
    assert cut[0]["kind"] == "start" and not cut[-1]["finished"]
    assert made_cut < MAX_TOKENS // 2, f"the cancelled request went on generating: {made_cut} tokens"
    assert whole[-1]["finished"] and whole[-1]["num_output_tokens"] == MAX_TOKENS
    assert made_whole - made_cut == MAX_TOKENS
