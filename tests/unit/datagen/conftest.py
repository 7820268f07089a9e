"""Shared pieces of the datagen tests: a prompt fixture with a held-out and an over-long prompt."""

import json
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "datagen_prompts.jsonl"
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


def datagen_config(target: Path, prompts: Path, out: Path, **over) -> dict:
    """A small CPU config: tiny target, 8-token answers, 4 prompts per shard, one worker per stage."""
    cfg = {"prompts": [str(prompts)], "output_dir": str(out), "backend": "transformers",
           "target": {"model": str(target), "dtype": "fp32", "device": "cpu"},
           "generation": {"max_tokens": 8}, "max_seq_len": 160, "max_prompt_tokens": 96,
           "rows_per_shard": 4, "batch_size": 4, "num_workers": 1, "cpus_per_worker": 0.5, "progress_seconds": 1}
    cfg.update(over)
    return cfg


def expected_ids(cfg_dict: dict) -> set[str]:
    from eagleray.datagen.chunks import select_prompts
    from eagleray.platform.config.schemas import DatagenConfig

    return {r.prompt_id for r in select_prompts(DatagenConfig(**cfg_dict))[0]}
