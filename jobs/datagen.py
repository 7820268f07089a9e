"""``python -m eagleray.jobs.datagen --config FILE`` (also ``ray job submit ... -- python -m ...``).

Regenerates responses with the target and writes aux hidden-state shards; see eagleray.datagen.
A rerun with the same config resumes: finished prompts are skipped.
"""

from __future__ import annotations

import argparse
import sys

from eagleray.jobs.entry import add_set_argument, run_job
from eagleray.platform.config.load import load_yaml_config
from eagleray.platform.config.schemas import DatagenConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="datagen YAML config (see jobs/configs/datagen-*.yaml)")
    add_set_argument(p, "limit=100")
    p.add_argument("--dry-run", action="store_true", help="print the prompt counts and the estimate, write nothing")


def load_config(path: str, overrides: list[str]) -> DatagenConfig:
    return load_yaml_config(DatagenConfig, path, overrides)


def run(args: argparse.Namespace) -> int:
    from eagleray.datagen.pipeline import dry_run, run_datagen

    cfg = load_config(args.config, args.set)
    if args.dry_run:
        dry_run(cfg, emit=lambda s: print(s, flush=True))
        return 0
    manifest = run_datagen(cfg, emit=lambda s: print(s, flush=True))
    return 0 if manifest["rows"] > 0 or manifest["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.datagen", add_arguments, run))
