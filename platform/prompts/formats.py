"""Turn one raw row (OpenAI ``messages``, ShareGPT ``conversations`` or plain ``prompt``) into a record.

Errors are :class:`DataError` naming where (file and line/row/item), the field and the fix.

ShareGPT roles: ``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant, ``system`` ->
system. ShareGPT V3 also holds answers of other chatbots (``chatgpt`` 8 turns, ``bing`` 4, ``bard``
2); they are assistant turns, mapped to ``assistant`` and counted in ``LoadReport.role_aliases``.
Any other role is a :class:`DataError` (nothing is guessed). A ``conversations`` turn may also use
OpenAI keys (``role``/``content``), as many converted data sets do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from eagleray.platform.errors import DataError, Problem
from eagleray.platform.prompts.records import ROLES, Message, PromptRecord, make_record
from eagleray.platform.prompts.report import LoadReport

FORMS = ("messages", "conversations", "prompt")  # detection order when a row has several
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
SHAREGPT_ROLE_ALIASES = {
    "user": "user",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def data_error(where: str, field: str, message: str, fix: str) -> DataError:
    """A DataError for one field of one input row."""
    return DataError(f"{where}: {Problem(field=field, message=message, fix=fix).render()}")


def require_object(row: Any, where: str) -> Mapping[str, Any]:
    """``row`` itself when it is a mapping (a JSON object), else a DataError."""
    if not isinstance(row, Mapping):
        raise data_error(where, "<row>", f"expected a JSON object, got {type(row).__name__}", "write one object per row")
    return row


def detect_form(row: Any, where: str) -> str:
    """Which prompt column a row uses: the first of FORMS present in it."""
    require_object(row, where)
    for form in FORMS:
        if form in row:
            return form
    raise data_error(
        where,
        "<row>",
        f"none of the prompt fields {list(FORMS)} is present (keys: {sorted(row)[:10]})",
        "give each row 'messages' (OpenAI role/content list), 'conversations' (ShareGPT from/value list) or 'prompt' (a string)",
    )


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise data_error(
            where, field, f"expected a string, got {type(value).__name__} ({value!r:.60})", "give the text as a string"
        )
    return value


def _turn_list(turns: Any, where: str, field: str) -> list[Any]:
    if not isinstance(turns, (list, tuple)):
        raise data_error(where, field, f"expected a list of turns, got {type(turns).__name__} ({turns!r:.60})", "give a list")
    return list(turns)


def _object_with(turn: Any, where: str, field: str, keys: tuple[str, ...], what: str) -> Mapping:
    """``turn`` as a mapping holding every one of ``keys``; a clear DataError naming the field otherwise."""
    if not isinstance(turn, Mapping):
        shape = "{" + ", ".join(f'"{k}"' for k in keys) + "}"
        raise data_error(where, field, f"expected an object, got {type(turn).__name__}", f"give {shape}")
    for key in keys:
        if key not in turn:
            raise data_error(where, f"{field}.{key}", "missing", f"add '{key}' to every {what}")
    return turn


def _openai_message(turn: Any, where: str, field: str) -> Message:
    _object_with(turn, where, field, ("role", "content"), "message")
    role = _text(turn["role"], where, f"{field}.role")
    if role not in ROLES:
        raise data_error(where, f"{field}.role", f"unknown role {role!r}", f"use one of {list(ROLES)}")
    return Message(role, _text(turn["content"], where, f"{field}.content"))


def _sharegpt_message(turn: Any, where: str, field: str, report: LoadReport) -> Message:
    if isinstance(turn, Mapping) and "from" not in turn and "role" in turn:
        return _openai_message(turn, where, field)
    _object_with(turn, where, field, ("from", "value"), "ShareGPT turn")
    who = _text(turn["from"], where, f"{field}.from")
    if who in SHAREGPT_ROLES:
        role = SHAREGPT_ROLES[who]
    elif who in SHAREGPT_ROLE_ALIASES:
        role = SHAREGPT_ROLE_ALIASES[who]
        report.role_aliases[f"{who}->{role}"] += 1
    else:
        known = sorted({*SHAREGPT_ROLES, *SHAREGPT_ROLE_ALIASES})
        raise data_error(where, f"{field}.from", f"unknown ShareGPT role {who!r}", f"use one of {known}")
    return Message(role, _text(turn["value"], where, f"{field}.value"))


def messages_of(row: Mapping[str, Any], form: str, where: str, report: LoadReport) -> list[Message]:
    """The messages of ``row`` read as ``form`` (one of FORMS)."""
    if form not in row:
        raise data_error(where, form, "missing", f"every row of this input uses '{form}' (from its first row); add it")
    value = row[form]
    if form == "prompt":
        return [Message("user", _text(value, where, form))]
    turns = _turn_list(value, where, form)
    if form == "messages":
        return [_openai_message(t, where, f"{form}[{i}]") for i, t in enumerate(turns)]
    return [_sharegpt_message(t, where, f"{form}[{i}]", report) for i, t in enumerate(turns)]


def record_of(
    row: Mapping[str, Any], form: str, where: str, source: str, report: LoadReport, meta: Mapping[str, Any]
) -> PromptRecord | None:
    """A record from ``row``, or None (counted in ``report.skipped``) when it has no content.

    Every other column of the row goes to ``meta`` (after the given ``meta``).
    """
    messages = messages_of(row, form, where, report)
    if not messages or (form == "prompt" and not messages[0].content):
        report.skip(f"empty_{form}")
        return None
    extra = {k: v for k, v in row.items() if k != form}
    return make_record(messages, source, {**meta, **extra})


def check_columns(columns: Iterable[str], where: str) -> str:
    """The prompt form of a table from its column names (Parquet)."""
    return detect_form({c: None for c in columns}, where)
