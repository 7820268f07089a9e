"""Request validation: every bad input is a 400 with an OpenAI-style body naming the field."""

import json

import pytest
from starlette.requests import Request

from eagleray.serve.ingress import check_auth, sampling_payload
from eagleray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _err(body, model=ChatCompletionRequest) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_body(raw, model)
    return info.value


@pytest.mark.parametrize("body, param, code", [
    ({**CHAT, "max_token": 5}, "max_token", "unknown_field"),
    ({**CHAT, "temperature": -0.5}, "temperature", "invalid_value"),
    ({**CHAT, "temperature": "hot"}, "temperature", "invalid_type"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens", "invalid_type"),
    ({**CHAT, "messages": []}, "messages", "invalid_value"),
    ({**CHAT, "messages": [{"role": "user", "content": "   "}]}, "messages", "invalid_value"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "invalid_value"),
    ({**CHAT, "messages": [{"role": "user"}]}, "messages.0.content", "missing_field"),
    ({**CHAT, "n": 2}, "n", "invalid_value"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": CHAT["messages"]}, "model", "missing_field"),
])
def test_chat_validation_names_the_field(body, param, code):
    err = _err(body)
    assert err.status == 400
    assert err.param == param, err.body()
    assert err.code == code, err.body()
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and param in body["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_malformed_json_is_400(raw):
    err = _err(raw)
    assert err.status == 400 and err.code == "invalid_json" and err.param is None


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": []}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
])
def test_completion_validation(body, param):
    err = _err(body, CompletionRequest)
    assert err.status == 400 and err.param == param


def test_valid_requests_and_payload():
    chat = parse_body(json.dumps({**CHAT, "max_completion_tokens": 7, "stop": "x", "temperature": 0}).encode(),
                      ChatCompletionRequest)
    p = sampling_payload(chat, "chat")
    assert p["max_tokens"] == 7 and p["limit_field"] == "max_completion_tokens" and p["prompt_field"] == "messages"
    assert p["params"]["stop"] == ["x"] and p["prompt"] == [{"role": "user", "content": "hi"}]
    comp = parse_body(json.dumps({"model": "m", "prompt": ["one"]}).encode(), CompletionRequest)
    p = sampling_payload(comp, "completion")
    assert p["prompt"] == "one" and p["max_tokens"] == 16


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_auth():
    check_auth(_request({}), None)
    check_auth(_request({"Authorization": "Bearer s3cret"}), "s3cret", admin=True)
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
        with pytest.raises(APIError) as info:
            check_auth(_request(headers), "s3cret")
        assert info.value.status == 401 and info.value.type == "authentication_error"
    with pytest.raises(APIError) as info:
        check_auth(_request({"Authorization": "Bearer x"}), None, admin=True)
    assert info.value.status == 403
