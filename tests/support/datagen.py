"""Datagen test configs: the 20-prompt fixture and a small CPU run over it."""

from __future__ import annotations

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "datagen_prompts.jsonl"


def datagen_config(target: Path, prompts: Path, out: Path, **over) -> dict:
    """A small CPU config: tiny target, 8-token answers, 4 prompts per shard, one worker per stage."""
    cfg = {
        "prompts": [str(prompts)],
        "output_dir": str(out),
        "backend": "transformers",
        "target": {"model": str(target), "dtype": "fp32", "device": "cpu"},
        "generation": {"max_tokens": 8},
        "max_seq_len": 160,
        "max_prompt_tokens": 96,
        "rows_per_shard": 4,
        "batch_size": 4,
        "num_workers": 1,
        "cpus_per_worker": 0.5,
        "progress_seconds": 1,
    }
    cfg.update(over)
    return cfg


def expected_ids(cfg_dict: dict) -> set[str]:
    from eagleray.datagen.chunks import select_prompts
    from eagleray.platform.config.schemas import DatagenConfig

    return {r.prompt_id for r in select_prompts(DatagenConfig(**cfg_dict))[0]}
