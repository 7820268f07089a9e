"""``python -m eagleray.jobs.train --config FILE`` (also ``ray job submit ... -- python -m ...``).

Trains an EAGLE-3 draft (eagleray.training: TTT on Ray Train, MLflow run, registered version).
With ``evaluate_with_engine: true`` it then measures real acceptance (τ) and speed with eagleray's
engine (:func:`eagleray.serve.measure.measure_draft`) and logs them to the same MLflow run; that glue
lives here, not in training, because training does not import serve (docs/architecture.md, import rules).
"""

from __future__ import annotations

import argparse
import sys

from eagleray.jobs.entry import add_set_argument, run_job
from eagleray.platform.config.load import load_yaml_config
from eagleray.platform.config.schemas import TrainingConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training YAML config (see jobs/configs/train-*.yaml)")
    add_set_argument(p, "max_steps=10")


def load_config(path: str, overrides: list[str]) -> TrainingConfig:
    return load_yaml_config(TrainingConfig, path, overrides)


def run(args: argparse.Namespace) -> int:
    from eagleray.training.trainer import train

    cfg = load_config(args.config, args.set)
    result = train(cfg, emit=lambda s: print(s, flush=True))
    if cfg.evaluate_with_engine:
        from eagleray.serve.measure import measure_draft
        from eagleray.training.tracking import StepLogger

        real = measure_draft(cfg, result.draft_dir)  # e.g. {"engine/tau": ..., "engine/tokens_per_s": ...}
        StepLogger(cfg.mlflow.tracking_uri, result.run_id)(real, int(result.metrics.get("step", 0)))
        print(f"train: engine measurement {real}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.train", add_arguments, run))
