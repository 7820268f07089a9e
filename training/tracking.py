"""MLflow for training: the run and its params (driver), per-step metrics (rank 0), and at the end the
acceptance plot, the draft artifact and a registered model version (driver).

Logged: params = the flattened TrainingConfig + target/dataset facts; metrics per log step =
loss, ploss_i, acc_i, sim_tau, sim_tau_product, lr, grad_norm, tokens_per_s; at the end eval/* on
held-out data; artifacts = ``draft/`` (vLLM-loadable) and ``plots/acceptance.png``. The version is
tagged with target_fingerprint, tokenizer_fingerprint, aux_layer_ids, dataset_id and eval metrics.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from eagleray.platform import registry
from eagleray.platform.config.schemas import TrainingConfig

DRAFT_ARTIFACT = "draft"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = str(v)[:500]
    return out


def start_run(cfg: TrainingConfig, facts: dict[str, Any], run_name: str | None = None) -> str:
    """Create the run (params logged) and return its id; sets cfg.mlflow.tracking_uri to the URI in use."""
    import mlflow

    uri = registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    cfg.mlflow.tracking_uri = uri
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(cfg.mlflow.experiment)
    run = client.create_run(exp.experiment_id, run_name=run_name, tags={"eagleray.job": "train", **cfg.run_tags})
    params = {**flatten(cfg.model_dump(mode="json", exclude={"mlflow", "testing", "run_tags"})), **flatten(facts)}
    items = list(params.items())
    for i in range(0, len(items), 90):  # MLflow caps a batch at 100 params
        client.log_batch(run.info.run_id, params=[mlflow.entities.Param(k, v) for k, v in items[i : i + 90]])
    return run.info.run_id


class StepLogger:
    """Rank 0's metric logger: ``logger(metrics, step)``."""

    def __init__(self, tracking_uri: str | None, run_id: str):
        import mlflow

        registry.configure(tracking_uri)
        self.client, self.run_id, self.metric = mlflow.MlflowClient(), run_id, mlflow.entities.Metric

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self.metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        for i in range(0, len(batch), 900):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 900])

    def restarted(self, step: int) -> int:
        """Record a resume from the checkpoint of ``step``: metric ``resumed_from_step`` (at that step) and
        tag ``eagleray.restarts`` (how many resumes so far, this one included). Returns that count."""
        tags = self.client.get_run(self.run_id).data.tags
        count = int(tags.get("eagleray.restarts", "0")) + 1
        self.client.log_metric(self.run_id, "resumed_from_step", float(step), int(time.time() * 1000), step)
        self.client.set_tag(self.run_id, "eagleray.restarts", str(count))
        self.client.set_tag(self.run_id, f"eagleray.restart.{count}.resumed_from_step", str(step))
        return count


def record_restart_reason(cfg: TrainingConfig, run_id: str, reason: str) -> None:
    """Driver side: why the run is about to be restarted (tag ``eagleray.restart_reasons``, newest last)."""
    import mlflow

    registry.configure(cfg.mlflow.tracking_uri)
    client = mlflow.MlflowClient()
    old = client.get_run(run_id).data.tags.get("eagleray.restart_reasons")
    client.set_tag(run_id, "eagleray.restart_reasons", f"{old}; {reason}" if old else reason)


def acceptance_plot(metrics: dict[str, float], path: Path) -> Path | None:
    """Bar chart of per-position acceptance (train acc_i and eval/acc_i); matplotlib (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        name: [metrics[f"{p}acc_{i}"] for i in range(64) if f"{p}acc_{i}" in metrics]
        for name, p in (("train", ""), ("held-out", "eval/"))
    }
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(series)
    for j, (name, accs) in enumerate(series.items()):
        ax.bar([i + j * width for i in range(len(accs))], accs, width=width, label=name)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acc_i (draft argmax == target argmax)")
    tau = metrics.get("eval/sim_tau", metrics.get("sim_tau"))
    ax.set_title(f"EAGLE-3 per-position acceptance (simulated τ={tau:.2f})" if tau else "EAGLE-3 per-position acceptance")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finish_run(
    cfg: TrainingConfig, run_id: str, draft_dir: Path, metrics: dict[str, float], tags: dict[str, Any]
) -> registry.DraftVersion | None:
    """Log final metrics, the plot and the draft; register and alias the version; end the run."""
    import mlflow

    registry.configure(cfg.mlflow.tracking_uri)
    client = mlflow.MlflowClient()
    with tempfile.TemporaryDirectory() as tmp:
        plot = acceptance_plot(metrics, Path(tmp) / "acceptance.png")
        if plot is not None:
            client.log_artifact(run_id, str(plot), "plots")
    client.log_artifacts(run_id, str(draft_dir), DRAFT_ARTIFACT)
    version = None
    if cfg.register_model:
        metric_tags = {k: f"{v:.4f}" for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, float)}
        version = registry.register_draft(
            cfg.mlflow.registered_model,
            run_id,
            DRAFT_ARTIFACT,
            {**tags, **metric_tags},
            description=f"EAGLE-3 draft from run {run_id}",
        )
        if cfg.alias:
            registry.set_alias(version.name, cfg.alias, version.version)
        client.set_tag(run_id, "eagleray.model_version", version.uri)
    client.set_terminated(run_id, "FINISHED")
    return version
