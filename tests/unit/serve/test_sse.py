"""SSE framing and OpenAI response shapes (with the eagleray extension)."""

import json

import pytest

from eagleray.serve.responses import SSE_DONE, Delta, ResponseBuilder, spec_extension, sse

SPEC = {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 6, "accepted_per_pos": [3, 2, 1, 0]}


def _deltas():
    return [Delta("Hel", 1, 5, False, None, "d/1", {}), Delta("lo\nworld", 3, 5, True, "stop", "d/1", SPEC)]


def _parse(event: str) -> dict | str:
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    payload = event[len("data: ") : -2]
    return payload if payload == "[DONE]" else json.loads(payload)


def test_sse_framing():
    assert SSE_DONE == "data: [DONE]\n\n"
    assert _parse(sse({"a": "x\ny"})) == {"a": "x\ny"}  # newlines inside JSON are escaped
    with pytest.raises(ValueError):
        sse("two\nlines")


@pytest.mark.parametrize("kind, obj", [("chat", "chat.completion.chunk"), ("completion", "text_completion")])
def test_stream_chunks(kind, obj):
    b = ResponseBuilder(kind, "eagleray")
    events = []
    for i, d in enumerate(_deltas()):
        b.add(d)
        events.append(_parse(sse(b.chunk(d, first=i == 0))))
    events.append(_parse(sse(b.usage_chunk())))
    assert all(e["object"] == obj and e["id"] == b.id and e["model"] == "eagleray" for e in events)
    first, last, usage = events
    if kind == "chat":
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
        assert "role" not in last["choices"][0]["delta"]
    else:
        assert first["choices"][0]["text"] == "Hel"
    assert first["choices"][0]["finish_reason"] is None and last["choices"][0]["finish_reason"] == "stop"
    assert last["eagleray"]["tau"] == 2.5 and last["eagleray"]["draft_version"] == "d/1"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_final_response(kind):
    b = ResponseBuilder(kind, "eagleray")
    for d in _deltas():
        b.add(d)
    out = b.final()
    assert set(out) == {"id", "object", "created", "model", "choices", "usage", "eagleray"}
    choice = out["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    assert text == "Hello\nworld" and choice["finish_reason"] == "stop"
    assert out["eagleray"] == {
        "draft_version": "d/1",
        "num_drafts": 4,
        "num_draft_tokens": 16,
        "num_accepted_tokens": 6,
        "accepted_per_pos": [3, 2, 1, 0],
        "tau": 2.5,
    }


def test_no_drafts_has_no_tau():
    assert spec_extension(None, {})["tau"] is None
