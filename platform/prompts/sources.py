"""One entry point for every prompt source: built-in names or a file path/URI."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from eagleray.platform.errors import DataError
from eagleray.platform.prompts.files import iter_file
from eagleray.platform.prompts.packages import iter_humaneval, iter_mtbench, iter_sharegpt
from eagleray.platform.prompts.records import PromptRecord, dedup
from eagleray.platform.prompts.report import LoadReport

logger = logging.getLogger(__name__)

BUILTIN_SOURCES = ("sharegpt", "mtbench", "humaneval")


def _records_of(source: str, report: LoadReport, mtbench_turns: str | None) -> Generator[PromptRecord, None, None]:
    name = source.lower()
    if mtbench_turns is not None and name != "mtbench":
        raise DataError(f"mtbench_turns={mtbench_turns!r} was given for source {source!r}\n    fix: use it only with 'mtbench'")
    if name == "sharegpt":
        return iter_sharegpt(report)
    if name == "mtbench":
        return iter_mtbench(report, mtbench_turns or "first")
    if name == "humaneval":
        return iter_humaneval(report)
    return iter_file(source, report)


def iter_prompts(
    source: str, *, limit: int | None = None, report: LoadReport | None = None, mtbench_turns: str | None = None
) -> Iterator[PromptRecord]:
    """Stream the prompt records of ``source``.

    ``source``: ``"sharegpt"``, ``"mtbench"``, ``"humaneval"`` (case-insensitive), or the path/URI
    of a ``.jsonl``/``.parquet``/``.json`` file. ``limit``: stop after this many records (reading
    stops there too). ``report`` is filled in as records are read (counts, skips, truncation).
    ``mtbench_turns``: ``"first"`` (default) or ``"separate"``, only for ``"mtbench"``.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit={limit!r} is not valid\n    fix: give a whole number >= 0, or None for all")
    report = report if report is not None else LoadReport(source)
    records = _records_of(source, report, mtbench_turns)
    started = time.perf_counter()
    try:
        for rec in records if limit != 0 else ():
            report.records += 1
            yield rec
            if limit is not None and report.records >= limit:
                break
        report.stopped_at_limit = limit is not None and report.records >= limit
    finally:
        records.close()
        report.seconds += time.perf_counter() - started
    logger.info("loaded prompts: %s", report.summary())


@dataclass
class LoadResult:
    """The records of one source and the report of how they were read. Iterable, has len()."""

    records: list[PromptRecord]
    report: LoadReport

    def __iter__(self) -> Iterator[PromptRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


def load_prompts(source: str, *, limit: int | None = None, mtbench_turns: str | None = None, dedupe: bool = False) -> LoadResult:
    """Load all prompt records of ``source`` (see :func:`iter_prompts`) into memory.

    ``dedupe``: drop records whose ``prompt_id`` repeats (first wins), counted in
    ``report.skipped["duplicate"]``; ``limit`` applies before deduplication.
    """
    report = LoadReport(source)
    records = list(iter_prompts(source, limit=limit, report=report, mtbench_turns=mtbench_turns))
    if dedupe:
        unique = dedup(records)
        if len(unique) < len(records):
            report.skipped["duplicate"] += len(records) - len(unique)
        records = unique
        report.records = len(records)
    return LoadResult(records=records, report=report)
