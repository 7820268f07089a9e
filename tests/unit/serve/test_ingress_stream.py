"""The ingress never cuts an answer silently: an engine stream that ends before its finished delta is a 503."""

import asyncio
import json

import pytest

from eagleray.serve.ingress import OpenAIIngress, StreamCut, engine_deltas, engine_failure
from eagleray.serve.protocol import APIError
from eagleray.serve.responses import Delta, ResponseBuilder


def _item(text: str, n: int, finished: bool) -> dict:
    return {"kind": "delta", **Delta(text, n, 3, finished, "length" if finished else None, "d1", {}).to_dict()}


class EngineStream:
    """The engine handle's stream as the ingress sees it after the head item (items, then its end)."""

    def __init__(self, items: list[dict]):
        self.items, self.cancelled = iter(items), False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        try:
            return next(self.items)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


async def _collect(gen):
    return [d async for d in gen]


def test_a_whole_stream_passes_and_a_cut_one_raises():
    whole = [_item("a", 1, False), _item("b", 2, True)]
    assert [d.delta_text for d in asyncio.run(_collect(engine_deltas(EngineStream(whole))))] == ["a", "b"]
    for cut in ([], whole[:1]):
        with pytest.raises(StreamCut):
            asyncio.run(_collect(engine_deltas(EngineStream(cut))))
    err = {"kind": "error", **APIError(400, "bad", param="max_tokens").to_dict()}
    with pytest.raises(APIError):
        asyncio.run(_collect(engine_deltas(EngineStream([err]))))


def test_a_cut_stream_is_answered_as_a_retryable_503():
    api = engine_failure(StreamCut("x"), "req-1")
    assert api.status == 503 and api.body()["error"]["code"] == "engine_unavailable"


def test_sse_of_a_cut_stream_ends_with_an_error_event_then_done():
    async def events(items):
        stream = EngineStream(items)
        out = [e async for e in OpenAIIngress._sse(None, stream, ResponseBuilder("completion", "m"), False)]
        return out, stream.cancelled

    out, cancelled = asyncio.run(events([_item("a", 1, False)]))
    assert out[-1] == "data: [DONE]\n\n" and len(out) == 3 and cancelled
    assert json.loads(out[1][len("data: ") :])["error"]["code"] == "engine_unavailable"
    out, cancelled = asyncio.run(events([_item("a", 1, False), _item("b", 2, True)]))
    assert len(out) == 3 and '"error"' not in "".join(out) and not cancelled
