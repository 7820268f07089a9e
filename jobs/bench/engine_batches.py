"""The serving engine on GPU, as Serve and `bench spec` run it: plain vs speculative per batch size.

`python -m eagleray.jobs.bench engine --models smollm2,8b --batches 1,8,32,64 --out engine.json`

For each model and batch size, three runs of ``LLMEngine`` over the same token prompts (MT-bench
first turns through SmolLM2's chat template; the 8B-shaped target, random bf16, reads the same ids):
plain, speculative chain k (adaptive off) and speculative with the adaptive policy. Greedy, EOS
ignored (equal work). Each record: ``model, batch, mode (plain|spec), k, adaptive, tok_s``
(generated tokens / wall seconds, prefill included), ``decode_tok_s`` and ``step_ms`` (decode
steps only, from the engine's step metrics; for spec records the speculative steps), ``decode_ratio`` (all
decode steps of the run, plain and speculative, against the plain run's: what the adaptive policy is judged by), ``predicted_speedup`` (the policy's cost model),
``lossless`` (spec outputs equal plain outputs token for token). ``--repeats N``: the runs of a batch size alternate N
times, each record is the median run (``tok_s_runs``: every run's tok/s). Engines run with the row step
(``engine.decode_path``: CUDA graphs of the batch-invariant fused step) unless ``--decode-path``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from eagleray.jobs.bench.common import LLAMA_8B, log, print_rows, run_suite, write_json
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import pick_device
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import EngineConfig, SamplingParams, load_models
from eagleray.serve.measure import plain_run, spec_run

DRAFT_VOCAB_8B = 32000  # the draft vocabulary of the published EAGLE-3 drafts for Llama-3.1-8B


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="smollm2,8b", help="comma list of smollm2 (real weights) and 8b (random bf16)")
    p.add_argument("--batches", default="1,8,32,64", help="comma list of max concurrent sequences")
    p.add_argument("--adaptive-batches", default="1,8,32,64,128", help="batch sizes of the adaptive runs")
    p.add_argument("--prompts", default="mtbench", help="prompt source (mtbench, humaneval or a file)")
    p.add_argument("--limit", type=int, default=80, help="prompts per run (8b: --limit-8b)")
    p.add_argument("--limit-8b", type=int, default=16, help="prompts per 8b run at batch <= 8")
    p.add_argument(
        "--prompt-ids",
        default=None,
        help="8b: a JSON list of token id lists to use instead of tokenizing --prompts (a machine without the GGUF)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--k", type=int, default=4, help="chain draft length")
    p.add_argument("--draft", default="random", help="SmolLM2 draft directory or 'random'")
    p.add_argument("--decode-path", default="auto", choices=["auto", "rows", "varlen"], help="engine.decode_path")
    p.add_argument("--kv-cache-gib", type=float, default=24.0, help="engine.kv_cache_gib of every run")
    p.add_argument("--profile", action="store_true", help="per-phase step profile (a sync per phase on CUDA)")
    p.add_argument(
        "--join-wait-steps",
        default=None,
        help="comma list of engine.join_wait_steps: each speculative run once per value, side by side (default: the device's)",
    )
    p.add_argument("--repeats", type=int, default=1, help="plain and speculative runs alternate this often (medians)")
    p.add_argument("--json", default=None, help="write the results here")


def _eight_b(device: torch.device):
    """Llama-3.1-8B shapes with random bf16 weights, and a random EAGLE-3 draft of the published 8B drafts' shape
    (one layer, a 32,000-token draft vocabulary as in EAGLE3-LLaMA3.1-Instruct-8B; shared embedding)."""
    from eagleray.platform.checkpoints.draft_factory import eagle3_config
    from eagleray.platform.checkpoints.target import TargetSpec

    target = LlamaModel.from_config(LLAMA_8B, dtype="bf16", device=device, aux_layer_ids=[2, 16, 29])
    spec = TargetSpec(path=Path("<synthetic 8b>"), config=dict(LLAMA_8B))
    cfg = eagle3_config(spec, [2, 16, 29], draft_vocab_size=DRAFT_VOCAB_8B)
    draft = Eagle3Draft(cfg, device=device, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    draft.share_embedding(target.embed_tokens)
    return target, draft.eval()


def _runs(name: str, target, draft, tok, tcfg: TargetConfig, prompts: list, args, out: list[dict]) -> None:
    """Append the records of one model to ``out`` (and rewrite ``--json`` after each batch size: a cut run keeps its
    records). With ``--repeats`` N the plain and speculative runs of a batch size alternate N times and each record is
    the run with the median tok/s (``tok_s_runs``: all of them; ``speedup`` and ``decode_ratio`` against the plain
    runs' medians): wall time at 32-128 sequences moved by +-10% between runs of the same work on the H200."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    fixed, adaptive_set = _ints(args.batches), _ints(args.adaptive_batches)
    for b in sorted(set(fixed) | set(adaptive_set)):
        use = prompts if name == "smollm2" or b > 8 else prompts[: args.limit_8b]
        use = full_rounds(use, b)
        modes = ([False] if b in fixed else []) + ([True] if b in adaptive_set else [])
        rounds = [_round(name, b, modes, target, draft, tok, tcfg, use, params, args) for _ in range(args.repeats)]
        for rec in _medians(rounds):
            _keep(out, rec, args)


def _round(name, b, modes, target, draft, tok, tcfg, use, params, args) -> list[dict]:
    """One plain run of ``b`` sequences, then a speculative run per mode (adaptive off / on) -> their records."""
    t0 = time.perf_counter()
    run_cfg = EngineConfig(target=tcfg, max_num_seqs=b, profile_steps=args.profile, kv_cache_gib=args.kv_cache_gib)
    token_prompts, plain, t_plain, eng = plain_run(target, tok, run_cfg, use, params)
    rec = _record(name, b, "plain", 0, False, plain, t_plain, eng, None, None)
    plain_whole, plain_decode = rec["whole_step_ms"], rec["decode_tok_s"]
    plain_prefill = f"{rec['prefill_s']} s in {rec['prefill_steps']} steps"
    rec["profile"] = eng.prof.table() if args.profile else None
    records = [rec]
    log(
        f"{name} b{b} plain: {rec['tok_s']} tok/s, decode {rec['decode_tok_s']} tok/s, step {rec['step_ms']} ms ({time.perf_counter() - t0:.0f} s)"
    )
    for adaptive, wait in [(a, w) for a in modes for w in join_waits(args)]:
        dcfg = DraftConfig(source="random", num_speculative_tokens=args.k, policy=PolicyConfig(adaptive=adaptive))
        cfg = run_cfg.model_copy(update={"draft": dcfg, "join_wait_steps": wait})
        r = spec_run(target, draft, tok, cfg, token_prompts, params, plain, t_plain)
        rec = {
            "model": name,
            "batch": b,
            "mode": "spec",
            "k": args.k,
            "adaptive": adaptive,
            "join_wait_steps": wait,  # None: the device's default (startup.join_wait_steps)
            "tok_s": r["spec"]["tokens_per_s"],
            "plain_tok_s": r["plain"]["tokens_per_s"],
            "speedup": r["speedup"],
            "decode_tok_s": r["spec_decode_tokens_per_s"],
            "all_decode_tok_s": r["decode_tokens_per_s"],
            "decode_ratio": round(r["decode_tokens_per_s"] / plain_decode, 3) if plain_decode else None,
            "step_ms": r["spec_step_ms"] if r["spec_steps"] else None,
            "predicted_speedup": _predicted(r, b, plain_whole, None if adaptive else args.k),
            "whole_step_ms": r["spec_whole_step_ms"] if r["spec_steps"] else None,
            "prefill_s": r["prefill_s"],
            "measured_speedup": _measured(r, b, plain_whole),
            "lossless": r["lossless"],
            "tau": r["tau"],
            "acceptance_per_pos": r["acceptance_per_pos"],
            "chosen_k": {str(bk): c.get("k_run", c["k"]) for bk, c in r["policy"]["buckets"].items()},  # most steps' k
            "chosen_k_end": {str(bk): c["k"] for bk, c in r["policy"]["buckets"].items()},  # the drained end's k
            **_at_bucket(r, b),
            "seconds": r["spec"]["seconds"],
            "prefill_steps": r.get("prefill_steps"),
            "plain_whole_step_ms": r.get("plain_whole_step_ms_in_spec_run"),
            "spec_steps": r["spec_steps"],
            "plain_steps": r["plain_steps_in_spec_run"],
            "policy": r["policy"],
            "profile": r["spec_profile"] if args.profile else None,
        }
        records.append(rec)
        log(
            f"{name} b{b} spec k={args.k} adaptive={adaptive} join_wait_steps={wait}: {rec['tok_s']} tok/s ({rec['speedup']}x), "
            f"step {rec['step_ms']} ms, tau {rec['tau']}, lossless {rec['lossless']}, chosen k {rec['chosen_k']}, "
            f"predicted {rec['predicted_speedup']}, at b{b}: k {rec['bucket_k_run']} (steps {rec['bucket_k_steps']}), "
            f"predicted {rec['bucket_predicted_run']}, measured {rec['bucket_measured_speedup_by_k']}; prefill "
            f"{rec['prefill_s']} s in {rec['prefill_steps']} steps (plain run: {plain_prefill})"
        )
    return records


def join_waits(args) -> list[int | None]:
    """--join-wait-steps "0,8" -> [0, 8]; unset -> [None] (the device's default)."""
    if args.join_wait_steps is None:
        return [None]
    try:
        waits = [int(x) for x in args.join_wait_steps.split(",")]
    except ValueError:
        raise SystemExit(
            f"--join-wait-steps {args.join_wait_steps!r}: expected a comma list of integers >= 0, e.g. 0,8"
        ) from None
    if any(w < 0 for w in waits):
        raise SystemExit(f"--join-wait-steps {args.join_wait_steps!r}: every value must be >= 0")
    return waits


def _at_bucket(r: dict, batch: int) -> dict:
    """The policy's run at ``batch``'s bucket: the k most of its decode steps took, the mean prediction of its
    speculative decisions, each k's steps measured on the wall clock against its plain steps."""
    from eagleray.serve.engine import bucket

    c = r["policy"]["buckets"].get(bucket(batch)) or {}
    keys = ("k_run", "k_steps", "predicted_run", "measured_speedup_by_k", "wall")
    return {f"bucket_{key}": c.get(key) for key in keys}


def _medians(rounds: list[list[dict]]) -> list[dict]:
    """Per run kind (plain, spec, spec adaptive), the round whose tok/s is the median (the lower of the middle two),
    with every round's tok/s; speculative records' ratios against the plain rounds' medians; lossless in every round."""
    plain = _median_run([r[0] for r in rounds])
    out = [plain]
    for i in range(1, len(rounds[0])):
        runs = [r[i] for r in rounds]
        rec = _median_run(runs)
        rec["plain_tok_s"] = plain["tok_s"]
        rec["speedup"] = round(rec["tok_s"] / plain["tok_s"], 3)
        rec["decode_ratio"] = round(rec["all_decode_tok_s"] / plain["decode_tok_s"], 3) if plain["decode_tok_s"] else None
        rec["lossless"] = None if any(r["lossless"] is None for r in runs) else all(r["lossless"] for r in runs)
        out.append(rec)
    return out


def _median_run(runs: list[dict]) -> dict:
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    rec = dict(ranked[(len(ranked) - 1) // 2])
    rec["tok_s_runs"] = [r["tok_s"] for r in runs]
    return rec


def full_rounds(prompts: list, batch: int) -> list:
    """``prompts`` repeated into whole rounds of ``batch`` sequences, at least two: with EOS ignored a plain run's
    sequences of one round finish at the same step, so every decode step runs at ``batch`` (80 prompts at batch 64
    would leave a last round of 16, and decode tok/s would mix batch 64 with batch 16)."""
    per = batch // math.gcd(len(prompts), batch)  # repeats that make one whole number of rounds
    return prompts * (per * max(1, -(-2 * batch // (per * len(prompts)))))


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _keep(out: list[dict], rec: dict, args) -> None:
    out.append(rec)
    write_json({"partial": True, "records": out}, args.json)


def _record(name, b, mode, k, adaptive, outs, seconds, eng, predicted, lossless) -> dict:
    n = sum(len(o.token_ids) for o in outs)
    plain = eng.metrics.plain
    return {
        "model": name,
        "batch": b,
        "mode": mode,
        "k": k,
        "adaptive": adaptive,
        "tok_s": round(n / seconds, 2),
        "decode_tok_s": round(plain.tokens_per_s, 2),
        "step_ms": round(1e3 * plain.seconds / max(plain.steps, 1), 4),
        "whole_step_ms": round(plain.whole_step_ms, 4),
        "prefill_s": round(eng.metrics.prefill.whole_seconds, 4),
        "prefill_steps": eng.metrics.prefill.steps,
        "predicted_speedup": predicted,
        "lossless": lossless,
        "tokens": n,
        "seconds": round(seconds, 3),
    }


def _measured(r: dict, batch: int, plain_whole_ms: float) -> float | None:
    """What the prediction is checked against: tokens per whole step (scheduling and outputs included) of the spec
    run's speculative steps over the plain run's (``batch`` sequences a plain step)."""
    if not r["spec_steps"] or not plain_whole_ms or not r["spec_whole_step_ms"]:
        return None
    return round((r["spec_tokens_per_step"] / r["spec_whole_step_ms"]) / (batch / plain_whole_ms), 3)


def _predicted(r: dict, batch: int, plain_step_ms: float, k: int | None) -> float | None:
    """The cost model at ``batch``: τ t_plain / (t_verify(k) + t_draft(k)), t_plain from the plain run's whole decode
    steps, t_verify and t_draft (the whole drafting of k tokens) from the spec run's policy measurements: at ``k``
    (a fixed-k run), or at the k the policy chose (``None``, an adaptive run)."""
    from eagleray.serve.engine import bucket

    costs = r["policy"]["buckets"].get(bucket(batch))
    if not costs or not plain_step_ms:
        return None
    if k is None:
        spec_ms = costs["spec_ms"]
    else:
        verify, draft = costs["verify_ms_by_k"].get(k), costs["draft_ms_by_k"].get(k)
        spec_ms = None if verify is None or draft is None else verify + draft + costs.get("join_ms", 0.0)
    return None if spec_ms is None else round(r["tau"] * plain_step_ms / spec_ms, 3)


def _chat_ids(tcfg: TargetConfig, messages: list) -> list[list[int]]:
    """``messages`` through SmolLM2's chat template (the ids the 8B-shaped target reads)."""
    _, _, tok, _ = load_models(tcfg, None)
    return [
        list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for m in messages
    ]


def _prompt_ids(path: str, limit: int) -> list[list[int]]:
    """--prompt-ids: a JSON list of non-empty token id lists -> the first ``limit``."""
    import json

    ids = json.loads(Path(path).read_text())
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in ids)
    ):
        raise EaglerayError(
            f"--prompt-ids {path}: not a JSON list of non-empty token id lists\n    fix: write [[1, 2, ...], ...]"
        )
    return ids[:limit]


def measure(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise EaglerayError(f"--repeats {args.repeats}: at least one run of each kind\n    fix: --repeats 1 (or 3 for medians)")
    device = pick_device()
    if device.type != "cuda":
        log("bench engine: no CUDA device; running on CPU (slow, for checking the suite)")
    records = [r.to_dict() for r in load_prompts(args.prompts, limit=args.limit)]
    if not records:
        raise EaglerayError(f"--prompts {args.prompts!r} gave no prompts\n    fix: pass mtbench, humaneval or a file")
    messages = [r["messages"] for r in records]
    results = []
    for name in args.models.split(","):
        if name == "smollm2":
            tcfg = TargetConfig(model="smollm2", dtype="bf16", device=device.type, max_model_len=2048)
            dcfg = DraftConfig(source=args.draft, num_speculative_tokens=args.k)
            target, draft, tok, _ = load_models(tcfg, dcfg)
            _runs(name, target, draft, tok, tcfg, messages, args, results)
        elif name == "8b":
            tcfg = TargetConfig(model="smollm2", dtype="bf16", device=device.type, max_model_len=2048)
            ids = _prompt_ids(args.prompt_ids, args.limit) if args.prompt_ids else _chat_ids(tcfg, messages)
            target, draft = _eight_b(device)
            _runs(name, target, draft, None, tcfg, ids, args, results)
            del target, draft
            torch.cuda.empty_cache() if device.type == "cuda" else None
        else:
            raise EaglerayError(f"--models: unknown model {name!r}\n    fix: use smollm2 and/or 8b")
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "max_tokens": args.max_tokens,
        "prompts": args.prompts,
        "records": results,
    }


ENGINE_COLUMNS = [
    ("model", "<8"),
    ("batch", ">6"),
    ("mode", ">6"),
    ("k", ">3"),
    ("adapt", ">7"),
    ("tok/s", ">11"),
    ("decode tok/s", ">14"),
    ("step ms", ">9"),
    ("whole ms", ">9"),
    ("pred", ">7"),
    ("meas", ">7"),
    ("lossless", ">9"),
]
RECORD_KEYS = ("model", "batch", "mode", "k", "adaptive", "tok_s", "decode_tok_s", "step_ms", "predicted_speedup", "lossless")
TABLE_KEYS = RECORD_KEYS[:-2] + ("whole_step_ms", "predicted_speedup", "measured_speedup", "lossless")


def print_table(result: dict) -> None:
    print_rows(ENGINE_COLUMNS, ([r.get(key) for key in TABLE_KEYS] for r in result["records"]))


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    return run_suite(args, "eagleray bench engine", __doc__, add_arguments, measure, print_table)


if __name__ == "__main__":
    run(sys.argv[1:])
