"""Benchmark jobs: `python -m eagleray.jobs.bench SUITE [suite options]`.

Suites print a table and write JSON (see each suite's --help). Available: `verify` (Triton
verification kernels vs the PyTorch reference and vLLM). `train` (EAGLE-3 TTT training
throughput of a SmolLM2- and an 8B-shaped draft, jobs/bench/train_step.py). `vllm` (the same EAGLE-3 draft
in eagleray and in vLLM on CPU, fp32, T=0: τ, acceptance per position, tokens/s and output agreement
side by side, jobs/bench/vllm.py). `spec` (plain vs speculative decoding in eagleray's engine vs transformers,
jobs/bench/spec.py). `engine` (the engine on GPU: plain, speculative and adaptive per batch size, SmolLM2
and 8B shapes, jobs/bench/engine_batches.py). `scaling` (drafts trained on different amounts of data, one plain baseline, τ against
data size as a table, JSON, PNG and an MLflow run, jobs/bench/scaling.py). `adapt_shift` (code traffic through the
Serve app with capture on, the adaptation loop, the hot-swap: τ before/after, capture overhead, jobs/bench/adapt_shift.py). `capture-overhead` (that benchmark's capture-off
vs capture-on passes alone, for a quiet window, jobs/bench/capture_overhead.py).
`cpu-linear` (the native CPU linear vs torch's matmul on SmolLM2's weights per row count, jobs/bench/cpu_linear.py). `serve` (the Serve app vs
`vllm serve` under vLLM's load generator, jobs/bench/serve_load.py). `serve-loop` (the Serve engine replica's step loop
under concurrent streaming clients, plain vs a draft, without Ray or HTTP: for machines without Ray Serve,
jobs/bench/serve_loop.py). `step-kernels` (a decode step's time kernel by kernel in its CUDA graph, GPU,
jobs/bench/step_kernels.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# suite name -> module with a `run(argv) -> dict` function
SUITES = {
    "verify": "eagleray.jobs.bench.verify_kernels",
    "gpu": "eagleray.jobs.bench.gpu",
    "spec": "eagleray.jobs.bench.spec",
    "engine": "eagleray.jobs.bench.engine_batches",
    "train": "eagleray.jobs.bench.train_step",
    "vllm": "eagleray.jobs.bench.vllm",
    "scaling": "eagleray.jobs.bench.scaling",
    "adapt_shift": "eagleray.jobs.bench.adapt_shift",
    "capture-overhead": "eagleray.jobs.bench.capture_overhead",
    "cpu-linear": "eagleray.jobs.bench.cpu_linear",
    "prefill-ab": "eagleray.jobs.bench.prefill_ab",
    "serve": "eagleray.jobs.bench.serve_load",
    "serve-loop": "eagleray.jobs.bench.serve_loop",
    "step-kernels": "eagleray.jobs.bench.step_kernels",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUITES:
        print(f"usage: python -m eagleray.jobs.bench SUITE [options]; suites: {', '.join(SUITES)}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    importlib.import_module(SUITES[argv[0]]).run(argv[1:])
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`eagleray bench SUITE ...`: the suite's own options follow its name."""
    p.add_argument("suite", choices=sorted(SUITES), help="benchmark suite")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options (see `eagleray bench SUITE --help`)")


def run(args: argparse.Namespace) -> int:
    return main([args.suite, *args.options])


if __name__ == "__main__":
    raise SystemExit(main())
