"""OpenAI-compatible request models and the error body every 4xx carries.

Requests are strict (``extra="forbid"``): an unknown field is a 400 that names it, so a typo such
as ``max_token`` never silently falls back to a default. Errors follow OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages.0.content", "code": "..."}}
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# pydantic error type -> OpenAI-style error code
_CODES = {"extra_forbidden": "unknown_field", "missing": "missing_field", "json_invalid": "invalid_json"}


class APIError(Exception):
    """An error answered with an OpenAI-style body; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
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
        return cls(d["status"], d["message"], param=d.get("param"), code=d.get("code"), type=d.get("type", "invalid_request_error"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"] = Field(description="Only text content parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"] = Field(description="Author of the message.")
    content: str | list[TextPart] = Field(description="Message text, or a list of text parts.")
    name: str | None = Field(None, description="Optional participant name (ignored by the chat template).")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a final chunk with token usage before [DONE].")


class _Sampling(_Strict):
    model: str = Field(description="Model id; must be one listed by GET /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Maximum generated tokens; default: what the context leaves.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (vLLM extension); 0 keeps all.")
    n: Literal[1] = Field(1, description="Number of choices; only 1 is supported.")
    stream: bool = Field(False, description="Stream the answer as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (include_usage).")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings; the text is cut before the first.")
    seed: int | None = Field(None, description="Seed of the random draws (sampled requests are reproducible).")
    user: str | None = Field(None, description="End-user id (recorded, not used).")
    ignore_eos: bool = Field(False, description="Do not stop at EOS (vLLM extension; for benchmarks).")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far (at least one message).")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens; wins when both are set.")

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


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] = Field(description="One prompt: text, token ids, or a one-element list of text.")
    max_tokens: int | None = Field(16, ge=1, description="Maximum generated tokens (OpenAI's default is 16).")
    echo: Literal[False] = Field(False, description="Echoing the prompt is not supported.")

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
        return self.max_tokens, "max_tokens"


def _param_of(loc: tuple) -> str | None:
    # Drop the union-branch names pydantic inserts (e.g. "str", "list[TextPart]") so param stays a field path.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "function-after")))]
    return ".".join(parts) or None


def validation_error(err: ValidationError) -> APIError:
    """The first problem of a pydantic error as a 400 naming the field (all problems in the message)."""
    errors = err.errors()
    first = errors[0]
    param = _param_of(first["loc"])
    msgs = []
    for e in errors[:5]:
        p = _param_of(e["loc"]) or "body"
        hint = "unknown field; remove it or fix its spelling" if e["type"] == "extra_forbidden" else e["msg"]
        msgs.append(f"{p}: {hint}")
    code = _CODES.get(first["type"], "invalid_type" if first["type"].endswith(("_type", "_parsing")) else "invalid_value")
    return APIError(400, "; ".join(msgs), param=param, code=code)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> validated request; every failure is an :class:`APIError` (400)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err) from None
