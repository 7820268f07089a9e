"""Prompt files: JSONL, Parquet and JSON arrays, on local paths or any pyarrow filesystem URI.

The prompt column is detected per file from its first row (JSONL, JSON) or its schema (Parquet):
``messages`` (OpenAI role/content list), ``conversations`` (ShareGPT from/value list) or ``prompt``
(a string). Every other column goes to the record's ``meta``. Compression (``.gz``, ``.zst``,
``.bz2``) is detected from the file name. URIs (``s3://``, ``gs://``, ``hdfs://``, ``file://``)
are opened with ``pyarrow.fs.FileSystem.from_uri``.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagleray.platform.errors import DataError
from eagleray.platform.prompts.formats import check_columns, detect_form, record_of, require_object
from eagleray.platform.prompts.json_stream import iter_json_array
from eagleray.platform.prompts.records import PromptRecord
from eagleray.platform.prompts.report import LoadReport

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".json": "json"}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4")
PARQUET_BATCH_ROWS = 1024


def file_kind(path: str) -> str:
    """``jsonl``, ``parquet`` or ``json`` from the file name (a compression suffix is ignored)."""
    name = path.lower()
    for comp in _COMPRESSION_SUFFIXES:
        if name.endswith(comp):
            name = name[: -len(comp)]
    for suffix, kind in SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    raise DataError(
        f"{path}: cannot tell the file type from its name\n"
        f"    fix: use one of the suffixes {sorted(SUFFIXES)} (optionally + {list(_COMPRESSION_SUFFIXES)}), "
        "or a built-in source: 'sharegpt', 'mtbench', 'humaneval'"
    )


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and in-filesystem path of a local path or URI; the file must exist."""
    if "://" in path:
        try:
            fs, inner = pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:
            raise DataError(f"{path}: cannot open this URI ({err})\n    fix: check the scheme and credentials") from None
    else:
        fs, inner = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))
    info = fs.get_file_info(inner)
    if info.type != pafs.FileType.File:
        state = "does not exist" if info.type == pafs.FileType.NotFound else "is not a file"
        raise DataError(f"{path}: the prompt file {state}\n    fix: pass the path of an existing JSONL/Parquet/JSON file")
    return fs, inner


def iter_jsonl(fs: pafs.FileSystem, inner: str, name: str, report: LoadReport) -> Iterator[PromptRecord]:
    """Records of a JSON-lines file; the prompt column is detected from the first non-blank line."""
    form = None
    with fs.open_input_stream(inner) as raw, io.TextIOWrapper(raw, encoding="utf-8") as lines:
        for lineno, line in enumerate(_checked_lines(lines, name), start=1):
            if not line.strip():
                report.skip("blank_line")
                continue
            where = f"{name} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{where}: not valid JSON ({err.msg.removesuffix(' at')} at column {err.colno})\n"
                    "    fix: write exactly one JSON object per line"
                ) from None
            form = form or detect_form(row, where)
            report.items += 1
            rec = record_of(require_object(row, where), form, where, name, report, {})
            if rec is not None:
                yield rec


def _checked_lines(lines: io.TextIOWrapper, name: str) -> Iterator[str]:
    """The lines of a text stream, with a decoding error turned into a DataError."""
    lineno = 0
    try:
        for line in lines:
            lineno += 1
            yield line
    except UnicodeDecodeError as err:
        raise DataError(
            f"{name} near line {lineno + 1}: not valid UTF-8 ({err.reason})\n    fix: re-encode the file as UTF-8"
        ) from None


def iter_parquet(fs: pafs.FileSystem, inner: str, name: str, report: LoadReport) -> Iterator[PromptRecord]:
    """Records of a Parquet file, read in batches; the prompt column is detected from the schema."""
    with fs.open_input_file(inner) as handle:
        try:
            table = pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{name}: not a readable Parquet file ({err})\n    fix: pass a valid Parquet file") from None
        form = check_columns(table.schema_arrow.names, f"{name} (schema)")
        row_index = 0
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                report.items += 1
                rec = record_of(row, form, f"{name} row {row_index}", name, report, {})
                row_index += 1
                if rec is not None:
                    yield rec


def iter_json_file(
    stream: Any, name: str, source: str, report: LoadReport, *, form: str | None = None, allow_truncated: bool = False
) -> Iterator[PromptRecord]:
    """Records of a file holding one JSON array of rows, streamed item by item.

    ``form`` fixes the prompt column (else it is detected from the first item). A file cut inside
    the array is a DataError unless ``allow_truncated`` (then it is reported and logged).
    """
    for item in iter_json_array(stream, name=name, report=report, allow_truncated=allow_truncated):
        where = f"{name} item {item.index} (byte {item.offset})"
        form = form or detect_form(item.value, where)
        report.items += 1
        rec = record_of(require_object(item.value, where), form, where, source, report, {})
        if rec is not None:
            yield rec


def iter_file(path: str, report: LoadReport) -> Iterator[PromptRecord]:
    """Records of a prompt file of any supported kind; the record source is ``path``."""
    kind = file_kind(path)
    fs, inner = resolve(path)
    if kind == "jsonl":
        yield from iter_jsonl(fs, inner, path, report)
    elif kind == "parquet":
        yield from iter_parquet(fs, inner, path, report)
    else:
        with fs.open_input_stream(inner) as stream:
            yield from iter_json_file(stream, path, path, report)
