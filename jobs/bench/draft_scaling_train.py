"""The training stage of the data-scaling run (:mod:`eagleray.jobs.bench.draft_scaling`): one trainer process per
data fraction on the GPU (the loop of ``eagleray train`` in a local session: no Ray or MLflow on a lent GPU image),
a deadline that keeps each trainer's newest checkpoint, and the loss tokens each fraction holds."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from eagleray.jobs.bench.draft_scaling import _draft_dir, _fractions, _shared_options, _wait, _write, log

BACKSTOP_S = 180.0  # a trainer still running this long past its --train-minutes budget is stopped


def fraction_steps(args: argparse.Namespace, fraction: float, rows: int) -> int:
    """Optimizer steps for one fraction: ``--steps``, or with ``--epochs`` that many passes over its conversations."""
    if args.epochs is None:
        return args.steps
    return max(1, math.ceil(args.epochs * max(1, int(rows * fraction)) / args.train_batch))


def given_drafts(args: argparse.Namespace) -> dict[float, Path]:
    """``--given FRACTION=DIR`` options -> {fraction: draft dir}; each must name a listed fraction and a draft."""
    out = {}
    for item in args.given:
        frac, sep, path = item.partition("=")
        try:
            f = float(frac)
        except ValueError:
            f = None
        if not sep or f is None or f not in _fractions(args):
            raise SystemExit(f"--given {item!r}: expected FRACTION=DIR with FRACTION one of --fractions {args.fractions}")
        if not (Path(path) / "config.json").is_file():
            raise SystemExit(f"--given {item!r}: {path} has no config.json (pass a draft directory in the vLLM format)")
        out[f] = Path(path)
    return out


def place_given(args: argparse.Namespace, fraction: float, src: Path) -> None:
    """A draft trained elsewhere becomes this fraction's final draft; train.json says where it came from."""
    final = _draft_dir(args, fraction) / "final-draft"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(src, final)
    _write(_draft_dir(args, fraction) / "train.json", {"data_fraction": fraction, "given": str(src)})
    log(f"train {fraction:g}: given ({src}), not trained here")


def train_config(args: argparse.Namespace, fraction: float, rows: int):
    from eagleray.platform.config.schemas import TrainingConfig

    steps = fraction_steps(args, fraction, rows)
    return TrainingConfig(
        data_dir="online",
        online={
            "prompts": [str(args.work / "conversations.jsonl")] + ([args.extra_prompts] if args.extra_prompts else []),
            "limit": max(1, int(rows * fraction)),
            "loss_turns": "all",
            "vocab_count_rows": 4000,
        },
        target={"model": args.target, "dtype": args.dtype, "device": args.device},
        output_dir=str(_draft_dir(args, fraction)),
        init_from=args.init_from,
        draft_vocab_size=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        learning_rate=args.lr,
        warmup_steps=min(100, steps // 10),
        min_lr_ratio=args.min_lr_ratio,
        max_steps=steps,
        max_minutes=args.train_minutes,
        batch_size=args.train_batch,
        max_seq_len=args.train_seq_len,
        shuffle_buffer=256,
        eval_fraction=0.02,
        eval_batches=20,
        checkpoint_every=max(steps // 12, 1) if args.train_minutes is None else 500,
        log_every=50,
        backend="local",
        use_gpu=args.device == "cuda",
        register_model=False,
        alias=None,
    )


def train_one(args: argparse.Namespace) -> dict:
    """One fraction, in this process (no Ray, no MLflow: neither is on the GPU image)."""
    from eagleray.training.loop import train_worker
    from eagleray.training.plan import make_plan
    from eagleray.training.session import LocalSession

    rows = sum(1 for _ in (args.work / "conversations.jsonl").open(encoding="utf-8"))
    cfg = train_config(args, args.fraction, rows)
    out = Path(cfg.output_dir)
    session = LocalSession(out / "checkpoints")
    t0 = time.perf_counter()
    metrics = train_worker(cfg, session, None)
    ckpt = session.latest_checkpoint()
    final = out / "final-draft"
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(ckpt / "draft", final)
    facts = make_plan(cfg).data_facts
    summary = {
        "data_fraction": args.fraction,
        "conversations": cfg.online.limit,
        "steps": int(metrics.get("step", cfg.max_steps)),
        "train_s": round(time.perf_counter() - t0, 1),
        "metrics": metrics,
        **facts,
    }
    _write(out / "train.json", summary)
    log(f"train {args.fraction:g}: done in {summary['train_s']} s, sim_tau {metrics.get('eval/sim_tau')}")
    return summary


def train_all(args: argparse.Namespace) -> list[dict]:
    fractions = _fractions(args)
    given = given_drafts(args)
    for f, src in given.items():
        place_given(args, f, src)
    procs = []
    base = [sys.executable, "-m", "eagleray.jobs.bench.draft_scaling", "train-one"]
    opts = _shared_options(args)
    trained = [f for f in fractions if f not in given]
    for f in trained:
        d = _draft_dir(args, f)
        d.mkdir(parents=True, exist_ok=True)
        log_file = open(d / "train.log", "a")
        procs.append(subprocess.Popen(base + ["--fraction", str(f)] + opts, stdout=log_file, stderr=subprocess.STDOUT))
    counter = threading.Thread(target=_count_loss_tokens, args=(args, fractions), daemon=True)
    counter.start()
    deadline = time.perf_counter() + 60 * args.train_minutes + BACKSTOP_S if args.train_minutes else None
    _wait(procs, lambda: _train_progress(args, trained), "train", deadline=deadline)
    for f, p in zip(trained, procs):
        if p.returncode != 0:
            _keep_latest(args, f, p.returncode)
    counter.join()
    return [json.loads((_draft_dir(args, f) / "train.json").read_text()) for f in fractions]


def _keep_latest(args: argparse.Namespace, fraction: float, code: int) -> None:
    """A trainer stopped at the deadline (or failed): its latest checkpoint's draft becomes the final one."""
    d = _draft_dir(args, fraction)
    ckpts = sorted((d / "checkpoints").glob("step-*"))
    if not ckpts:
        raise RuntimeError(f"train {fraction:g}: exit code {code} and no checkpoint; see {d / 'train.log'}")
    shutil.rmtree(d / "final-draft", ignore_errors=True)
    shutil.copytree(ckpts[-1] / "draft", d / "final-draft")
    step = int(ckpts[-1].name.split("-")[1])
    _write(
        d / "train.json", {"data_fraction": fraction, "steps": step, "stopped": f"exit code {code} at the deadline or on failure"}
    )
    log(f"train {fraction:g}: stopped (exit {code}); kept checkpoint {ckpts[-1].name}")


def _count_loss_tokens(args: argparse.Namespace, fractions: list[float]) -> None:
    """Loss-masked tokens of each fraction's training rows (the first ``fraction`` of the conversations, held-out
    rows excluded, every assistant turn) -> loss_tokens.json; runs beside the trainers."""
    from transformers import AutoTokenizer

    from eagleray.platform.checkpoints.target import resolve_target
    from eagleray.platform.prompts.sources import iter_prompts
    from eagleray.training.data import is_eval
    from eagleray.training.online import tokenize

    rows = sum(1 for _ in (args.work / "conversations.jsonl").open(encoding="utf-8"))
    cfg = train_config(args, 1.0, rows)
    tok = AutoTokenizer.from_pretrained(str(resolve_target(args.target, args.dtype)))
    limits = {f: max(1, int(rows * f)) for f in fractions}
    sums = dict.fromkeys(fractions, 0)
    for source in cfg.online.prompts:  # each source cut at the fraction's limit, as training cuts it
        for seen, rec in enumerate(iter_prompts(source), 1):
            if is_eval(rec.prompt_id, cfg.eval_fraction):
                continue
            t = tokenize(tok, [m.to_dict() for m in rec.messages], cfg.max_seq_len, "all")
            n = sum(t[1]) if t is not None else 0
            for f in fractions:
                sums[f] += n if seen <= limits[f] else 0
    _write(args.work / "loss_tokens.json", {f"{f:g}": sums[f] for f in fractions})


def _train_progress(args, fractions) -> str:
    parts = []
    for f in fractions:
        ckpts = sorted((_draft_dir(args, f) / "checkpoints").glob("step-*"))
        parts.append(f"{f:g}: {ckpts[-1].name if ckpts else '-'}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------------- eval
