"""``python -m eagleray.jobs.bench capture-overhead``: what capture costs the Serve app in throughput, alone.

The same measurement as `adapt_shift`'s step [2] (one Serve app, the champion @champion, the first --traffic
HumanEval prompts as greedy chat requests from --concurrency clients; passes with capture off and at rate 1.0 in
ABBA order, a fresh replica before each pass), without the adaptation around it, so that it fits a quiet window of
the machine. Tokens per second per mode are summed over its passes; the JSON (--json) holds every pass, the
overhead over all passes and per round, and the median pass of each mode.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from eagleray.jobs.bench import adapt_shift as shift
from eagleray.jobs.bench.common import log, write_json


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagleray bench capture-overhead", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--champion", default="random", help="the served draft: a directory, models:/..., shipped:NAME or random")
    p.add_argument("--traffic", type=int, default=100, help="HumanEval prompts sent per pass (the first N of 164)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--capture-writer", choices=["thread", "actor"], default="thread", help="serving.capture.writer")
    p.add_argument("--overhead-rounds", type=int, default=3, help="rounds of one capture-off and one capture-on pass, ABBA order")
    p.add_argument("--work", default=".cache/capture-overhead")
    p.add_argument("--json", default="docs/bench/capture-overhead.json")
    return p.parse_args(argv)


def summary(passes: dict[str, list[dict]]) -> dict[str, Any]:
    """The overhead over all passes (adapt_shift.overhead), per round, and between the median passes of each mode."""
    cost = shift.overhead(passes["off"], passes["on"])
    median = {mode: statistics.median(p["tokens_per_s"] for p in passes[mode]) for mode in ("off", "on")}
    return {**cost, "median_tok_s": median, "overhead_of_medians": 1 - median["on"] / median["off"]}


def run(argv: list[str]) -> dict[str, Any]:
    from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
    from eagleray.serve.local import start_local, stop_local

    args = parse(argv)
    t_start = time.time()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    spec = TargetSpec.from_dir(resolve_target(args.target, "fp32"))
    bodies = shift.requests(shift.messages("humaneval", 0, args.traffic), args.max_tokens)
    uri, _ = shift.register_champion(args, work, spec)
    plan = shift.overhead_plan(args.overhead_rounds)
    log(f"capture overhead: {len(bodies)} requests a pass, {args.concurrency} clients, passes {' '.join(plan)}")

    def capture_to(i: int) -> str | None:
        return str(work / f"captures-{int(t_start)}" / f"pass-{i}") if plan[i] == "on" else None

    url = start_local(shift.serving(args, uri, capture_to(0)), num_cpus=2, timeout_s=600)
    try:
        passes = shift.overhead_passes(args, url, uri, bodies, plan, capture_to, [])
    finally:
        stop_local()
    cost = summary(passes)
    log(
        f"capture overhead {cost['overhead']:+.1%} over all passes; per round "
        f"{', '.join(f'{c:+.1%}' for c in cost['per_round'])}; medians {cost['median_tok_s']['off']:.2f} (off) "
        f"vs {cost['median_tok_s']['on']:.2f} (on) tok/s = {cost['overhead_of_medians']:+.1%}"
    )
    result = {
        "capture_overhead": cost["overhead"],
        **{k: v for k, v in cost.items() if k != "overhead"},
        "failed_requests": sum(p["failed"] for mode in passes.values() for p in mode),
        "passes": passes,
        "plan": plan,
        "settings": vars(args),
        "wall_s": time.time() - t_start,
    }
    write_json(result, args.json)
    log(f"wrote {args.json}")
    return result
