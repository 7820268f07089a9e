"""A/B behind BENCHMARKS.md "the engine built in the thread that steps it" (issue 14): one CPU engine (the shipped
Serve config, plain), 8 chat prompts of ~150 tokens, prefill and batch-1 decode step timed; the engine either
built in the main thread and stepped in a worker thread (the Serve replica before AsyncEngine.build) or built and
stepped in the worker. Each mode in its own process, alternating, OMP_NUM_THREADS=1 as Ray sets it for a replica.

    python -m eagleray.jobs.bench.engine_thread_ab --rounds 3 --json docs/bench/engine-thread-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "serve-smollm2-cpu.yaml"


def _engine_config():
    import yaml

    from eagleray.platform.checkpoints.target import resolve_target
    from eagleray.platform.config.load import parse_config
    from eagleray.serve.serving_config import ServingConfig

    serving = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]["serving"] | {"draft": None}
    sc = parse_config(ServingConfig, serving, prefix="serving")
    return sc.engine_config(target=sc.target.model_copy(update={"model": str(resolve_target("smollm2", "fp32"))}))


def _run(engine) -> list[tuple[float, float]]:
    from eagleray.serve.engine import SamplingParams

    out = []
    for i in range(8):
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(110)) + f" {i}"
        engine.add_request(engine.tokenize([{"role": "user", "content": prompt}]), SamplingParams(max_tokens=8, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        prefill = time.perf_counter() - t
        t, n = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        out.append((1e3 * prefill, 1e3 * (time.perf_counter() - t) / n))
    return out[1:]  # the first is a warm-up


def _one(mode: str) -> dict:
    import torch

    from eagleray.serve.engine import LLMEngine

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # what the replica does (replica_cpu_threads)
    ex = ThreadPoolExecutor(1)
    if mode == "built-in-main":
        engine = LLMEngine.from_config(_engine_config())
    else:
        engine = ex.submit(LLMEngine.from_config, _engine_config()).result()
    r = ex.submit(_run, engine).result()
    return {"mode": mode, "prefill_ms": statistics.median(a for a, _ in r), "decode_step_ms": statistics.median(b for _, b in r)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    records = []
    for rnd in range(args.rounds):
        for mode in ("built-in-main", "built-in-engine-thread"):
            done = subprocess.run([sys.executable, __file__, "--one", mode], env=env, capture_output=True, text=True, check=True)
            rec = {"round": rnd, **json.loads(done.stdout.strip().splitlines()[-1])}
            records.append(rec)
            print(
                f"round {rnd}  {mode:24s} prefill {rec['prefill_ms']:7.0f} ms  decode step {rec['decode_step_ms']:6.1f} ms",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
