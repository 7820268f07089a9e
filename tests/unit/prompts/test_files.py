"""JSONL, Parquet and JSON-array prompt files: form detection, stable ids, and errors that name the field."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagleray.platform.errors import DataError
from eagleray.platform.prompts import Message, load_prompts, prompt_id_for

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime > 10."},
    {"role": "assistant", "content": "11"},
]
SHAREGPT_CHAT = [
    {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in CHAT
]
CHAT_ID = prompt_id_for([Message(**m) for m in CHAT])
PROMPT_ID = prompt_id_for([Message("user", "Name a prime > 10.")])


def _jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("messages.jsonl", [{"id": "r1", "messages": CHAT}]),
        ("sharegpt.jsonl", [{"id": "r1", "conversations": SHAREGPT_CHAT}]),
        ("openai_keys_in_conversations.jsonl", [{"id": "r1", "conversations": CHAT}]),
        ("messages.parquet", [{"id": "r1", "messages": CHAT}]),
        ("sharegpt.parquet", [{"id": "r1", "conversations": SHAREGPT_CHAT}]),
    ],
)
def test_same_conversation_has_one_id_in_every_form(tmp_path: Path, name: str, rows: list) -> None:
    path = _parquet(tmp_path / name, rows) if name.endswith(".parquet") else _jsonl(tmp_path / name, rows)
    (rec,) = load_prompts(path)
    assert rec.prompt_id == CHAT_ID and rec.source == path and rec.meta == {"id": "r1"}
    assert [m.to_dict() for m in rec.messages] == CHAT


def test_sharegpt_json_array_file_and_builtin_ids_agree(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"id": "a", "conversations": SHAREGPT_CHAT}, {"id": "b", "conversations": []}]))
    result = load_prompts(str(path))
    assert [r.prompt_id for r in result] == [CHAT_ID]
    assert result.report.skipped == {"empty_conversations": 1}
    sharegpt = load_prompts("sharegpt", limit=1).records[0]
    copy = tmp_path / "copy.jsonl"
    _jsonl(copy, [{"messages": [m.to_dict() for m in sharegpt.messages]}])
    assert load_prompts(str(copy)).records[0].prompt_id == sharegpt.prompt_id


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_plain_prompt_column(tmp_path: Path, suffix: str) -> None:
    rows = [{"prompt": "Name a prime > 10.", "lang": "en"}, {"prompt": "", "lang": "en"}]
    path = _parquet(tmp_path / f"p{suffix}", rows) if suffix == ".parquet" else _jsonl(tmp_path / f"p{suffix}", rows)
    result = load_prompts(path)
    assert [r.prompt_id for r in result] == [PROMPT_ID] and result.records[0].meta == {"lang": "en"}
    assert result.report.skipped == {"empty_prompt": 1} and result.report.items == 2


def test_gzip_jsonl_file_uri_blank_lines_limit_and_dedupe(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl.gz"
    lines = [json.dumps({"prompt": p}) for p in ["a", "b", "a", "c"]]
    path.write_bytes(gzip.compress(("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n").encode()))
    result = load_prompts(path.as_uri(), dedupe=True)
    assert [r.messages[0].content for r in result] == ["a", "b", "c"]
    assert result.report.skipped == {"blank_line": 1, "duplicate": 1}
    assert len(load_prompts(str(path), limit=2)) == 2


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        ([{"messages": CHAT}, {"id": 2}], r"line 2: messages: missing\n    fix: every row of this input uses 'messages'"),
        ([{"messages": [{"role": "user", "content": 5}]}], r"line 1: messages\[0\]\.content: expected a string, got int"),
        ([{"messages": [{"role": "user"}]}], r"line 1: messages\[0\]\.content: missing"),
        ([{"messages": [{"role": "robot", "content": "x"}]}], r"messages\[0\]\.role: unknown role 'robot'"),
        ([{"messages": "hi"}], r"line 1: messages: expected a list of turns, got str"),
        ([{"conversations": [{"from": "robot", "value": "x"}]}], r"conversations\[0\]\.from: unknown ShareGPT role 'robot'"),
        ([{"conversations": [{"from": "human"}]}], r"conversations\[0\]\.value: missing"),
        ([{"prompt": ["a"]}], r"line 1: prompt: expected a string, got list"),
        ([{"text": "x"}], r"line 1: <row>: none of the prompt fields .* \(keys: \['text'\]\)"),
        ([["not", "an", "object"]], r"line 1: <row>: expected a JSON object, got list"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path: Path, rows: list, pattern: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=pattern) as err:
        load_prompts(path)
    assert path in str(err.value) and "fix:" in str(err.value)


def test_jsonl_bad_json_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": ok}\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid JSON \(Expecting value at column 12\)"):
        load_prompts(str(path))


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        ([{"prompt": "a"}, {"prompt": None}], r"row 1: prompt: expected a string, got NoneType"),
        (
            [{"messages": [{"role": "user", "content": "a"}]}, {"messages": []}, {"messages": [{"role": "user"}]}],
            r"row 2: messages\[0\]\.content: expected a string, got NoneType",
        ),
        ([{"text": "a"}], r"\(schema\): <row>: none of the prompt fields"),
    ],
)
def test_parquet_errors_name_row_and_field(tmp_path: Path, rows: list, pattern: str) -> None:
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=pattern):
        load_prompts(path)


def test_parquet_column_of_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": pa.array([1, 2])}), path)
    with pytest.raises(DataError, match=r"row 0: prompt: expected a string, got int"):
        load_prompts(str(path))


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("p.csv", b"prompt\nhi\n", r"cannot tell the file type"),
        ("missing.jsonl", None, r"does not exist"),
        ("broken.parquet", b"PAR1 not really", r"not a readable Parquet file"),
        ("cut.json", b'[{"prompt": "a"}, {"prompt": "b', r"ends at byte 31 inside item 1 \(which starts at byte 18\)"),
    ],
)
def test_unusable_files(tmp_path: Path, name: str, content: bytes | None, pattern: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=pattern):
        load_prompts(str(path))


def test_bad_limit() -> None:
    with pytest.raises(DataError, match="limit=-1"):
        load_prompts("mtbench", limit=-1)


class _FakePackagedFile:
    """Stands in for packages.SHAREGPT, pointing at a file written by the test."""

    def __init__(self, path: Path):
        self.path = path

    def locate(self) -> Path:
        return self.path


@pytest.mark.parametrize(
    ("item", "pattern"),
    [
        ('{"id": "x"}', r"item 1 \(byte 67\): conversations: missing"),
        (
            '{"id": "x", "conversations": [{"from": "gpt", "value": 7}]}',
            r"item 1 \(byte 67\): conversations\[0\]\.value: expected a string, got int",
        ),
        ('{"id": "x", "conversations": [}', r"item 1 \(starts at byte 67\): invalid JSON: Expecting value at byte 97"),
    ],
)
def test_malformed_sharegpt_record_mid_file_is_an_error(tmp_path: Path, monkeypatch, item: str, pattern: str) -> None:
    from eagleray.platform.prompts import packages

    good = '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}'
    path = tmp_path / "sharegpt.json"
    # item 1 starts at byte 67 = len("[") + len(good) (64) + len(", ")
    path.write_text(f'[{good}, {item}, {good}, {{"id": "cut')
    monkeypatch.setattr(packages, "SHAREGPT", _FakePackagedFile(path))
    with pytest.raises(DataError, match=pattern):
        load_prompts("sharegpt")
    path.write_text(f'[{good}, {good}, {{"id": "cut')
    result = load_prompts("sharegpt")
    assert len(result) == 2 and result.report.truncated_at_byte == 1 + 2 * (64 + 2)
