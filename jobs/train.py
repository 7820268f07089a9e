"""``python -m eagleray.jobs.train --config FILE`` (also ``ray job submit ... -- python -m ...``).

Trains an EAGLE-3 draft (eagleray.training: TTT on Ray Train, MLflow run, registered version).
With ``evaluate_with_engine: true`` it then measures real acceptance (τ) and speed with eagleray's
engine bench and logs them to the same MLflow run; that glue lives here, not in training, because
training may not import serve (DESIGN.md, Layout). The bench is
:func:`eagleray.jobs.bench.spec.measure`; if it cannot be imported the flag is refused up front.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from eagleray.jobs.cli import run_job
from eagleray.platform.config.load import load_yaml_config
from eagleray.platform.errors import EaglerayError
from eagleray.platform.config.schemas import TrainingConfig

ENGINE_BENCH = "eagleray.jobs.bench.spec"  # module expected to expose measure(cfg, draft_dir) -> dict of metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="training YAML config (see jobs/configs/train-*.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a config field, dotted, value as JSON or a bare string (e.g. --set max_steps=10)")


def load_config(path: str, overrides: list[str]) -> TrainingConfig:
    return load_yaml_config(TrainingConfig, path, overrides)


def _engine_bench():
    if importlib.util.find_spec("eagleray.serve.engine") is None or importlib.util.find_spec(ENGINE_BENCH) is None:
        return None
    return importlib.import_module(ENGINE_BENCH)


def run(args: argparse.Namespace) -> int:
    from eagleray.training.trainer import train

    cfg = load_config(args.config, args.set)
    bench = _engine_bench() if cfg.evaluate_with_engine else None
    if cfg.evaluate_with_engine and bench is None:
        raise EaglerayError(f"evaluate_with_engine is true but eagleray's engine bench ({ENGINE_BENCH}) is not available\n"
                            f"    fix: set evaluate_with_engine: false (simulated τ on held-out data is still logged)")
    result = train(cfg, emit=lambda s: print(s, flush=True))
    if bench is not None:
        from eagleray.training.tracking import StepLogger

        real = bench.measure(cfg, result.draft_dir)  # e.g. {"engine/tau": ..., "engine/tokens_per_s": ...}
        StepLogger(cfg.mlflow.tracking_uri, result.run_id)(real, int(result.metrics.get("step", 0)))
        print(f"train: engine bench {real}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.train", add_arguments, run))
