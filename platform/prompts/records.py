"""The one normalised prompt record every loader yields, its content hash, turn splitting, dedup.

A :class:`PromptRecord` is an OpenAI-style conversation (``system``/``user``/``assistant``
messages) plus where it came from. Its ``prompt_id`` is a hash of the messages only, so the same
content read from ShareGPT, a JSONL file or a Parquet file has one id, and a rerun of data
generation can skip ids it already wrote.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
PROMPT_ID_HEX_CHARS = 24  # 96 bits of sha256: collisions are negligible far beyond 10^9 prompts


@dataclass(frozen=True)
class Message:
    """One chat message, OpenAI style."""

    role: str  # one of ROLES
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"message role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"message content must be a string, got {type(self.content).__name__}")

    def to_dict(self) -> dict[str, str]:
        """The OpenAI ``{"role": ..., "content": ...}`` form."""
        return {"role": self.role, "content": self.content}


def prompt_id_for(messages: Sequence[Message]) -> str:
    """Stable content hash of a conversation: sha256 over canonical JSON of the messages.

    Canonical JSON: a list of ``{"content", "role"}`` objects, keys sorted, no whitespace,
    UTF-8 without escaping. The source is deliberately not part of the hash.
    """
    canon = json.dumps([m.to_dict() for m in messages], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:PROMPT_ID_HEX_CHARS]


@dataclass(frozen=True)
class PromptRecord:
    """A conversation to prompt the target with, and its provenance.

    Build it with :func:`make_record`, which computes ``prompt_id`` from the messages.
    """

    prompt_id: str  # prompt_id_for(messages)
    messages: tuple[Message, ...]
    source: str  # "sharegpt", "mtbench", "humaneval" or the file path/URI it was read from
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)  # source-specific ids, e.g. question_id

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (for Ray Data rows, JSONL and Parquet)."""
        return {
            "prompt_id": self.prompt_id,
            "messages": [m.to_dict() for m in self.messages],
            "source": self.source,
            "meta": dict(self.meta),
        }


def make_record(messages: Iterable[Message], source: str, meta: Mapping[str, Any] | None = None) -> PromptRecord:
    """Build a record whose ``prompt_id`` is the content hash of ``messages``."""
    msgs = tuple(messages)
    if not msgs:
        raise ValueError("a prompt record needs at least one message")
    return PromptRecord(prompt_id=prompt_id_for(msgs), messages=msgs, source=source, meta=dict(meta or {}))


def prompt_turns(record: PromptRecord) -> Iterator[PromptRecord]:
    """Split a conversation into the prompts that data generation regenerates answers for.

    Yields one record per assistant turn: the messages before that turn (its id is the hash of
    that prefix). A conversation that ends with a user turn also yields the whole conversation,
    which is a prompt still waiting for its answer; so a plain one-message prompt yields itself.
    An assistant turn whose prefix does not end with a user message (an assistant turn first, or
    two assistant turns in a row) is not a prompt and yields nothing. ``meta`` gains ``turn``
    (0-based index of the answered message) and ``parent_id`` (the id of the whole conversation).
    """
    msgs = record.messages
    ends = [i for i, m in enumerate(msgs) if m.role == "assistant"]
    if msgs[-1].role == "user":
        ends.append(len(msgs))
    for end in ends:
        if end == 0 or msgs[end - 1].role != "user":
            continue
        meta = {**record.meta, "turn": end, "parent_id": record.prompt_id}
        yield make_record(msgs[:end], record.source, meta)


def dedup(records: Iterable[PromptRecord]) -> list[PromptRecord]:
    """Drop records whose ``prompt_id`` was already seen; the first occurrence wins, order kept."""
    seen: set[str] = set()
    out = []
    for rec in records:
        if rec.prompt_id not in seen:
            seen.add(rec.prompt_id)
            out.append(rec)
    return out
