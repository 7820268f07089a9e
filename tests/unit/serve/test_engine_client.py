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


def _server(tiny_target, **serving) -> EngineServer:
    target = {"model": str(tiny_target), "device": "cpu", "max_model_len": 256}
    return EngineServer({"model_name": "tiny", "target": target, "draft": None, "kv_cache_gib": 0.05, **serving})


@pytest.fixture
def server(tiny_target):
    srv = _server(tiny_target)
    yield srv
    srv.shutdown()


def _payload(rid: str, max_tokens: int = MAX_TOKENS) -> dict:
    req = CompletionRequest(model="tiny", prompt="count with me", max_tokens=max_tokens, ignore_eos=True, temperature=0)
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


def test_stream_interval_sends_the_first_token_at_once_then_events_of_at_least_that_many(tiny_target):
    async def deltas(srv: EngineServer) -> list[dict]:
        return [item async for item in LocalClient(srv).generate(_payload("r", max_tokens=11))][1:]

    streams = {}
    for interval in (1, 4):
        srv = _server(tiny_target, stream_interval=interval)
        try:
            streams[interval] = asyncio.run(deltas(srv))
        finally:
            srv.shutdown()
    counts = [d["num_output_tokens"] for d in streams[4]]
    assert counts[0] == 1 and counts[-1] == 11 and streams[4][-1]["finished"], counts
    assert all(b - a >= 4 for a, b in zip(counts[:-2], counts[1:-1])), counts  # the last event may be shorter
    assert len(streams[1]) == 11 and len(streams[4]) < len(streams[1])
    assert "".join(d["delta_text"] for d in streams[4]) == "".join(d["delta_text"] for d in streams[1])
