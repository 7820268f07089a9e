"""``eagleray bench spec``: plain vs speculative decoding vs transformers' generate, same prompts, one run.

    eagleray bench spec --target smollm2 --draft random --prompts mtbench --limit 8 --max-tokens 64 [--tree] [--json OUT]

Reports tokens/s of each, the speedup, τ (mean acceptance length), acceptance per draft position,
``lossless`` (T=0: every speculative output equals the plain output token for token) and how many
plain outputs match transformers' greedy output. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import platform as std_platform
import sys
import time
from pathlib import Path

import torch

from eagleray.jobs.bench.common import add_engine_arguments, print_rows, prompt_messages, run_suite
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig, TreeConfig
from eagleray.serve.engine import SamplingParams, close_target, load_models
from eagleray.serve.measure import compare_engines


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--draft", default="random", help="draft checkpoint directory or 'random' (untrained)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy, checks lossless)")
    p.add_argument("--tree", action="store_true", help="draft an EAGLE top-k tree instead of a chain")
    p.add_argument("--depth", type=int, default=5, help="tree depth (with --tree)")
    p.add_argument("--topk", type=int, default=4, help="tree branching (with --tree)")
    p.add_argument("--num-draft-tokens", type=int, default=8, help="tree nodes verified per step (with --tree)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the target")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="model dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--adaptive", action="store_true", help="let the adaptive policy change k / turn speculation off")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens for every prompt (equal work in every engine)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")


def _hf_baseline(target_dir: Path, tokenizer, token_prompts: list[list[int]], args, device) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32 if args.dtype == "fp32" else torch.bfloat16)
        .to(device)
        .eval()
    )
    kw = dict(max_new_tokens=args.max_tokens, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    kw.update(do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0) if args.temperature > 0 else kw.update(
        do_sample=False
    )
    outs, t0 = [], time.perf_counter()
    with torch.inference_mode():
        for ids in token_prompts:
            x = torch.tensor([ids], device=device)
            outs.append(model.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids) :].tolist())
    return outs, time.perf_counter() - t0


def _draft_config(args) -> DraftConfig:
    tree = TreeConfig(depth=args.depth, topk=args.topk, num_draft_tokens=args.num_draft_tokens) if args.tree else None
    return DraftConfig(source=args.draft, num_speculative_tokens=args.k, tree=tree, policy=PolicyConfig(adaptive=args.adaptive))


def measure_args(args) -> dict:
    """The CLI bench (``eagleray bench spec``)."""
    messages = prompt_messages(args)
    tcfg = TargetConfig(model=args.target, dtype=args.dtype, tensor_parallel_size=args.tp, device=args.device)
    dcfg = _draft_config(args)
    target, draft, tok, device = load_models(tcfg, dcfg)
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        seed=0 if args.temperature > 0 else None,
        ignore_eos=args.ignore_eos,
    )
    try:
        core, (token_prompts, plain) = compare_engines(target, draft, tok, tcfg, dcfg, messages, params, args.batch)
    finally:
        close_target(target)
    result = {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "num_prompts": len(messages),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "mode": "tree" if args.tree else "chain",
        "k": None if args.tree else args.k,
        "tree": dcfg.tree.model_dump() if dcfg.tree else None,
        "batch": args.batch,
        "tp": args.tp,
        "device": str(device),
        "dtype": args.dtype,
        "machine": std_platform.processor() or std_platform.machine(),
        "ignore_eos": args.ignore_eos,
        "adaptive": args.adaptive,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        **core,
    }
    if not args.no_hf:
        hf, t_hf = _hf_baseline(Path(target_dir_of(args)), tok, token_prompts, args, device)
        n_hf = sum(len(h) for h in hf)
        result["transformers"] = {"tokens": n_hf, "seconds": round(t_hf, 3), "tokens_per_s": round(n_hf / t_hf, 2)}
        if args.temperature == 0:
            result["transformers"]["plain_matches"] = sum(_same_prefix(h, o.token_ids) for h, o in zip(hf, plain))
    return result


def target_dir_of(args) -> Path:
    from eagleray.platform.checkpoints.target import resolve_target

    return resolve_target(args.target, args.dtype)


def _same_prefix(hf: list[int], ours: list[int]) -> bool:
    """transformers keeps generating pad after EOS in batches; compare up to our length."""
    return hf[: len(ours)] == ours


def print_table(r: dict) -> None:
    rows = [
        ("plain (eagleray)", r["plain"]["tokens_per_s"], "1.00x", "", ""),
        (
            f"spec {r['mode']} (eagleray)",
            r["spec"]["tokens_per_s"],
            f"{r['speedup']:.2f}x",
            f"{r['tau']:.2f}",
            "" if r["lossless"] is None else str(r["lossless"]),
        ),
    ]
    if "transformers" in r:
        hf = r["transformers"]["tokens_per_s"]
        rows.append(("transformers generate", hf, f"{hf / r['plain']['tokens_per_s']:.2f}x", "", ""))
    columns = [("decoder", "<26"), ("tok/s", ">10"), ("vs plain", ">10"), ("tau", ">7"), ("lossless", ">10")]
    print_rows(columns, ((name, f"{tps:.2f}", *rest) for name, tps, *rest in rows))
    print(
        f"acceptance per position: {r['acceptance_per_pos']}  ({r['num_prompts']} prompts from {r['prompts']}, "
        f"max_tokens={r['max_tokens']}, T={r['temperature']}, {r['device']}, {r['dtype']})"
    )
    print(
        f"decode step at batch {r['batch']}: plain {r.get('plain_step_ms')} ms, spec {r.get('spec_step_ms')} ms; "
        f"decode speedup measured {r.get('decode_speedup')}, predicted {r.get('predicted_speedup')}"
    )
    chosen = {b: c["k"] for b, c in r.get("policy", {}).get("buckets", {}).items()}
    print(
        f"adaptive k by batch bucket: {chosen}  (spec steps {r.get('spec_steps')}, plain steps {r.get('plain_steps_in_spec_run')})"
    )
    print_profile(r)


def print_profile(r: dict) -> None:
    """Per-phase milliseconds per decode step, plain and speculative, with the host-overhead share."""
    from eagleray.serve.engine import PHASES

    rows = [(f"plain b{b}", row) for b, row in r.get("plain_profile", {}).get("plain", {}).items()]
    rows += [(f"spec b{b}", row) for b, row in r.get("spec_profile", {}).get("spec", {}).items()]
    if not rows:
        return
    phases = [p for p in PHASES if any(f"{p}_ms" in row for _, row in rows)]
    print(f"\n{'step (ms)':<12}" + "".join(f"{p:>13}" for p in phases) + f"{'total':>10}{'host':>8}{'steps':>7}")
    for name, row in rows:
        print(
            f"{name:<12}"
            + "".join(f"{row.get(p + '_ms', 0.0):>13.3f}" for p in phases)
            + f"{row['step_ms']:>10.3f}{row['host_fraction']:>8.1%}{row['steps']:>7}"
        )


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    """Entry for `eagleray bench spec` (a Namespace) and the bench dispatcher (an argv list)."""
    return run_suite(args, "eagleray bench spec", __doc__, add_arguments, measure_args, print_table)


if __name__ == "__main__":
    run(sys.argv[1:])
