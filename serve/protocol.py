"""OpenAI-compatible request models and the error body every 4xx carries.

Requests are strict (``extra="forbid"``): an unknown field is a 400 that names it, so a typo such
as ``max_token`` never silently falls back to a default. Every other field of OpenAI's chat and
completions APIs, and the vLLM sampling extensions real clients send (vLLM's benchmark client
sends ``repetition_penalty: 1.0`` and ``logprobs: null``), is accepted at its default/null value;
a non-default value of a feature eagleray does not implement is a 400 naming the field
(:data:`CHAT_DEFAULT_ONLY`, :data:`COMPLETION_DEFAULT_ONLY`). Numbers are range-checked here, at
the edge, so nothing the engine cannot run reaches it, and text must be encodable (a lone UTF-16
surrogate such as ``"\\ud800"`` is valid JSON but not Unicode text). Errors follow OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages.0.content", "code": "..."}}
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

# pydantic error type -> OpenAI-style error code
ERROR_CODES = {
    "extra_forbidden": "unknown_field",
    "missing": "missing_field",
    "json_invalid": "invalid_json",
    "finite_number": "invalid_value",
}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch's generators take (vLLM's bound on seed too)
INT32_MAX = 2**31 - 1


class APIError(Exception):
    """An error answered with an OpenAI-style body; ``status`` is the HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict[str, Any]:
        """Plain form that crosses a Ray Serve handle (see :meth:`from_dict`)."""
        return {"status": self.status, **self.body()["error"]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "APIError":
        return cls(
            d["status"], d["message"], param=d.get("param"), code=d.get("code"), type=d.get("type", "invalid_request_error")
        )


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _is_default(value: Any, default: Any) -> bool:
    """``value`` equals the API default ``default`` (``False`` is not ``0``, ``1`` is ``1.0``)."""
    if default is None or value is None:
        return value is default
    if isinstance(value, bool) or isinstance(default, bool):
        return isinstance(value, bool) and isinstance(default, bool) and value == default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


def refuse_non_defaults(data: Any, table: dict[str, tuple[tuple, str]]) -> Any:
    """Raw request ``data``: a field of ``table`` (field -> (its defaults, why)) with another value is refused."""
    if isinstance(data, dict):
        for name, (defaults, why) in table.items():
            if name in data and not any(_is_default(data[name], d) for d in defaults):
                shown = " or ".join(json.dumps(d) for d in defaults)
                raise FieldError(name, f"{json.dumps(data[name])[:60]} is not supported: {why}; remove the field or send {shown}")
    return data


class FieldError(ValueError):
    """A problem with one named field found outside pydantic's field validation."""

    def __init__(self, param: str, message: str, code: str = "unsupported_value"):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.code = param, message, code


# Fields of OpenAI's APIs (and vLLM's extensions) eagleray accepts only at their defaults.
_COMMON_DEFAULT_ONLY: dict[str, tuple[tuple, str]] = {
    "frequency_penalty": ((None, 0), "frequency penalties are not implemented"),
    "presence_penalty": ((None, 0), "presence penalties are not implemented"),
    "repetition_penalty": ((None, 1), "repetition penalties are not implemented"),
    "logit_bias": ((None, {}), "logit biases are not implemented"),
    "min_p": ((None, 0), "min_p filtering is not implemented"),
    "min_tokens": ((None, 0), "min_tokens is not implemented"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "best_of": ((None, 1), "only one candidate is generated"),
    "length_penalty": ((None, 1), "length penalties apply to beam search, which is not implemented"),
    "include_stop_str_in_output": ((None, False), "stop strings are always cut from the output"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated (a prompt over the context is a 400)"),
    "prompt_logprobs": ((None,), "prompt logprobs are not implemented"),
    "return_tokens_as_token_ids": ((None, False), "tokens are returned as text"),
    "guided_json": ((None,), "guided decoding is not implemented"),
    "guided_regex": ((None,), "guided decoding is not implemented"),
    "guided_choice": ((None,), "guided decoding is not implemented"),
    "guided_grammar": ((None,), "guided decoding is not implemented"),
    "structured_outputs": ((None,), "structured outputs are not implemented"),
    "response_format": ((None, {"type": "text"}), "structured outputs (json_object, json_schema) are not implemented"),
    "priority": ((None, 0), "requests are served in arrival order"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not implemented"),
}
CHAT_DEFAULT_ONLY: dict[str, tuple[tuple, str]] = {
    **_COMMON_DEFAULT_ONLY,
    "logprobs": ((None, False), "logprobs are not implemented"),
    "top_logprobs": ((None, 0), "logprobs are not implemented"),
    "tools": ((None, []), "tool calling is not implemented"),
    "tool_choice": ((None, "none", "auto"), "tool calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "function_call": ((None, "none", "auto"), "function calling is not implemented"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "only text output is implemented"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not implemented"),
    "reasoning_effort": ((None,), "the target is not a reasoning model"),
    "verbosity": ((None, "medium"), "verbosity control is not implemented"),
    "echo": ((None, False), "echoing the conversation is not implemented"),
    "add_generation_prompt": ((None, True), "the chat template always ends with the assistant's generation prompt"),
    "continue_final_message": ((None, False), "the chat template always starts a new assistant message"),
    "add_special_tokens": ((None, False), "the chat template adds the special tokens"),
    "documents": ((None,), "documents for the chat template are not implemented"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "chat_template_kwargs": ((None, {}), "the model's own chat template is used"),
    "mm_processor_kwargs": ((None,), "multimodal input is not implemented"),
}
COMPLETION_DEFAULT_ONLY: dict[str, tuple[tuple, str]] = {
    **_COMMON_DEFAULT_ONLY,
    "logprobs": ((None,), "logprobs are not implemented"),
    "suffix": ((None, ""), "insertion (suffix) is not implemented"),
    "add_special_tokens": ((None, True), "the tokenizer's special tokens are always added to a text prompt"),
}
# Fields accepted with any value: ids and tags that do not change the answer.
_RECORDED = {
    "user": "End-user id (recorded, not used).",
    "metadata": "Key/value tags (not stored).",
    "prompt_cache_key": "Cache routing hint (not used).",
    "safety_identifier": "End-user id for safety monitoring (not used).",
    "request_id": "vLLM extension: the client's request id (the response id is eagleray's).",
    "parallel_tool_calls": "Tool calling option; without tools it changes nothing.",
    "cache_salt": "vLLM prefix-cache salt (eagleray has no prefix cache).",
}


class TextPart(_Strict):
    type: Literal["text"] = Field(description="Only text content parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"] = Field(description="Author of the message.")
    content: str | list[TextPart] | None = Field(
        description="Message text, or a list of text parts (null only for an assistant message)."
    )
    name: str | None = Field(None, description="Optional participant name (ignored by the chat template).")
    refusal: str | None = Field(None, description="An assistant message's refusal (replayed conversations carry it as null).")
    tool_calls: list[Any] | None = Field(None, description="Only null or [] (tool calling is not implemented).")
    function_call: None = Field(None, description="Only null (function calling is not implemented).")
    audio: None = Field(None, description="Only null (audio is not implemented).")

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise ValueError("tool calls are not supported (tool calling is not implemented); send null or []")
        return v

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"is null; a {self.role} message needs text", code="invalid_value")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a final chunk with token usage before [DONE].")
    include_obfuscation: bool | None = Field(None, description="OpenAI's stream padding option (eagleray sends no padding).")
    continuous_usage_stats: Literal[False] | None = Field(
        None, description="vLLM extension: only false (usage comes once, at the end)."
    )


M = TypeVar("M", bound="_Sampling")


def with_default_only_fields(cls: type[M]) -> type[M]:
    """``cls`` with a field for each name of its ``DEFAULT_ONLY`` table, so that the table is the one place a field
    accepted only at its defaults is named. Such a field is not an unknown field; it takes any type, default null,
    since :func:`refuse_non_defaults` (before field validation) lets only the table's defaults through."""
    fields: dict[str, Any] = {
        name: (Any, Field(None, description=f"Only {' or '.join(json.dumps(d) for d in defaults)}: {why}."))
        for name, (defaults, why) in cls.DEFAULT_ONLY.items()
    }
    return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__, **fields)


class _Sampling(_Strict):
    """Fields common to chat and completions requests. A request type adds its own, names its table
    (:data:`CHAT_DEFAULT_ONLY`, :data:`COMPLETION_DEFAULT_ONLY`) and takes that table's fields from
    :func:`with_default_only_fields`."""

    DEFAULT_ONLY: ClassVar[dict[str, tuple[tuple, str]]] = _COMMON_DEFAULT_ONLY  # each request type names its table

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        return refuse_non_defaults(data, cls.DEFAULT_ONLY)

    model: str = Field(description="Model id; must be one listed by GET /v1/models.")
    max_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="Maximum generated tokens; default: what the context leaves."
    )
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature in [0, 2]; 0 is greedy.")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(
        0, ge=-1, le=INT32_MAX, description="Keep the k most likely tokens (vLLM extension); 0 or -1 keeps all."
    )
    n: Literal[1] | None = Field(1, description="Number of choices; only 1 is supported.")
    stream: bool | None = Field(False, description="Stream the answer as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (include_usage).")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings; the text is cut before the first.")
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="vLLM extension: token ids that end the answer.")
    seed: int | None = Field(
        None, ge=INT64_MIN, le=INT64_MAX, description="Seed of the random draws (sampled requests are reproducible)."
    )
    ignore_eos: bool | None = Field(False, description="Do not stop at EOS (vLLM extension; for benchmarks).")
    user: str | None = Field(None, description=_RECORDED["user"])
    metadata: dict[str, str] | None = Field(None, description=_RECORDED["metadata"])
    prompt_cache_key: str | None = Field(None, description=_RECORDED["prompt_cache_key"])
    safety_identifier: str | None = Field(None, description=_RECORDED["safety_identifier"])
    request_id: str | None = Field(None, description=_RECORDED["request_id"])
    cache_salt: str | None = Field(None, description=_RECORDED["cache_salt"])
    store: bool | None = Field(
        None, description="Capture opt-in/out (serving.capture): false is never captured; true is refused when capture is off."
    )

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        bad = [t for t in v or [] if not 0 <= t <= INT32_MAX]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not valid token ids (>= 0)")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self) -> dict[str, Any]:
        """The engine's SamplingParams fields (null means the API default; top_k -1 means off)."""
        top_k = 0 if self.top_k in (None, -1) else self.top_k
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": top_k,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or []),
            "seed": self.seed,
            "ignore_eos": bool(self.ignore_eos),
        }


@with_default_only_fields
class ChatCompletionRequest(_Sampling):
    DEFAULT_ONLY: ClassVar[dict[str, tuple[tuple, str]]] = CHAT_DEFAULT_ONLY
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far (at least one message).")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=INT64_MAX, description="Newer name of max_tokens; wins when both are set."
    )
    parallel_tool_calls: bool | None = Field(None, description=_RECORDED["parallel_tool_calls"])

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]):
        if not any(m.text().strip() for m in v):
            raise ValueError("every message is empty; give at least one message with text")
        return v

    def limit(self) -> tuple[int | None, str]:
        """(requested max tokens, the field it came from)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


@with_default_only_fields
class CompletionRequest(_Sampling):
    DEFAULT_ONLY: ClassVar[dict[str, tuple[tuple, str]]] = COMPLETION_DEFAULT_ONLY
    prompt: str | list[int] | list[str] = Field(description="One prompt: text, token ids, or a one-element list of text.")
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX, description="Maximum generated tokens (OpenAI's default is 16).")
    echo: Literal[False] | None = Field(False, description="Echoing the prompt is not supported.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            v = v[0]
        if (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            raise ValueError("prompt is empty")
        return v

    def limit(self) -> tuple[int | None, str]:
        return (16 if self.max_tokens is None else self.max_tokens), "max_tokens"
