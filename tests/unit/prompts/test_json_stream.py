"""The streaming JSON-array reader: chunk boundaries, truncation and malformed items."""

from __future__ import annotations

import io
import json
import logging

import pytest

from eagleray.platform.errors import DataError
from eagleray.platform.prompts.json_stream import iter_json_array
from eagleray.platform.prompts.report import LoadReport

ITEMS = [
    {"id": "a", "conversations": [{"from": "human", "value": 'héllo "q" \\ \u2603'}]},
    {"id": "b", "n": -12.5e3, "ok": True, "none": None, "list": [1, [2, {"x": "y"}]]},
    {"id": "c", "text": "x" * 300},
]


def _read(data: bytes, chunk: int, allow_truncated: bool = True) -> tuple[list, LoadReport]:
    report = LoadReport("t")
    items = list(
        iter_json_array(io.BytesIO(data), name="t.json", report=report, allow_truncated=allow_truncated, chunk_bytes=chunk)
    )
    return items, report


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
@pytest.mark.parametrize("indent", [None, 2])
def test_items_and_byte_offsets_match_json_loads(chunk: int, indent: int | None) -> None:
    data = json.dumps(ITEMS, indent=indent, ensure_ascii=False).encode("utf-8")
    items, report = _read(data, chunk)
    assert [i.value for i in items] == ITEMS and [i.index for i in items] == [0, 1, 2]
    for item in items:  # each offset is where the item's bytes start
        assert json.JSONDecoder().raw_decode(data[item.offset :].decode("utf-8"))[0] == item.value
    assert not report.truncated


@pytest.mark.parametrize("chunk", [5, 1 << 20])
@pytest.mark.parametrize("cut_back", [3, 4, 10, 120, 330])
def test_truncated_file_yields_complete_items_and_reports_the_cut(chunk: int, cut_back: int, caplog) -> None:
    data = json.dumps(ITEMS, indent=2, ensure_ascii=False).encode("utf-8")
    last_start = data.rindex(b"{\n", 0, data.rindex(b'"c"'))
    cut = data[: len(data) - cut_back]
    if len(cut) <= last_start:
        pytest.skip("cut before the last item")
    with caplog.at_level(logging.WARNING):
        items, report = _read(cut, chunk)
    assert [i.value for i in items] == ITEMS[:2]
    assert report.truncated_at_byte == last_start and report.file_bytes == len(cut)
    assert f"ends at byte {len(cut)}" in caplog.text


@pytest.mark.parametrize("data", [b'[{"a": 1}, {"a": 2},  ', b'[{"a": 1}, {"a": 2}\n'])
def test_cut_between_items_is_reported(data: bytes) -> None:
    items, report = _read(data, 4)
    assert len(items) == 2 and report.truncated_at_byte == len(data) and report.file_bytes == len(data)


def test_truncation_is_an_error_when_not_allowed() -> None:
    with pytest.raises(
        DataError, match=r"(?s)ends at byte 12 inside item 1 \(which starts at byte 11\).*restore the complete file"
    ):
        _read(b'[{"a": 1}, {', 4, allow_truncated=False)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (
            b'[{"a": 1}, {"a": 2,, "b": 3}, {"a": 4}]',
            r"item 1 \(starts at byte 11\): invalid JSON: Expecting property name .* at byte 19",
        ),
        (
            b'[{"a": 1}, {"a": "x\ny"}, {"a": 4}]',
            r"item 1 \(starts at byte 11\): invalid JSON: Invalid control character at byte 19",
        ),
        (b'[{"a": 1} {"a": 2}]', r"item 0 \(starts at byte 1\): expected ',' or '\]' after this item, found '{' at byte 10"),
        (b'[{"a": 1},]', r"trailing ','"),
        (b'{"a": 1}', r"does not start with '\['"),
        (b'[{"a": 1}] x', r"unexpected data after the closing"),
        (b'[{"a": 1}, {"a": "\xff"}]', r"byte 18: not valid UTF-8"),
    ],
)
@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_malformed_input_names_item_and_byte(data: bytes, pattern: str, chunk: int) -> None:
    with pytest.raises(DataError, match=pattern):
        _read(data, chunk)


def test_empty_array() -> None:
    items, report = _read(b" [ ] \n", 2)
    assert items == [] and not report.truncated
