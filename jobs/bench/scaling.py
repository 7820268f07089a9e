"""``eagleray bench scaling``: drafts trained on different amounts of data, side by side in one run.

    python -m eagleray.jobs.bench scaling --drafts DIR,DIR,... --prompts mtbench --limit 80 --max-tokens 64 --k 4 \\
        --batch 8 [--json OUT.json] [--plot OUT.png] [--mlflow-experiment NAME]

One target and one plain-decoding baseline, then chain speculation with every draft on the same prompts
(T=0): τ, acceptance per position, tokens/s, speedup and ``lossless`` (every output equal to the plain
one). Each draft's data size (shards, rows, loss-masked tokens), training step and held-out simulated τ
come from the metadata ``eagleray train`` writes into it. The table is sorted by data size; ``τ rises
with data`` says whether τ grows from each size to the next. The PNG plots τ and acc_0 against the
loss tokens trained on; with ``--mlflow-experiment`` the JSON and the PNG are logged to a new MLflow
run, with τ and acc_0 as metrics whose step is the data size (MLflow then charts τ against data).
"""

from __future__ import annotations

import argparse
import platform as std_platform
import time
from pathlib import Path

import torch

from eagleray.jobs.bench.common import add_engine_arguments, log_bench_run, prompt_messages, rises, run_suite
from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.checkpoints.guard import ensure_compatible
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine import EngineConfig, SamplingParams, close_target, load_draft, load_models
from eagleray.serve.measure import plain_run, spec_run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafts", required=True, help="comma list of draft directories written by `eagleray train`")
    add_engine_arguments(p, limit=80, batch=8)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--plot", type=Path, default=None, help="write the τ-against-data PNG here")
    p.add_argument("--mlflow-experiment", default=None, help="log JSON, PNG and metrics to a new run of this experiment")


def draft_facts(path: Path) -> dict:
    """Data size and training facts recorded in a draft's eagleray metadata; a clear error without them."""
    meta = DraftCheckpoint.open(path).metadata
    notes = meta.notes if meta is not None else {}
    if "data_loss_tokens" not in notes:
        raise EaglerayError(
            f"--drafts: {path} records no training data size (notes.data_loss_tokens)\n"
            f"    fix: pass drafts written by `eagleray train` from datagen shards"
        )
    return {
        "draft": str(path),
        "dataset_id": meta.dataset_id,
        "step": notes.get("step"),
        "data_shards": notes.get("data_shards"),
        "data_rows": notes.get("data_rows"),
        "data_loss_tokens": notes["data_loss_tokens"],
        "eval_sim_tau": notes.get("eval/sim_tau"),
    }


def measure_args(args) -> dict:
    paths = [Path(d) for d in args.drafts.split(",") if d]
    facts = sorted((draft_facts(p) for p in paths), key=lambda f: f["data_loss_tokens"])
    messages = prompt_messages(args)
    tcfg = TargetConfig(model=args.target, dtype=args.dtype, device=args.device)
    target, _, tok, device = load_models(tcfg, None)  # each draft is guarded and loaded below
    spec = TargetSpec.from_dir(resolve_target(tcfg.model, tcfg.dtype))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows = []
    try:
        run_cfg = EngineConfig(target=tcfg, max_num_seqs=args.batch, profile_steps=True)
        token_prompts, plain, t_plain, _ = plain_run(target, tok, run_cfg, messages, params)
        for f in facts:
            dcfg = DraftConfig(source=f["draft"], num_speculative_tokens=args.k, policy=PolicyConfig(adaptive=False))
            report = ensure_compatible(spec, Path(f["draft"]), algorithm=dcfg.algorithm)
            target.set_aux_layers(report.facts["aux_layer_ids"])
            draft = load_draft(Path(f["draft"]), target, device)
            spec_cfg = run_cfg.model_copy(update={"draft": dcfg})
            rows.append({**f, **spec_run(target, draft, tok, spec_cfg, token_prompts, params, plain, t_plain)})
    finally:
        close_target(target)
    taus = [r["tau"] for r in rows]
    return {
        "target": args.target,
        "prompts": args.prompts,
        "num_prompts": len(messages),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "batch": args.batch,
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "machine": std_platform.processor() or std_platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "plain": rows[0]["plain"],
        "drafts": rows,
        "tau_rises_with_data": rises(taus),
        "lossless": all(r["lossless"] for r in rows),
    }


def plot(result: dict, path: Path) -> Path:
    """τ and acc_0 against the loss-masked tokens trained on (log scale), one point per draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["data_loss_tokens"] for r in result["drafts"]]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(xs, [r["tau"] for r in result["drafts"]], "o-", label="τ (real, engine)")
    sim = [(x, r["eval_sim_tau"]) for x, r in zip(xs, result["drafts"]) if r["eval_sim_tau"] is not None]
    if sim:
        ax.plot(*zip(*sim), "s--", label="simulated τ (held-out shards)")
    ax.set_xscale("log")
    ax.set_xlabel("loss-masked tokens trained on")
    ax.set_ylabel("mean acceptance length τ")
    acc = ax.twinx()
    acc.plot(xs, [r["acceptance_per_pos"][0] for r in result["drafts"]], "^:", color="tab:green", label="acc position 0")
    acc.set_ylabel("acceptance at position 0")
    ax.set_title(f"EAGLE-3 draft vs data: {result['num_prompts']} {result['prompts']} prompts, chain k={result['k']}")
    lines = ax.get_legend_handles_labels()[0] + acc.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_to_mlflow(result: dict, experiment: str, png: Path | None) -> str:
    """A run holding the JSON, the PNG and τ / acc_0 with step = loss tokens trained on; returns its id."""
    steps = [(r, int(r["data_loss_tokens"])) for r in result["drafts"]]
    metrics = [(k, v, step) for r, step in steps for k, v in (("tau", r["tau"]), ("acc_0", r["acceptance_per_pos"][0]))]
    return log_bench_run(experiment, "bench-scaling", "bench scaling", metrics, ("bench-scaling.json", result), png)


def print_table(r: dict) -> None:
    print(
        f"\nplain (eagleray): {r['plain']['tokens_per_s']:.2f} tok/s; {r['num_prompts']} {r['prompts']} prompts, "
        f"{r['max_tokens']} tokens, chain k={r['k']}, batch {r['batch']}, T=0, {r['device']} {r['dtype']}"
    )
    print(
        f"{'rows':>7}{'loss tokens':>13}{'step':>6}{'sim τ':>7}{'τ':>7}{'acc per position':>32}{'tok/s':>8}{'speedup':>9}{'lossless':>9}"
    )
    for d in r["drafts"]:
        acc = ", ".join(f"{a:.3f}" for a in d["acceptance_per_pos"])
        sim = f"{d['eval_sim_tau']:.3f}" if d["eval_sim_tau"] is not None else "-"
        print(
            f"{d['data_rows']:>7}{d['data_loss_tokens']:>13}{d['step']:>6}{sim:>7}{d['tau']:>7.3f}{acc:>32}"
            f"{d['spec']['tokens_per_s']:>8.2f}{d['speedup']:>8.2f}x{str(d['lossless']):>9}"
        )
    print(f"τ rises with data: {r['tau_rises_with_data']}; lossless: {r['lossless']}")


def _measure(args) -> dict:
    result = measure_args(args)
    png = plot(result, args.plot) if args.plot else None
    if args.mlflow_experiment:
        result["mlflow_run_id"] = log_to_mlflow(result, args.mlflow_experiment, png)
    return result


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    """Entry for `eagleray bench scaling` and the bench dispatcher (an argv list)."""
    return run_suite(args, "eagleray bench scaling", __doc__, add_arguments, _measure, print_table)
