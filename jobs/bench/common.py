"""Helpers shared by the benchmark suites (no Triton imports: `bench train` runs without them).

Target shapes, progress lines, per-call timing (CUDA events on CUDA), JSON output and the
parse -> measure -> table -> JSON entry every suite exposes as ``run(argv)``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch


def llama_config(
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    rope_theta: float,
    **extra,
) -> dict:
    """A Llama ``config.json`` dict of these sizes (RMSNorm eps 1e-5, untied head unless ``extra`` says otherwise)."""
    return (
        dict(
            model_type="llama",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=1e-5,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            rope_theta=rope_theta,
        )
        | extra
    )


LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# llama_config(vocab, hidden, intermediate, layers, heads, kv_heads, max_positions, rope_theta, ...)
LLAMA_8B = llama_config(128256, 4096, 14336, 32, 32, 8, 131072, 500000.0, rope_scaling=LLAMA3_ROPE_SCALING)
SMOLLM2 = llama_config(49152, 576, 1536, 30, 9, 3, 8192, 100000.0, tie_word_embeddings=True)
TINY = llama_config(256, 64, 128, 4, 4, 2, 4096, 10000.0)  # a random Llama small enough for quick checks on any machine
CONFIGS = {"8b": LLAMA_8B, "smollm2": SMOLLM2, "tiny": TINY}  # the shapes a benchmark's --model names


def add_engine_arguments(p: argparse.ArgumentParser, *, limit: int = 8, batch: int = 1) -> None:
    """The options every engine-measuring suite (spec, vllm, scaling) shares: target, prompts, lengths, batch, output."""
    p.add_argument("--target", default="smollm2", help="target model directory or 'smollm2'")
    p.add_argument("--prompts", default="mtbench", help="mtbench, humaneval or a JSONL/Parquet file")
    p.add_argument("--limit", type=int, default=limit, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--k", type=int, default=4, help="chain draft length (vLLM: num_speculative_tokens)")
    p.add_argument("--batch", type=int, default=batch, help="max concurrent sequences (1 = latency, as the EAGLE papers)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a shared box)")
    p.add_argument("--json", default=None, help="write the results here (default: print only)")


def prompt_messages(args: argparse.Namespace) -> list[list[dict]]:
    """Apply ``--threads``, then load ``--prompts`` (at most ``--limit``) as chat messages; none is an error."""
    from eagleray.platform.errors import EaglerayError
    from eagleray.platform.prompts import load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    messages = [[m.to_dict() for m in r.messages] for r in load_prompts(args.prompts, limit=args.limit)]
    if not messages:
        raise EaglerayError(f"--prompts {args.prompts!r} gave no prompts\n    fix: pass mtbench, humaneval or a non-empty file")
    return messages


def log(msg: str) -> None:
    print(msg, flush=True)


def step_times(fn: Callable[[], object], n: int, device: torch.device) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn()`` (CUDA events on CUDA, perf_counter elsewhere)."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def print_rows(columns: list[tuple[str, str]], rows: Iterable[Sequence[object]]) -> None:
    """A table after a blank line: each column's header over its values, every cell ``str()``-ed and padded by the
    column's format spec (``"<12"``, ``">9"``; format numbers before passing them)."""
    print("\n" + "".join(format(name, spec) for name, spec in columns))
    for row in rows:
        print("".join(format(str(value), spec) for (_, spec), value in zip(columns, row, strict=True)))


def write_json(result: dict, out: str | Path | None, indent: int = 1) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=indent))


def run_suite(
    args: argparse.Namespace | list[str] | None,
    prog: str,
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    measure: Callable[[argparse.Namespace], dict],
    print_table: Callable[[dict], None],
) -> dict:
    """Parse (an argv list, or an already parsed Namespace), measure, print the table, write ``--json``."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
        add_arguments(parser)
        args = parser.parse_args(args or [])
    result = measure(args)
    print_table(result)
    if args.json:
        write_json(result, args.json, indent=2)
        print(f"wrote {args.json}")
    return result


def rises(values: Sequence[float]) -> bool:
    """Whether every value is above the one before it (τ against data sizes, smallest first)."""
    return all(b > a for a, b in zip(values, values[1:]))


def log_bench_run(
    experiment: str,
    run_name: str,
    job: str,
    metrics: Iterable[tuple[str, float, int]],
    record: tuple[str, object],
    png: Path | None,
) -> str:
    """A new MLflow run ``run_name`` (tag eagleray.job = ``job``) in ``experiment`` (the eagleray registry's tracking
    URI) with ``metrics`` as (key, value, step), the ``record`` (file name, JSON-able object) and ``png`` as
    artifacts; returns the run id."""
    import tempfile

    import mlflow

    from eagleray.platform import registry

    registry.configure(None, experiment)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment).experiment_id
    run = client.create_run(exp, run_name=run_name, tags={"eagleray.job": job})
    for key, value, step in metrics:
        client.log_metric(run.info.run_id, key, value, step=step)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / record[0]
        out.write_text(json.dumps(record[1], indent=2))
        client.log_artifact(run.info.run_id, str(out))
    if png is not None:
        client.log_artifact(run.info.run_id, str(png))
    client.set_terminated(run.info.run_id)
    return run.info.run_id
