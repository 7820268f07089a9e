"""Stream the items of one big top-level JSON array without loading the whole file.

``json.JSONDecoder.raw_decode`` (the C scanner) decodes one item at a time from a text buffer
that is refilled in large chunks. An error that the end of the buffer explains ("Unterminated
string", or an error within a few characters of the end) means "read more"; at the end of the file
it means the file was cut inside that item. Any other error is a malformed item and a
:class:`DataError` naming the byte offset and item index.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from eagleray.platform.errors import DataError
from eagleray.platform.prompts.report import LoadReport

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
_NEAR_END = 8  # a literal cut short ("fals", "-1e") fails a few characters before the end
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ArrayItem:
    """One decoded array item and where it starts."""

    index: int  # 0-based position in the array
    offset: int  # byte offset of the item's first byte in the file
    value: Any


class _TextBuffer:
    """Decoded text read in chunks, with byte offsets computed incrementally (O(file) in total)."""

    def __init__(self, stream: BinaryIO, name: str, chunk_bytes: int):
        self.stream, self.name, self.chunk_bytes = stream, name, chunk_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos, self.eof = "", 0, False
        self.bytes_read = 0
        self._mark, self._mark_bytes = 0, 0  # text[_mark] is at byte _mark_bytes of the file

    def byte_offset(self, i: int) -> int:
        """Byte offset in the file of ``text[i]``; ``i`` never moves backwards."""
        if i < self._mark:
            raise ValueError(f"byte offsets are computed forwards only ({i} < {self._mark})")
        self._mark_bytes += len(self.text[self._mark : i].encode("utf-8"))
        self._mark = i
        return self._mark_bytes

    def fill(self) -> bool:
        """Drop consumed text and append the next chunk; False at end of file."""
        if self.eof:
            return False
        self.byte_offset(self.pos)
        self.text, self._mark, self.pos = self.text[self.pos :], 0, 0
        chunk = self.stream.read(self.chunk_bytes)
        pending = len(self.decoder.getstate()[0])
        try:
            self.text += self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError as err:
            at = self.bytes_read - pending + err.start
            raise DataError(
                f"{self.name}: byte {at}: not valid UTF-8 ({err.reason})\n    fix: re-encode the file as UTF-8"
            ) from None
        self.bytes_read += len(chunk)
        self.eof = not chunk
        return True

    def peek(self) -> str:
        """Skip whitespace and return the next character ('' at end of file)."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.fill():
                return ""


def _input_ran_out(err: json.JSONDecodeError, text: str) -> bool:
    """True when the decode error is explained by the text ending (more input could fix it)."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip(_WHITESPACE)) - _NEAR_END


def _malformed(buf: _TextBuffer, index: int, start: int, at: int, what: str) -> DataError:
    """A DataError for item ``index`` starting at byte ``start``, wrong at text position ``at``."""
    return DataError(
        f"{buf.name}: item {index} (starts at byte {start}): {what} at byte {buf.byte_offset(at)}\n"
        "    fix: repair or remove this item so the file is one valid JSON array"
    )


def _decode_item(buf: _TextBuffer, decoder: json.JSONDecoder, index: int, start: int) -> tuple[Any, bool]:
    """Decode the item at ``buf.pos``; (value, True), or (None, False) when the file ends inside it."""
    while True:
        try:
            value, end = decoder.raw_decode(buf.text, buf.pos)
        except json.JSONDecodeError as err:
            if not _input_ran_out(err, buf.text):
                raise _malformed(buf, index, start, err.pos, f"invalid JSON: {err.msg.removesuffix(' at')}") from None
            if buf.fill():
                continue
            return None, False
        if end >= len(buf.text) and not isinstance(value, (dict, list)) and buf.fill():
            continue  # a bare number may continue in the next chunk
        buf.pos = end
        return value, True


def _record_cut(buf: _TextBuffer, index: int, offset: int, report: LoadReport, allow_truncated: bool) -> None:
    report.truncated_at_byte = offset
    report.file_bytes = buf.bytes_read
    msg = (
        f"{buf.name}: the file ends at byte {buf.bytes_read} inside item {index} (which starts at byte "
        f"{report.truncated_at_byte}); {index} complete item(s) were read"
    )
    if not allow_truncated:
        raise DataError(f"{msg}\n    fix: the file is truncated; restore the complete file")
    logger.warning("%s; the partial item was dropped", msg)


def iter_json_array(
    stream: BinaryIO, *, name: str, report: LoadReport, allow_truncated: bool, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[ArrayItem]:
    """Yield the items of the JSON array in ``stream`` (binary, UTF-8) one at a time.

    A file cut inside the array is recorded in ``report`` (``truncated_at_byte``, ``file_bytes``)
    and logged as a warning when ``allow_truncated``, else it is a :class:`DataError`.
    """
    buf = _TextBuffer(stream, name, chunk_bytes)
    decoder = json.JSONDecoder()
    if buf.peek() != "[":
        raise _malformed(buf, 0, 0, buf.pos, "the file does not start with '[' (expected one JSON array)")
    buf.pos += 1
    index, nxt = 0, buf.peek()
    while nxt != "]":
        offset = buf.byte_offset(buf.pos)  # before decoding: a refill drops the consumed text
        if nxt == "":
            _record_cut(buf, index, offset, report, allow_truncated)
            return
        value, complete = _decode_item(buf, decoder, index, offset)
        if not complete:
            _record_cut(buf, index, offset, report, allow_truncated)
            return
        yield ArrayItem(index=index, offset=offset, value=value)
        index += 1
        nxt = buf.peek()
        if nxt == ",":
            buf.pos += 1
            nxt = buf.peek()
            if nxt == "]":
                raise _malformed(buf, index, offset, buf.pos, "trailing ',' before ']'")
        elif nxt not in ("]", ""):
            raise _malformed(buf, index - 1, offset, buf.pos, f"expected ',' or ']' after this item, found {nxt!r}")
    buf.pos += 1
    if buf.peek() != "":
        raise _malformed(buf, index, buf.byte_offset(buf.pos), buf.pos, "unexpected data after the closing ']'")
