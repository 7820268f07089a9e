"""OpenAI response objects (non-streaming and SSE chunks) built from the engine's step outputs.

The engine deployment streams :class:`Delta` dicts; the ingress turns them into
``chat.completion`` / ``text_completion`` objects or SSE chunks. Every response carries the
extension field ``eagleray`` with the draft version and the request's speculative statistics.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Delta:
    """One step of one request as it crosses the Ray Serve handle."""

    delta_text: str
    num_output_tokens: int  # completion tokens so far
    prompt_tokens: int
    finished: bool
    finish_reason: str | None
    draft_version: str | None
    spec: dict[str, Any] = field(default_factory=dict)  # SpecStats.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Delta":
        return cls(**d)


def spec_extension(draft_version: str | None, spec: dict[str, Any]) -> dict[str, Any]:
    """The ``eagleray`` field: draft version and τ (mean acceptance length) of this request."""
    drafts = int(spec.get("num_drafts", 0))
    accepted = int(spec.get("num_accepted_tokens", 0))
    return {
        "draft_version": draft_version,
        "num_drafts": drafts,
        "num_draft_tokens": int(spec.get("num_draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "accepted_per_pos": list(spec.get("accepted_per_pos", [])),
        "tau": round(1.0 + accepted / drafts, 4) if drafts else None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Accumulates deltas of one request; renders the final object or each SSE chunk."""

    def __init__(self, kind: str, model: str):
        if kind not in ("chat", "completion"):
            raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text = ""
        self.last: Delta | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def add(self, d: Delta) -> None:
        self.text += d.delta_text
        self.last = d

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ext(self) -> dict[str, Any]:
        d = self.last
        return spec_extension(d.draft_version if d else None, d.spec if d else {})

    def final(self) -> dict[str, Any]:
        """The non-streaming response."""
        d = self.last
        reason = d.finish_reason if d else None
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "finish_reason": reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": reason, "logprobs": None}
        return {
            **self._head(self.object),
            "choices": [choice],
            "usage": usage(d.prompt_tokens, d.num_output_tokens) if d else usage(0, 0),
            "eagleray": self._ext(),
        }

    def chunk(self, d: Delta, *, first: bool = False) -> dict[str, Any]:
        """One streamed chunk for delta ``d`` (call :meth:`add` first)."""
        reason = d.finish_reason if d.finished else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": d.delta_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": d.delta_text, "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if d.finished:
            out["eagleray"] = self._ext()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """Final chunk of ``stream_options.include_usage``: no choices, only usage."""
        d = self.last
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            **self._head(obj),
            "choices": [],
            "usage": usage(d.prompt_tokens, d.num_output_tokens) if d else usage(0, 0),
            "eagleray": self._ext(),
        }


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` is sent verbatim)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if "\n" in payload:
        raise ValueError("an SSE data line must not contain a newline (JSON escapes them; raw strings must not)")
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")
