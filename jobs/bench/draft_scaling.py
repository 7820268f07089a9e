"""The data-scaling run on one GPU machine (issue 15): regenerate ShareGPT turn by turn, train drafts on
1/8, 1/4, 1/2 and all of it with the target in the loop, measure every draft with the engine.

`python -m eagleray.jobs.bench.draft_scaling all --prompts convs.jsonl --eval-prompts mtbench.jsonl,humaneval.jsonl --work /root/ds`

Stages (each also a subcommand, each resumable from the files of ``--work``):

- ``regen``: ``--procs`` processes of ``python -m eagleray.jobs.regenerate --shard I/N`` (answer_turns all:
  every user turn answered on the target's own history, continuous batching, left truncation counted) on one
  GPU; their outputs are read back and merged -> ``regen.json`` (prompts_in, answered, errors, truncated,
  lost, duplicated, wall_s, generated_tokens, target).
- ``train``: one process per data fraction, concurrently on the GPU: the training loop of ``eagleray train``
  (:func:`eagleray.training.loop.train_worker`, local session: Ray is not on the GPU image) with the target
  computing hidden states online, every assistant turn learned; the same number of steps for every fraction, or
  with ``--epochs`` the same number of passes over each fraction's data. ``--given 1=DIR`` puts a draft trained
  elsewhere on the same answers (e.g. the shipped champion) in a fraction's place: evaluated, not retrained.
- ``eval``: per draft, with ``LLMEngine`` (what Serve runs): τ on MT-bench and HumanEval (chain k, T=0,
  batch 8), lossless (greedy spec == plain), the batch-1 speedup on MT-bench; for the best draft also the
  tree, T=1 and the 32k/8k-vocab comparison when present -> ``scaling.json`` (one record per draft).
- ``plot`` (here, after a lease): ``scaling.json`` -> τ against the loss tokens trained on (``--out``, a PNG), and with
  ``--mlflow-experiment`` the PNG, the JSON and τ per data size (step = loss tokens) logged to a new MLflow run.

Progress lines go to stdout with ETAs; the JSON files are rewritten after each record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

FRACTIONS = (0.125, 0.25, 0.5, 1.0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", choices=["all", "regen", "train", "train-one", "eval", "eval-one", "pack", "plot"])
    p.add_argument("--tree", action="store_true", help="eval-one: also the tree (eager verification) and T=1")
    p.add_argument("--decode-path", default="auto", choices=["auto", "rows", "varlen"], help="eval-one: engine.decode_path")
    p.add_argument(
        "--out", type=Path, default=None, help="pack: where the best draft (bf16, split) and the answers go; plot: the PNG"
    )
    p.add_argument("--mlflow-experiment", default=None, help="plot: also log the PNG, the JSON and τ per data size to MLflow")
    p.add_argument("--work", type=Path, required=True, help="working directory (answers, drafts, JSON)")
    p.add_argument("--target", default="smollm2", help="target model: smollm2 or a HF directory")
    p.add_argument("--prompts", default=None, help="conversations JSONL (regen input; `eagleray regenerate --prompts-only`)")
    p.add_argument("--limit", type=int, default=None, help="regen: at most this many conversations")
    p.add_argument("--procs", type=int, default=4, help="regen: engine processes sharing the GPU")
    p.add_argument("--batch", type=int, default=256, help="regen: conversations in flight per process")
    p.add_argument("--max-tokens", type=int, default=256, help="regen: answer tokens per turn")
    p.add_argument("--max-seq-len", type=int, default=4096, help="regen: prompt + answer tokens (prompts cut from the left)")
    p.add_argument("--kv-cache-gib", type=float, default=16.0, help="regen: KV cache per process")
    p.add_argument("--temperature", type=float, default=0.0, help="regen: sampling temperature (0: greedy; a seed per prompt)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="regen: base seed of the per-prompt sampling seeds (generation.seed; 0 as runs 4 and 5: another base "
        "samples other answers at the same temperature)",
    )
    p.add_argument(
        "--single-turns",
        choices=["first", "all"],
        default=None,
        help="regen: answer user turns as single-turn requests (the shape a served request has): each conversation's "
        "first user turn, or every user turn on its own, without the turns before it",
    )
    p.add_argument(
        "--extra-prompts",
        default=None,
        help="train: more answered conversations (another regen's conversations.jsonl, e.g. sampled first turns) learned "
        "beside each fraction's (at most as many as the fraction has: online.limit counts per source)",
    )
    p.add_argument("--init-from", default=None, help="train: start from this draft (TrainingConfig.init_from), not a fresh one")
    p.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="train: data fractions")
    p.add_argument("--fraction", type=float, default=1.0, help="train-one: the data fraction")
    p.add_argument("--steps", type=int, default=1500, help="train: optimizer steps per draft (same for every fraction)")
    p.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="train: passes over each fraction's conversations instead of --steps (steps = epochs x conversations / "
        "--train-batch: every fraction is trained the same number of times over its data, so larger ones take more steps)",
    )
    p.add_argument(
        "--given",
        action="append",
        default=[],
        metavar="FRACTION=DIR",
        help="train: a draft trained elsewhere on this FRACTION of the same answers (its final-draft directory, e.g. the "
        "shipped champion for 1): not trained again, evaluated beside the others",
    )
    p.add_argument(
        "--b1",
        default="all",
        choices=["all", "largest"],
        help="eval: the batch-1 speedup for every draft, or only the largest fraction's (which also gets tree and T=1)",
    )
    p.add_argument(
        "--train-minutes",
        type=float,
        default=None,
        help="train: each trainer's wall-clock budget (TrainingConfig.max_minutes: the cosine schedule is fitted to it and "
        "the trainer stops with its final checkpoint and eval); a trainer still running 3 minutes past it is stopped and "
        "its latest checkpoint kept (a safety net for a lease)",
    )
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="train: the cosine's floor, a share of --lr")
    p.add_argument("--train-batch", type=int, default=8, help="train: conversations per step")
    p.add_argument("--train-seq-len", type=int, default=2048, help="train: tokens per conversation")
    p.add_argument("--ttt-steps", type=int, default=5, help="train: unrolled TTT steps")
    p.add_argument("--lr", type=float, default=5e-4, help="train: peak learning rate")
    p.add_argument("--draft-vocab", type=int, default=8192, help="train: draft vocabulary size")
    p.add_argument("--eval-prompts", default="mtbench,humaneval", help="eval: MT-bench and HumanEval sources (names or JSONL)")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="eval: tokens per answer (EOS ends earlier)")
    p.add_argument("--k", type=int, default=4, help="eval: chain length")
    p.add_argument("--eval-max-model-len", type=int, default=2048, help="eval: the engines' max_model_len")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="target dtype")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where every stage runs (cpu: to check the run)")


# ----------------------------------------------------------------------------------------------- regen
def regen(args: argparse.Namespace) -> dict:
    import yaml

    from eagleray.datagen.answers_only import count_output, errors_path

    work = args.work / "regen"
    work.mkdir(parents=True, exist_ok=True)
    prompts = Path(args.prompts)
    if args.single_turns:
        prompts = single_turns(prompts, work / f"single-turns-{args.single_turns}.jsonl", args.single_turns)
    cfg = regen_config(args, prompts, work)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))
    parts = [work / f"part{i}.jsonl" for i in range(args.procs)]
    resumed = _regen_turns(parts)  # answers of an earlier lease brought back and carried in: they are kept
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "eagleray.jobs.regenerate", "--config", str(work / "config.yaml"), "--out", str(part)]
            + ["--shard", f"{i}/{args.procs}", "--device", args.device],
            stdout=open(work / f"part{i}.log", "a"),
            stderr=subprocess.STDOUT,
        )
        for i, part in enumerate(parts)
    ]
    _wait(procs, lambda: _regen_progress(parts), "regen")
    wall = time.perf_counter() - t0
    manifests = [json.loads((work / f"part{i}.jsonl.manifest.json").read_text()) for i in range(args.procs)]
    merged = args.work / "conversations.jsonl"
    with merged.open("w", encoding="utf-8") as fh:
        for part in parts:
            fh.write(part.read_text(encoding="utf-8"))
    with (args.work / "conversations.errors.jsonl").open("w", encoding="utf-8") as fh:
        for part in parts:
            fh.write(errors_path(part).read_text(encoding="utf-8"))
    expected = _expected_turns(prompts, args.limit)
    counts = count_output(merged, expected)  # read back from the merged files, against the input
    result = {
        "prompts_in": counts["turns_in"],
        "conversations": counts["conversations"],
        "answered": counts["answered"],
        "errors": counts["errors"],
        "truncated": counts["truncated"],
        "lost": counts["lost"],
        "duplicated": counts["duplicated"],
        "wall_s": round(wall, 1),
        "generated_tokens": sum(m["this_run"]["generated_tokens"] for m in manifests),
        "target": {"model": "SmolLM2-135M-Instruct" if args.target == "smollm2" else args.target, "dtype": args.dtype}
        | {k: manifests[0][k] for k in ("target_fingerprint", "tokenizer_fingerprint")},
        "device": _device_name(),
        "processes": args.procs,
        "in_flight_per_process": args.batch,
        "generation": manifests[0]["generation"],
        "max_prompt_tokens": manifests[0]["max_prompt_tokens"],
        "per_process": [m["this_run"] for m in manifests],
        "resumed_turns": resumed,  # answered by an earlier lease (wall_s and generated_tokens count this run only)
    }
    result["tokens_per_s"] = round(result["generated_tokens"] / max(wall, 1e-9), 1)
    _write(args.work / "regen.json", result)
    _pack_answers(args, args.work / "early")  # at once: a lease can end before the drafts are done
    log(
        f"regen: {result['answered']} of {result['prompts_in']} turns answered, {result['errors']} errors, {result['truncated']} "
        f"truncated, {result['lost']} lost, {result['duplicated']} duplicated; {result['generated_tokens']} tokens in {wall:.0f} s "
        f"({result['tokens_per_s']} tok/s)"
    )
    return result


def regen_config(args: argparse.Namespace, prompts: Path, work: Path) -> dict:
    """The datagen config each regen process runs (``jobs/regenerate``)."""
    return {
        "prompts": [str(prompts.resolve())],
        "output_dir": str(work),
        "backend": "eagleray",
        "split_turns": False,
        "answer_turns": "all",
        "hold_out_eval": False,  # the exported conversations were held out against MT-bench/HumanEval already
        "target": {"model": args.target, "dtype": args.dtype, "device": args.device},
        "generation": {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed},
        "max_seq_len": args.max_seq_len,
        "batch_size": args.batch,
        "kv_cache_gib": args.kv_cache_gib,
        "progress_seconds": 30,
        **({"limit": args.limit} if args.limit else {}),
    }


def single_turns(src: Path, out: Path, which: str = "first") -> Path:
    """``src``'s user turns as single-turn conversations -> ``out``: the first user message of each conversation
    (``which="first"``) or every user message on its own (``"all"``), a system message before the first kept."""
    from eagleray.platform.prompts import iter_prompts

    with out.open("w", encoding="utf-8") as fh:
        for rec in iter_prompts(str(src)):
            msgs = [m.to_dict() for m in rec.messages]
            users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
            system = [m for m in msgs[: users[0]] if m["role"] == "system"] if users else []
            for i in users[:1] if which == "first" else users:
                fh.write(json.dumps({"messages": [*system, msgs[i]]}, ensure_ascii=False) + "\n")
    return out


def _expected_turns(prompts: Path, limit: int | None) -> dict[str, int]:
    from eagleray.platform.prompts import iter_prompts

    out: dict[str, int] = {}
    for rec in iter_prompts(str(prompts)):
        if limit is not None and len(out) >= limit:
            break
        out.setdefault(rec.prompt_id, sum(m.role == "user" for m in rec.messages))
    return out


def _regen_turns(parts: list[Path]) -> int:
    """User turns answered so far in the regen's output parts."""
    turns = 0
    for p in parts:
        if p.is_file():
            with p.open(encoding="utf-8") as fh:
                turns += sum(line.count('"role": "user"') for line in fh)
    return turns


def _regen_progress(parts: list[Path]) -> str:
    return f"{_regen_turns(parts)} turns written"


# ----------------------------------------------------------------------------------------------- train
def _draft_dir(args: argparse.Namespace, fraction: float) -> Path:
    return args.work / "drafts" / f"frac-{fraction:g}"


def _fractions(args: argparse.Namespace) -> list[float]:
    return [float(x) for x in args.fractions.split(",")]


def _shared_options(args: argparse.Namespace) -> list[str]:
    """The options a child process (train-one, eval-one) needs to see the same run."""
    out = ["--work", str(args.work), "--target", args.target, "--dtype", args.dtype, "--device", args.device]
    out += ["--steps", str(args.steps), "--train-batch", str(args.train_batch), "--train-seq-len", str(args.train_seq_len)]
    out += ["--ttt-steps", str(args.ttt_steps), "--lr", str(args.lr), "--draft-vocab", str(args.draft_vocab)]
    out += ["--min-lr-ratio", str(args.min_lr_ratio)] + (
        ["--train-minutes", str(args.train_minutes)] if args.train_minutes else []
    )
    out += ["--eval-prompts", args.eval_prompts, "--eval-max-tokens", str(args.eval_max_tokens), "--k", str(args.k)]
    out += ["--eval-max-model-len", str(args.eval_max_model_len), "--fractions", args.fractions, "--b1", args.b1]
    out += ["--epochs", str(args.epochs)] if args.epochs is not None else []
    out += ["--extra-prompts", args.extra_prompts] if args.extra_prompts else []
    out += ["--init-from", args.init_from] if args.init_from else []
    return out + [x for g in args.given for x in ("--given", g)]


def _wait(procs: list[subprocess.Popen], progress, name: str, every: float = 30.0, deadline: float | None = None) -> None:
    """Wait for every process (a progress line every ``every`` s); past ``deadline`` (perf_counter) they are
    terminated and the caller handles their exit codes; without one a failure raises."""
    t0 = last = time.perf_counter()
    while any(p.poll() is None for p in procs):
        time.sleep(1.0)
        if time.perf_counter() - last >= every:
            last = time.perf_counter()
            log(f"{name}: {progress()} ({last - t0:.0f} s)")
        if deadline is not None and time.perf_counter() > deadline:
            log(f"{name}: deadline reached; stopping {sum(p.poll() is None for p in procs)} process(es)")
            for p in procs:
                p.terminate() if p.poll() is None else None
            for p in procs:
                p.wait()
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad and deadline is None:
        raise RuntimeError(f"{name}: process(es) {bad} failed (exit codes {[procs[i].returncode for i in bad]}); see their logs")


def pack(args: argparse.Namespace) -> None:
    """The best draft by MT-bench τ, cast to bf16 (vLLM format), and the regenerated answers, as <= 15 MB pieces."""
    records = json.loads((args.work / "scaling.json").read_text())
    best = max(records, key=lambda r: r["tau_mtbench_chain"])
    _pack_draft(args, best["data_fraction"], args.out)
    _pack_answers(args, args.out)
    log(f"pack: best draft {best['data_fraction']:g} (τ {best['tau_mtbench_chain']}) and the answers in {args.out}")


def _pack_draft(args: argparse.Namespace, fraction: float, out: Path) -> None:
    """One fraction's final draft cast to bf16 (vLLM format) as ``best-draft.tar.part*`` pieces under ``out``."""
    import tarfile

    import torch
    from safetensors.torch import load_file, save_file

    src = _draft_dir(args, fraction) / "final-draft"
    dst = args.work / "best-draft-bf16"
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, str(dst / "model.safetensors")
    )
    cfg = json.loads((src / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    with tarfile.open(args.work / "best-draft.tar", "w") as tar:
        tar.add(dst, arcname="best-draft-bf16")
    _split(args.work / "best-draft.tar", out, "best-draft.tar.part")


def _pack_answers(args: argparse.Namespace, out: Path) -> None:
    """The regenerated conversations and regen.json, xz-compressed in <= 15 MB pieces under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["xz", "-T0", "-6", "-kf", str(args.work / "conversations.jsonl")], check=True)
    _split(args.work / "conversations.jsonl.xz", out, "conversations.jsonl.xz.part")
    (out / "regen.json").write_text((args.work / "regen.json").read_text())


def _split(path: Path, out: Path, prefix: str, size: int = 15 << 20) -> None:
    data = path.read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), size):
        (out / f"{prefix}{i // size}").write_bytes(data[i : i + size])


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagleray.jobs.bench.draft_scaling", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage == "regen" or (args.stage == "all" and not (args.work / "regen.json").is_file()):
        regen(args)  # `all` reuses answers already in --work (regen.json + conversations.jsonl, e.g. carried in)
    if args.stage in ("all", "train", "train-one"):
        from eagleray.jobs.bench.draft_scaling_train import given_drafts, train_all, train_one

        if args.stage == "train-one":
            train_one(args)
        else:
            train_all(args)
            trained = [f for f in _fractions(args) if f not in given_drafts(args)]
            if trained:
                _pack_draft(args, max(trained), args.work / "early")  # at once, before the evaluation
    if args.stage in ("all", "eval", "eval-one"):
        from eagleray.jobs.bench.draft_scaling_eval import evaluate, evaluate_one

        evaluate_one(args) if args.stage == "eval-one" else evaluate(args)
    if args.stage == "pack":
        pack(args)
    if args.stage == "plot":
        from eagleray.jobs.bench.draft_scaling_plot import plot_run

        plot_run(args.work / "scaling.json", args.out or args.work / "scaling.png", args.mlflow_experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
