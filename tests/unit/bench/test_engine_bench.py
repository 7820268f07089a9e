"""`bench engine --prompt-ids`: token prompts for the 8B-shaped target on a machine without the tokenizer."""

from __future__ import annotations

import json

import pytest

from eagleray.jobs.bench.engine import _prompt_ids
from eagleray.platform.errors import EaglerayError


def test_prompt_ids_reads_a_json_list_of_token_lists_and_keeps_the_first_limit(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([[1, 2, 3], [4], [5, 6]]))
    assert _prompt_ids(str(path), 2) == [[1, 2, 3], [4]]


@pytest.mark.parametrize("bad", [[], [[]], [["a"]], {"ids": [[1]]}, [[1.5]]])
def test_prompt_ids_refuses_what_is_not_token_lists(tmp_path, bad):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(EaglerayError, match="--prompt-ids"):
        _prompt_ids(str(path), 80)
