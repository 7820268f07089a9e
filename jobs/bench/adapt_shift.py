"""``python -m eagleray.jobs.bench adapt_shift``: the draft follows a shift of the traffic to code.

    [0] registry (sqlite, --work): the champion draft as version 1, @champion
    [1] before: τ of the champion on the held-out HumanEval prompts (the last --held-out of 164) and on MT-bench
    [2] capture overhead: the Serve app (capture off) then (capture at rate 1.0) under the same load:
        the first --traffic HumanEval prompts (and --code-sharegpt code requests from ShareGPT), --concurrency clients;
        tokens / wall time; --overhead-rounds R: R rounds in ABBA order, a fresh replica a pass, tokens/s summed per mode
    [2b] --traffic-samples S: the traffic prompts S more times, sampled (a seed per request), captured too
    [3] the adaptation loop (jobs/adapt.adapt_once) on the captured traffic: fine-tune, gate, alias
    [4] the traffic again: the app hot-swaps through its alias poller (τ over time, no failed request)
    [5] after: τ of the draft now @champion on the same held-out HumanEval prompts and MT-bench

Writes --json (tau_code_before/after, tau_mtbench_before/after, failed_requests, captured_requests,
capture_overhead, ...) and --plot (τ of every served request over time, the hot-swap marked).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from eagleray.jobs.bench.common import log, write_json


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="eagleray bench adapt_shift", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--champion", default="random", help="the starting draft: a directory, models:/..., or random")
    p.add_argument("--replay", default=None, help="the champion's original data (a datagen output) mixed into fine-tuning")
    p.add_argument("--replay-fraction", type=float, default=0.3, help="share of training rows drawn from --replay")
    p.add_argument("--traffic", type=int, default=100, help="HumanEval prompts sent as traffic (the first N of 164)")
    p.add_argument(
        "--code-sharegpt",
        type=int,
        default=0,
        help="code requests from ShareGPT added to the traffic (first user turns that ask for code, a seeded sample)",
    )
    p.add_argument("--held-out", type=int, default=64, help="HumanEval prompts measured before/after (the last N of 164)")
    p.add_argument("--mtbench", type=int, default=80, help="MT-bench prompts measured before/after (the control)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--capture-writer", choices=["thread", "actor"], default="thread", help="serving.capture.writer")
    p.add_argument(
        "--overhead-rounds",
        type=int,
        default=1,
        help="rounds of one capture-off and one capture-on pass (ABBA order, a fresh replica before each pass); "
        "the last pass captures the traffic the loop trains on, earlier capture-on passes go to a scratch directory",
    )
    p.add_argument(
        "--traffic-samples",
        type=int,
        default=0,
        help="after the overhead rounds, the traffic prompts sent this many more times on the capturing replica "
        "(sampled at --traffic-temperature, a seed per request, --traffic-max-tokens): more of the target's own "
        "answers to the same prompts for the loop to train on",
    )
    p.add_argument("--traffic-temperature", type=float, default=0.8, help="sampling temperature of --traffic-samples")
    p.add_argument(
        "--traffic-max-tokens", type=int, default=None, help="max_tokens of the --traffic-samples requests (default --max-tokens)"
    )
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--ttt-steps", type=int, default=None, help="unrolled training steps of the fine-tuning (default: --k)")
    p.add_argument("--autocast", choices=["auto", "bf16", "off"], default="auto", help="bf16 autocast of the fine-tuning")
    p.add_argument("--work", default=".cache/adapt-shift")
    p.add_argument("--json", default="docs/bench/adapt-shift.json")
    p.add_argument("--plot", default="docs/bench/adapt-shift.png")
    return p.parse_args(argv)


def messages(source: str, start: int, stop: int | None) -> list[list[dict]]:
    from eagleray.platform.prompts import load_prompts

    recs = load_prompts(source).records if source != "mtbench" else load_prompts(source, limit=stop).records
    return [[m.to_dict() for m in r.messages] for r in recs[start:stop]]


CODE_MARKER = re.compile(
    r"```|\bdef |\bfunction\b|\bpython\b|\bjavascript\b|\bcode\b|\bsql\b|\bjava\b|\bc\+\+|\bscript\b|\bclass ", re.I
)


def sharegpt_code(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` first user turns of ShareGPT conversations that ask for code (a code marker, at most 1,500 characters),
    distinct, in a seeded shuffle: more code traffic of the kind HumanEval is, never a HumanEval prompt."""
    import random

    from eagleray.platform.prompts import iter_prompts

    seen, picked = set(), []
    for rec in iter_prompts("sharegpt"):
        first = rec.messages[0].to_dict()
        text = first["content"]
        if first["role"] == "user" and len(text) <= 1500 and CODE_MARKER.search(text) and text not in seen:
            seen.add(text)
            picked.append([first])
    random.Random(seed).shuffle(picked)
    if len(picked) < n:
        raise ValueError(f"--code-sharegpt {n}: ShareGPT has {len(picked)} code requests")
    return picked[:n]


def measure(args, draft_dir: Path, sets: dict[str, list]) -> dict[str, float]:
    """τ of ``draft_dir`` on each prompt set (greedy, one loaded target, the engine)."""
    from eagleray.platform.config.promotion import PromotionConfig
    from eagleray.serve.promotion import DraftTrial

    pcfg = PromotionConfig(
        candidate=str(draft_dir),
        target={"model": args.target, "device": "cpu"},
        prompts=["mtbench"],
        limit=1,
        max_tokens=args.max_tokens,
        num_speculative_tokens=args.k,
    )
    trial = DraftTrial(pcfg)
    return {name: trial.measure(name, draft_dir, None, prompts).tau for name, prompts in sets.items()}


def register_champion(args, work: Path, spec) -> tuple[str, Path]:
    from eagleray.platform import registry

    uri = registry.configure(f"sqlite:///{work / 'mlflow.db'}", experiment="adapt-shift")
    src = registry.resolve_draft(args.champion, spec).path
    v = registry.register_directory("shift-draft", src, "champion", tags={"source": args.champion}).version
    registry.set_alias("shift-draft", "champion", v)
    return uri, src


def requests(prompts: list, max_tokens: int) -> list[dict]:
    """Greedy chat requests of ``prompts`` (the overhead passes and the pass after the swap)."""
    return [{"messages": m, "max_tokens": max_tokens, "temperature": 0} for m in prompts]


def sampled_requests(prompts: list, samples: int, temperature: float, max_tokens: int) -> list[dict]:
    """--traffic-samples: each prompt ``samples`` times, sampled with a distinct seed per request (so that repeats
    of a prompt are different answers of the target); greedy only when ``samples`` is 1."""
    if samples < 0:
        raise ValueError(f"--traffic-samples must be >= 0, got {samples}")
    if temperature < 0 or (temperature == 0 and samples > 1):
        raise ValueError(
            f"--traffic-temperature {temperature} with --traffic-samples {samples}: greedy repeats are identical answers; "
            "use a temperature > 0 (or --traffic-samples 1)"
        )
    return [
        {
            "messages": m,
            "max_tokens": max_tokens,
            "temperature": temperature,
            **({"seed": s * len(prompts) + i} if temperature else {}),
        }
        for s in range(samples)
        for i, m in enumerate(prompts)
    ]


def load(url: str, bodies: list[dict], args, phase: str, record: list[dict]) -> dict[str, float]:
    """Send the request ``bodies`` with --concurrency clients; every answer recorded (time, τ, draft, status)."""
    import httpx

    todo = list(enumerate(bodies))
    lock = threading.Lock()
    tokens = failed = 0

    def client() -> None:
        nonlocal tokens, failed
        while True:
            with lock:
                if not todo:
                    return
                i, body = todo.pop(0)
            r = httpx.post(url + "/v1/chat/completions", json={"model": "eagleray", **body}, timeout=600)
            ok = r.status_code == 200
            ext = r.json().get("eagleray", {}) if ok else {}
            with lock:
                tokens += r.json()["usage"]["completion_tokens"] if ok else 0
                failed += 0 if ok else 1
                record.append(
                    {"t": time.time(), "phase": phase, "ok": ok, "tau": ext.get("tau"), "draft": ext.get("draft_version")}
                )

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    log(f"  {phase}: {len(bodies)} requests, {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.2f} tok/s, {failed} failed")
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "failed": failed}


def adapt_config(args, capture_dir: Path, work: Path, uri: str):
    """The adaptation loop's config: fine-tune on the captured traffic (replay mixed in), gate on held-out traffic and MT-bench."""
    from eagleray.platform.config.promotion import AdaptConfig

    return AdaptConfig.model_validate(
        {
            "capture_path": str(capture_dir),
            "work_dir": str(work / "adapt"),
            "target": {"model": args.target, "device": "cpu"},
            "min_new_requests": max(1, (args.traffic + args.code_sharegpt) * (1 + args.traffic_samples) // 2),
            "held_out_fraction": 0.2,
            "max_held_out": 16,
            "control": ["mtbench"],
            "control_limit": min(16, args.mtbench),
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.k,
            "train": {
                "max_steps": args.train_steps,
                "learning_rate": args.learning_rate,
                "ttt_steps": args.ttt_steps or args.k,
                "autocast": args.autocast,
                "warmup_steps": min(20, args.train_steps // 5),
                "batch_size": 4,
                "backend": "local",
                "log_every": 10,
                "checkpoint_every": args.train_steps,
                "eval_batches": 4,
                **({"replay": {"data_dir": args.replay, "fraction": args.replay_fraction}} if args.replay else {}),
            },
            "mlflow": {"tracking_uri": uri, "experiment": "adapt-shift", "registered_model": "shift-draft"},
        }
    )


def serving(args, uri: str, capture: str | None):
    from eagleray.serve.serving_config import ServingConfig

    return ServingConfig.model_validate(
        {
            "target": {"model": args.target, "device": "cpu"},
            "draft": {"source": "models:/shift-draft@champion", "num_speculative_tokens": args.k},
            "alias_poll_seconds": 2,
            "mlflow": {"tracking_uri": uri},
            "max_num_seqs": args.concurrency,
            "decode_path": "varlen",
            **({"capture": {"path": capture, "rate": 1.0, "flush_seconds": 2, "writer": args.capture_writer}} if capture else {}),
        }
    )


def overhead_plan(rounds: int) -> list[str]:
    """The capture-off/on passes: rounds in ABBA order (off on, on off, ...), the last round always off -> on
    (its capture is the loop's traffic), so a drift of the machine's load over time cancels out."""
    if rounds < 1:
        raise ValueError(f"--overhead-rounds must be >= 1, got {rounds}")
    return [m for r in range(rounds) for m in (("off", "on") if (rounds - 1 - r) % 2 == 0 else ("on", "off"))]


def overhead_passes(args, url: str, uri: str, bodies: list[dict], plan: list[str], capture_to, record: list[dict]):
    """``plan``'s passes on the app at ``url`` (started with pass 0's capture; ``capture_to(i)``: pass i's directory or None),
    a fresh replica before every later one so that no pass runs on a warmer app -> {"off": [load, ...], "on": [...]}."""
    from ray import serve

    from eagleray.serve.app import build
    from eagleray.serve.local import APP_NAME, wait_ready

    passes: dict[str, list[dict]] = {"off": [], "on": []}
    for i, mode in enumerate(plan):
        if i:
            serve.run(build(serving(args, uri, capture_to(i))), name=APP_NAME, route_prefix="/", blocking=False)
            wait_ready(url, None, 600)  # serve.run returned with the new replica running
        passes[mode].append(load(url, bodies, args, f"capture {mode}", record))
    return passes


def overhead(off: list[dict], on: list[dict]) -> dict[str, Any]:
    """Capture's cost in serving throughput: 1 - on/off tokens per second, each over all its passes; and per round."""
    rate = {mode: sum(p["tokens"] for p in ps) / sum(p["seconds"] for p in ps) for mode, ps in (("off", off), ("on", on))}
    per_round = [1 - b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(off, on)]
    return {"overhead": 1 - rate["on"] / rate["off"], "per_round": per_round}


def plot(record: list[dict], swap_t: float | None, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = record[0]["t"]
    fig, ax = plt.subplots(figsize=(8, 4))
    phases = (("capture off", "grey"), ("capture on", "C0"), ("capture on, samples", "C1"), ("after adaptation", "C2"))
    for phase, color in phases:
        pts = [(r["t"] - t0, r["tau"]) for r in record if r["phase"] == phase and r["tau"] is not None]
        if pts:
            ax.scatter(*zip(*pts), s=10, color=color, label=phase)
    if swap_t is not None:
        ax.axvline(swap_t - t0, color="C3", linestyle="--", label="alias moved (hot-swap)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("τ of the request (mean acceptance length)")
    ax.set_title("code traffic: τ per served request over time")
    ax.legend(loc="best")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def run(argv: list[str]) -> dict[str, Any]:
    import httpx

    from eagleray.jobs.adapt import adapt_once
    from eagleray.platform import capture_store, registry
    from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
    from eagleray.serve.local import start_local, stop_local

    args = parse(argv)
    t_start = time.time()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EAGLERAY_HOME", str(work / "home"))
    spec = TargetSpec.from_dir(resolve_target(args.target, "fp32"))
    humaneval = messages("humaneval", 0, None)
    traffic, held = humaneval[: args.traffic], humaneval[len(humaneval) - args.held_out :]
    traffic += sharegpt_code(args.code_sharegpt) if args.code_sharegpt else []
    mtbench = messages("mtbench", 0, args.mtbench)
    base = requests(traffic, args.max_tokens)
    extra = sampled_requests(traffic, args.traffic_samples, args.traffic_temperature, args.traffic_max_tokens or args.max_tokens)
    volume = len(base) + len(extra)  # the requests the loop's capture holds
    log(f"[0] registry {work / 'mlflow.db'}: champion {args.champion}")
    uri, champ_dir = register_champion(args, work, spec)
    log(f"[1] before: τ of the champion on {len(held)} held-out HumanEval and {len(mtbench)} MT-bench prompts")
    before = measure(args, champ_dir, {"code": held, "mtbench": mtbench})
    log(f"  τ code {before['code']:.3f}, MT-bench {before['mtbench']:.3f}")
    record: list[dict] = []
    capture_dir = work / f"traffic-{int(t_start)}"
    log(
        f"[2] capture overhead: the same {len(traffic)} requests with capture off and at rate 1.0, {args.overhead_rounds} round(s)"
    )
    plan = overhead_plan(args.overhead_rounds)

    def capture_to(i: int) -> str | None:  # the last pass captures the loop's traffic, earlier ones a scratch directory
        where = capture_dir if i == len(plan) - 1 else work / f"overhead-{int(t_start)}" / f"pass-{i}"
        return str(where) if plan[i] == "on" else None

    url = start_local(serving(args, uri, capture_to(0)), num_cpus=2, timeout_s=600)
    try:
        passes = overhead_passes(args, url, uri, base, plan, capture_to, record)
        off, on = passes["off"], passes["on"]
        cost = overhead(off, on)
        log(f"  capture overhead {cost['overhead']:+.1%} (per round {', '.join(f'{c:+.1%}' for c in cost['per_round'])})")
        sampled = None
        if extra:  # the capturing replica of the last pass: more answers to the same prompts for the loop
            log(f"[2b] {len(extra)} more traffic requests ({args.traffic_samples} per prompt), captured")
            sampled = load(url, extra, args, "capture on, samples", record)
        deadline = time.monotonic() + 120
        while capture_store.count_rows(capture_store.list_shards(capture_dir)) < volume and time.monotonic() < deadline:
            time.sleep(1)
        captured = capture_store.count_rows(capture_store.list_shards(capture_dir))
        metrics = httpx.get(url + "/health", timeout=30).json()["metrics"]
        log(f"  captured {captured} requests ({metrics.get('capture_dropped', 0)} dropped)")
        log("[3] the adaptation loop on the captured traffic")
        cfg = adapt_config(args, capture_dir, work, uri)
        decision = adapt_once(cfg, emit=log)
        swap_t = time.time() if decision.action == "promote" else None
        log(f"[4] the traffic again ({'the app hot-swaps to ' + decision.candidate if swap_t else 'no new draft'})")
        again = load(url, base, args, "after adaptation", record)
    finally:
        stop_local()
    now = registry.resolve_draft("models:/shift-draft@champion", spec, tracking_uri=uri)
    log(f"[5] after: τ of {now.version} on the same held-out prompts")
    after = measure(args, now.path, {"code": held, "mtbench": mtbench})
    log(f"  τ code {after['code']:.3f}, MT-bench {after['mtbench']:.3f}")
    served_versions = sorted({r["draft"] for r in record if r["draft"]})
    result = {
        "tau_code_before": before["code"],
        "tau_code_after": after["code"],
        "tau_mtbench_before": before["mtbench"],
        "tau_mtbench_after": after["mtbench"],
        "tau_code_gain": after["code"] / before["code"] - 1 if before["code"] else None,
        "tau_mtbench_change": after["mtbench"] / before["mtbench"] - 1 if before["mtbench"] else None,
        "failed_requests": sum(p["failed"] for p in off + on + [again] + ([sampled] if sampled else [])),
        "captured_requests": captured,
        "captured_tokens": decision.window.get("loss_tokens"),
        "capture_overhead": cost["overhead"],
        "capture_overhead_per_round": cost["per_round"],
        "throughput": {"capture_off": off, "capture_on": on, "samples": sampled, "after_adaptation": again},
        "requests_sent": (len(off) + len(on) + 1) * len(base) + len(extra),
        "decision": decision.to_dict(),
        "served_draft_versions": served_versions,
        "traffic_requests": volume,
        "traffic_prompts": len(traffic),
        "traffic_sources": {"humaneval": args.traffic, "sharegpt_code": args.code_sharegpt, "samples": len(extra)},
        "settings": vars(args),
        "requests": record,
        "wall_s": time.time() - t_start,
    }
    write_json(result, args.json)
    plot(record, swap_t, args.plot)
    log(f"wrote {args.json} and {args.plot}")
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "throughput", "decision", "settings")}, indent=1))
    return result
