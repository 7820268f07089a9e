"""Where a speculative engine's plain steps lose wall time: per-step whole times and Python GC collections (H200).

A lease-side diagnosis (run under ``jobs/bench/engine_h200.sh run``, which stages the SmolLM2 GGUF): for each batch
size, the plain engine and then a speculative engine (random draft, adaptive policy: it speculates next to never, so
its steps are plain ones with the draft's aux rows queued) decode the same MT-bench prompts as ``bench engine`` does
(whole rounds, 128 tokens, EOS ignored). Each timed run records every step's whole and model time (a wrapper around
``LLMEngine._account``) and every collection of Python's garbage collector (``gc.callbacks``): generation, count, ms.
``NOGCS=0,1`` also runs with the collector off in the timed run.

    NOGCS=0 BATCHES=64,8 REPS=2 python3 jobs/bench/gc_steps_h200.py    # writes $OUT/steptimes.json
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

from eagleray.jobs.bench.engine_batches import full_rounds
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.prompts import load_prompts
from eagleray.serve import measure
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, load_models

STEPS: list[tuple] = []  # (kind, sequences, model seconds, whole seconds)
GCS: list[tuple[int, float]] = []  # (generation, seconds)
RES: list[dict] = []
_account = LLMEngine._account
_gc_start: list[float] = []


def _recorded_account(self, batch, k, emitted, seconds, whole):
    kind = "prefill" if batch.is_prefill else ("spec" if k else "plain")
    STEPS.append((kind, len(batch.seqs), seconds, whole))
    return _account(self, batch, k, emitted, seconds, whole)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start:
        GCS.append((info["generation"], time.perf_counter() - _gc_start[0]))


def _timed(engine, prompts, params):
    """measure.timed_generate, with the steps and collections of the timed run recorded."""
    engine.generate(prompts[: engine.config.max_num_seqs], params.model_copy(update={"max_tokens": 4}))
    engine.metrics = type(engine.metrics)()
    engine.prof.reset()
    nogc = os.environ.get("NOGC") == "1"
    if nogc:
        gc.collect()
        gc.disable()
    STEPS.clear()
    GCS.clear()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    gc.enable()
    RES.append(_summary(engine, seconds, list(STEPS), list(GCS), sum(len(o.token_ids) for o in outs)))
    return outs, seconds


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _summary(engine, seconds: float, steps: list[tuple], gcs: list[tuple], tokens: int) -> dict:
    out = {"draft": engine.current_draft is not None, "wall_s": round(seconds, 4), "tok_s": round(tokens / seconds, 1)}
    for kind in ("plain", "spec", "prefill"):
        whole = [1e3 * s[3] for s in steps if s[0] == kind]
        model = [1e3 * s[2] for s in steps if s[0] == kind]
        if whole:
            out[kind] = {
                "n": len(whole),
                "whole_sum_s": round(sum(whole) / 1e3, 4),
                "whole_mean": round(statistics.mean(whole), 4),
                "whole_med": round(statistics.median(whole), 4),
                "p90": round(_q(whole, 0.9), 4),
                "p99": round(_q(whole, 0.99), 4),
                "max": round(max(whole), 3),
                "model_mean": round(statistics.mean(model), 4),
                "model_med": round(statistics.median(model), 4),
                "top1pct_sum_ms": round(sum(sorted(whole)[-max(1, len(whole) // 100) :]), 2),
            }
    out["outside_steps_s"] = round(seconds - sum(s[3] for s in steps), 4)
    out["gc"] = {g: [sum(1 for x in gcs if x[0] == g), round(1e3 * sum(x[1] for x in gcs if x[0] == g), 2)] for g in (0, 1, 2)}
    return out


def main() -> None:
    LLMEngine._account = _recorded_account
    measure.timed_generate = _timed
    gc.callbacks.append(_on_gc)
    stage = os.environ.get("STAGE", "")
    tcfg = TargetConfig(model="smollm2", dtype="bf16", device=os.environ.get("DEV", "cuda"), max_model_len=2048)
    target, draft, tok, _ = load_models(tcfg, DraftConfig(source="random", num_speculative_tokens=4))
    source = stage + "/mtbench.jsonl" if stage else "mtbench"
    messages = [r.to_dict()["messages"] for r in load_prompts(source, limit=int(os.environ.get("LIMIT", "80")))]
    params = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("MAXTOK", "128")), ignore_eos=True)
    report = []
    for nogc in os.environ.get("NOGCS", "0,1").split(","):
        os.environ["NOGC"] = nogc
        for b in [int(x) for x in os.environ.get("BATCHES", "8,64").split(",")]:
            use = full_rounds(messages, b)
            for rep in range(int(os.environ.get("REPS", "2"))):
                RES.clear()
                cfg = EngineConfig(target=tcfg, max_num_seqs=b, kv_cache_gib=24.0)
                token_prompts, plain, t_plain, _ = measure.plain_run(target, tok, cfg, use, params)
                dcfg = DraftConfig(source="random", num_speculative_tokens=4, policy=PolicyConfig(adaptive=True))
                r = measure.spec_run(
                    target, draft, tok, cfg.model_copy(update={"draft": dcfg}), token_prompts, params, plain, t_plain
                )
                rec = {
                    "batch": b,
                    "nogc": nogc,
                    "rep": rep,
                    "plain": RES[0],
                    "spec": RES[1],
                    "ratio": round(RES[1]["tok_s"] / RES[0]["tok_s"], 3),
                    "lossless": r["lossless"],
                    "spec_steps": r["spec_steps"],
                }
                print(json.dumps(rec), flush=True)
                report.append(rec)
                with open(os.path.join(os.environ.get("OUT", "."), "steptimes.json"), "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
