"""The data-scaling run's picture (:mod:`eagleray.jobs.bench.draft_scaling` ``plot``): τ on MT-bench and HumanEval
(chain, T=0, measured with the engine) and the held-out simulated τ against the loss tokens each draft trained on,
one point per draft; optionally logged to MLflow with τ as metrics whose step is the data size."""

from __future__ import annotations

import json
from pathlib import Path

from eagleray.jobs.bench import common
from eagleray.jobs.bench.common import log_bench_run
from eagleray.jobs.bench.draft_scaling import log

SERIES = (  # (record key, label, style)
    ("tau_mtbench_chain", "τ MT-bench (chain k=4, engine)", "o-"),
    ("tau_humaneval_chain", "τ HumanEval (chain k=4, engine)", "s-"),
    ("sim_tau_heldout", "simulated τ, held-out ShareGPT answers", "^:"),
)


def data_tokens(record: dict) -> int:
    """A draft's place on the data axis: the loss tokens it learned since a fresh draft (a continued training's record
    says so in ``loss_tokens_cumulative``; ``loss_tokens`` is its own run's alone)."""
    return record.get("loss_tokens_cumulative") or record["loss_tokens"]


def curve(records: list[dict]) -> list[dict]:
    """The drafts with a loss-token count, least data first; every record must have been measured on MT-bench."""
    rows = sorted((r for r in records if r.get("loss_tokens")), key=data_tokens)
    missing = [r["data_fraction"] for r in rows if r.get("tau_mtbench_chain") is None]
    if len(rows) < 2 or missing:
        raise SystemExit(f"plot: need >= 2 drafts with loss_tokens and tau_mtbench_chain (got {len(rows)}, unmeasured {missing})")
    return rows


def rises(rows: list[dict], key: str = "tau_mtbench_chain") -> bool:
    """Whether τ grows from every data size to the next."""
    return common.rises([r[key] for r in rows])


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [data_tokens(r) for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label, style in SERIES:
        pts = [(x, r[key]) for x, r in zip(xs, rows) if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for x, r in zip(xs, rows):
        ax.annotate(
            r.get("label") or f"{r['data_fraction']:g}",
            (x, r["tau_mtbench_chain"]),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("loss-masked tokens learned since a fresh draft (labels: data fraction, or the run)")
    ax.set_ylabel("mean acceptance length τ")
    ax.set_title("SmolLM2-135M EAGLE-3 draft vs data (H200, bf16)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_to_mlflow(rows: list[dict], png: Path, experiment: str) -> str:
    """A run holding the PNG, the records and τ (MT-bench, HumanEval) with step = loss tokens; returns its id."""
    keys = ("tau_mtbench_chain", "tau_humaneval_chain")
    metrics = [(k, r[k], int(data_tokens(r))) for r in rows for k in keys if r.get(k) is not None]
    return log_bench_run(experiment, "draft-scaling", "bench draft_scaling", metrics, ("scaling.json", rows), png)


def plot_run(records_path: Path, png: Path, experiment: str | None) -> Path:
    rows = curve(json.loads(records_path.read_text()))
    plot(rows, png)
    taus = ", ".join(f"{r['data_fraction']:g}: {r['tau_mtbench_chain']}" for r in rows)
    log(f"plot: τ MT-bench by data fraction {taus}; rises with every doubling: {rises(rows)}; {png}")
    if experiment:
        log(f"plot: logged to MLflow run {log_to_mlflow(rows, png, experiment)} (experiment {experiment})")
    return png
