"""Request validation: every bad input is a 400 with an OpenAI-style body naming the field."""

import json

import pytest
from starlette.requests import Request

from eagleray.serve.ingress import check_auth, sampling_payload
from eagleray.serve.protocol import (
    CHAT_DEFAULT_ONLY,
    COMPLETION_DEFAULT_ONLY,
    INT64_MAX,
    INT64_MIN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from eagleray.serve.request_body import parse_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _err(body, model=ChatCompletionRequest) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse_body(raw, model)
    return info.value


@pytest.mark.parametrize(
    "body, param, code",
    [
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
        # every bound of the edge, one value past it (a test fails if the bound goes)
        ({**CHAT, "temperature": 2.0001}, "temperature", "invalid_value"),
        ({**CHAT, "top_p": 1.5}, "top_p", "invalid_value"),
        ({**CHAT, "top_p": 0}, "top_p", "invalid_value"),
        ({**CHAT, "top_k": 2**63}, "top_k", "invalid_value"),
        ({**CHAT, "top_k": 2**31}, "top_k", "invalid_value"),
        ({**CHAT, "top_k": -2}, "top_k", "invalid_value"),
        ({**CHAT, "seed": 2**64}, "seed", "invalid_value"),
        ({**CHAT, "seed": INT64_MAX + 1}, "seed", "invalid_value"),
        ({**CHAT, "seed": INT64_MIN - 1}, "seed", "invalid_value"),
        ({**CHAT, "max_tokens": 2**64}, "max_tokens", "invalid_value"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({**CHAT, "max_completion_tokens": 2**64}, "max_completion_tokens", "invalid_value"),
        ({**CHAT, "stop": ["a", ""]}, "stop", "invalid_value"),
        ({**CHAT, "stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
        ({**CHAT, "stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
        ({**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0.content", "invalid_value"),
        (
            {**CHAT, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
            "messages.0.tool_calls",
            "invalid_value",
        ),
        ({**CHAT, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats", "invalid_value"),
    ],
)
def test_chat_validation_names_the_field(body, param, code):
    err = _err(body)
    assert err.status == 400
    assert err.param == param, err.body()
    assert err.code == code, err.body()
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and param in body["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"\xff\xfe",
        b"[1, 2]",
        b'"text"',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "m", "messages": [], "temperature": NaN}',
        b'{"temperature": Infinity}',
        b'{"model": "m", "prompt": "\xff\xfe\xfd"}',
    ],
)
def test_malformed_json_is_400(raw):
    err = _err(raw)
    assert err.status == 400 and err.code == "invalid_json" and err.param is None


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "ok \\udfff"}]}', "messages.0.content"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages.0.content.0.text",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop.0"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "user": "\\udc00"}', "user"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', None),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(raw, param):
    """Valid JSON, not text: the tokenizer cannot encode it (was a 500 from the engine replica)."""
    err = _err(raw)
    assert err.status == 400 and err.code == "invalid_encoding" and err.param == param, err.body()
    assert "surrogate" in err.message


def test_overflowing_float_is_400_naming_the_field():
    err = _err(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}')  # parses as inf
    assert err.status == 400 and err.param == "temperature", err.body()


def test_paired_surrogates_are_text():
    req = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', ChatCompletionRequest)
    assert req.messages[0].content == "\U0001f600"


def _defaults(table: dict) -> list[tuple[str, object]]:
    return [(name, d) for name, (defaults, _) in table.items() for d in defaults]


@pytest.mark.parametrize("name, value", _defaults(CHAT_DEFAULT_ONLY))
def test_every_chat_field_is_accepted_at_its_default(name, value):
    parse_body(json.dumps({**CHAT, name: value}).encode(), ChatCompletionRequest)


@pytest.mark.parametrize("name, value", _defaults(COMPLETION_DEFAULT_ONLY))
def test_every_completion_field_is_accepted_at_its_default(name, value):
    parse_body(json.dumps({"model": "m", "prompt": "x", name: value}).encode(), CompletionRequest)


# A value other than the default of every field accepted only at its default (same types as real clients send).
_OTHER = {
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "repetition_penalty": 1.1,
    "logit_bias": {"50256": -100},
    "min_p": 0.05,
    "min_tokens": 4,
    "use_beam_search": True,
    "best_of": 2,
    "length_penalty": 0.8,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "prompt_logprobs": 1,
    "return_tokens_as_token_ids": True,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": "g",
    "structured_outputs": {"json": {}},
    "response_format": {"type": "json_object"},
    "priority": 1,
    "store": True,
    "service_tier": "flex",
    "kv_transfer_params": {"a": 1},
    "logprobs": 2,
    "top_logprobs": 3,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "functions": [{"name": "f"}],
    "function_call": "auto_x",
    "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "high",
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"t": "x"}],
    "chat_template": "{{ x }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "mm_processor_kwargs": {},
    "suffix": "end",
}


@pytest.mark.parametrize("name", sorted(CHAT_DEFAULT_ONLY))
def test_chat_non_default_unsupported_value_is_400_naming_the_field(name):
    value = {"logprobs": True, "add_special_tokens": True}.get(name, _OTHER[name])
    err = _err({**CHAT, name: value})
    assert err.status == 400 and err.param == name and err.code == "unsupported_value", err.body()
    assert "not supported" in err.message and "remove the field" in err.message


@pytest.mark.parametrize("name", sorted(COMPLETION_DEFAULT_ONLY))
def test_completion_non_default_unsupported_value_is_400_naming_the_field(name):
    value = {"add_special_tokens": False}.get(name, _OTHER[name])
    err = _err({"model": "m", "prompt": "x", name: value}, CompletionRequest)
    assert err.status == 400 and err.param == name and err.code == "unsupported_value", err.body()


def test_false_is_not_zero():
    """``frequency_penalty: false`` is not the default 0 (Python's False == 0 must not let it through)."""
    assert _err({**CHAT, "frequency_penalty": False}).param == "frequency_penalty"


def test_vllm_benchmark_client_payloads():
    """What vLLM's benchmark client sends (vllm/benchmarks/lib/endpoint_request_func.py), and the null forms."""
    comp = parse_body(
        json.dumps(
            {
                "model": "m",
                "prompt": "x",
                "repetition_penalty": 1.0,
                "max_tokens": 8,
                "logprobs": None,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            }
        ).encode(),
        CompletionRequest,
    )
    assert comp.include_usage() and comp.sampling()["ignore_eos"] is True
    chat = parse_body(
        json.dumps(
            {
                **CHAT,
                "max_completion_tokens": 8,
                "stream": True,
                "temperature": None,
                "top_p": None,
                "top_k": -1,
                "n": None,
                "seed": None,
                "stop": None,
                "stream_options": {"include_usage": True},
            }
        ).encode(),
        ChatCompletionRequest,
    )
    assert chat.sampling() == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "stop": [],
        "stop_token_ids": [],
        "seed": None,
        "ignore_eos": False,
    }
    assert chat.limit() == (8, "max_completion_tokens")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ],
)
def test_completion_validation(body, param):
    err = _err(body, CompletionRequest)
    assert err.status == 400 and err.param == param


def test_valid_requests_and_payload():
    chat = parse_body(
        json.dumps({**CHAT, "max_completion_tokens": 7, "stop": "x", "temperature": 0}).encode(), ChatCompletionRequest
    )
    p = sampling_payload(chat, "chat")
    assert p["max_tokens"] == 7 and p["limit_field"] == "max_completion_tokens" and p["prompt_field"] == "messages"
    assert p["params"]["stop"] == ["x"] and p["prompt"] == [{"role": "user", "content": "hi"}]
    assert p["params"]["temperature"] == 0
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
