"""Diagnosis behind BENCHMARKS.md "the Serve replica's step: what slows it" (issue 14): the CPU engine (the shipped
Serve config, plain), 8 random 140-token prompts, 40 tokens each; the prefill step and the median batch-8 decode
step timed while something else runs beside it:

    alone       nothing
    gil20       a Python thread in the engine's process busy 2 ms of every 10 (holds the GIL 20% of the time)
    gil5        the same, 0.5 ms of every 10
    proc20      another process busy 2 ms of every 10 (a core's 20%, no GIL shared)
    proc2x10    two such processes, 1 ms of every 10 each

Modes alternate within a round; each round is one process (the engine built once, in its stepping thread).

    python -m eagleray.jobs.bench.engine_contention --rounds 2 --json docs/bench/engine-contention.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "serve-smollm2-cpu.yaml"
MODES = ("alone", "gil20", "gil5", "proc20", "proc2x10")
BURN = "import time\nwhile True:\n    e = time.perf_counter() + {busy}\n    while time.perf_counter() < e: pass\n    time.sleep({idle})\n"


def _engine():
    import torch
    import yaml

    from eagleray.platform.checkpoints.target import resolve_target
    from eagleray.platform.config.load import parse_config
    from eagleray.serve.engine import LLMEngine
    from eagleray.serve.serving_config import ServingConfig

    serving = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]["serving"] | {"draft": None}
    sc = parse_config(ServingConfig, serving, prefix="serving")
    torch.set_num_threads(2)
    target = sc.target.model_copy(update={"model": str(resolve_target("smollm2", "fp32"))})
    return LLMEngine.from_config(sc.engine_config(target=target, draft=None))


def _workload(engine, rng: random.Random) -> tuple[float, float]:
    """-> (prefill step ms, median decode step ms) for 8 prompts of 140 random tokens, 40 tokens each."""
    from eagleray.serve.engine import SamplingParams

    for _ in range(8):
        engine.add_request([rng.randrange(100, 40000) for _ in range(140)], SamplingParams(max_tokens=40, ignore_eos=True))
    t = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - t
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    steps.sort()
    return round(prefill * 1e3, 1), round(steps[len(steps) // 2] * 1e3, 2)


def _python_busy(stop: threading.Event, busy_ms: float, period_ms: float) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < end:
            pass
        time.sleep((period_ms - busy_ms) / 1e3)


def _beside(mode: str, stop: threading.Event) -> tuple[threading.Thread | None, list[subprocess.Popen]]:
    thread, procs = None, []
    if mode.startswith("gil"):
        busy = {"gil20": 2.0, "gil5": 0.5}[mode]
        thread = threading.Thread(target=_python_busy, args=(stop, busy, 10.0), daemon=True)
        thread.start()
    elif mode == "proc20":
        procs = [subprocess.Popen([sys.executable, "-c", BURN.format(busy=0.002, idle=0.008)])]
    elif mode == "proc2x10":
        procs = [subprocess.Popen([sys.executable, "-c", BURN.format(busy=0.001, idle=0.009)]) for _ in range(2)]
    return thread, procs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    pool = ThreadPoolExecutor(1)  # the engine is built and stepped in one thread, as in the replica
    engine = pool.submit(_engine).result()
    rng = random.Random(0)
    pool.submit(_workload, engine, rng).result()  # warm-up
    records = []
    for rnd in range(args.rounds):
        for mode in MODES:
            stop = threading.Event()
            thread, procs = _beside(mode, stop)
            time.sleep(0.3)
            try:
                prefill, decode = pool.submit(_workload, engine, rng).result()
            finally:
                stop.set()
                for proc in procs:
                    proc.kill()
                    proc.wait()
                if thread is not None:
                    thread.join()
            records.append({"round": rnd, "mode": mode, "prefill_8x140_ms": prefill, "decode_b8_step_ms": decode})
            print(f"round {rnd} {mode:9s} prefill 8x140 {prefill:8.1f} ms   decode step (batch 8, median) {decode:6.2f} ms")
    if args.json:
        args.json.write_text(json.dumps({"records": records, "date": time.strftime("%Y-%m-%d")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
