"""Shared pieces of the datagen tests: a prompt fixture with a held-out and an over-long prompt."""

import json
from pathlib import Path

import pytest

from eagleray.tests.support.datagen import FIXTURE

LONG_PROMPT = "tell me about " + "the quick brown fox and the lazy dog " * 40  # > max_prompt_tokens


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """The 20-prompt fixture plus one MT-bench question (held out) and one over-long prompt (fails)."""
    from eagleray.platform.prompts import iter_prompts

    mt = next(iter_prompts("mtbench")).messages[0].content
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    extra = [{"messages": [{"role": "user", "content": mt}]}, {"messages": [{"role": "user", "content": LONG_PROMPT}]}]
    path.write_text(FIXTURE.read_text() + "".join(json.dumps(r) + "\n" for r in extra))
    return path
