"""``bench prefill-ab``: one prefill step of N chat prompts on the CPU, eagleray before / after the prefill layer and
vLLM in the same process, alternating (a VM's speed moves between runs, not within one round).

- ``eagleray_before``: the PyTorch decoder layers between oneDNN's GEMMs (``native_layer.PREFILL_LAYER`` off) and the
  native kernels' helper threads spinning 20,000 pauses after a call, as before ``cpu_decode.PREFILL_HELPER_SPIN``;
- ``eagleray_after``: the shipped path (``kernels/cpu_prefill``: native RMSNorm, RoPE + K/V write, causal block
  attention, SiLU x up; residual adds in oneDNN; helpers not spinning inside a prefill);
- ``vllm``: ``vllm.LLM.chat(..., max_tokens=1)`` on the same fp32 SmolLM2 (its template, tokenizer and scheduler
  included, so it is an upper bound of vLLM's prefill step).

Prompts: 128 random token ids decoded, one user turn each (~161 tokens with the chat template), as vLLM's load
generator's random dataset. Prints medians, writes JSON.

    python -m eagleray.jobs.bench prefill-ab --batches 1,8 --rounds 10,4 --json OUT
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from eagleray.jobs.bench.common import log, write_json
from eagleray.kernels import cpu_decode
from eagleray.platform.checkpoints.target import resolve_target
from eagleray.platform.config.schemas import TargetConfig
from eagleray.platform.models import native_layer
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, load_models


def _prompt(tok, seed: int) -> list[dict]:
    ids = torch.randint(1000, 30000, (128,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"role": "user", "content": tok.decode(ids)}]


def _eagleray(engine: LLMEngine, before: bool):
    def prefill(msgs: list) -> float:
        kept = native_layer.PREFILL_LAYER, cpu_decode.PREFILL_HELPER_SPIN
        native_layer.PREFILL_LAYER = not before
        cpu_decode.PREFILL_HELPER_SPIN = 20000 if before else kept[1]
        try:
            for m in msgs:
                engine.add_request(m, SamplingParams(max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            engine.step()  # the prefill step
            dt = time.perf_counter() - t0
            while engine.has_unfinished():
                engine.step()
        finally:
            native_layer.PREFILL_LAYER, cpu_decode.PREFILL_HELPER_SPIN = kept
        return dt

    return prefill


def _vllm(model_dir: str, max_num_seqs: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm import SamplingParams as VllmParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=max_num_seqs,
              enable_prefix_caching=False)  # fmt: skip

    def prefill(msgs: list) -> float:
        t0 = time.perf_counter()
        llm.chat(msgs, VllmParams(max_tokens=1, temperature=0), use_tqdm=False)
        return time.perf_counter() - t0

    return prefill


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="eagleray bench prefill-ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8", help="prompts a prefill step, comma-separated")
    p.add_argument("--rounds", default="10,4", help="timed rounds per batch (one warm-up round more)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-vllm", action="store_true", help="eagleray before/after only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, rounds = [int(b) for b in args.batches.split(",")], [int(r) for r in args.rounds.split(",")]
    tcfg = TargetConfig(model="smollm2", dtype="fp32", device="cpu", max_model_len=2048)
    target, _, tok, _ = load_models(tcfg, None)
    engine = LLMEngine(target, tok, EngineConfig(target=tcfg, max_num_seqs=max(batches)))
    modes = {"eagleray_before": _eagleray(engine, True), "eagleray_after": _eagleray(engine, False)}
    if not args.no_vllm:
        modes["vllm"] = _vllm(str(resolve_target("smollm2", "fp32")), max(batches))
    records = []
    for n, reps in zip(batches, rounds):
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(reps + 1):
            msgs = [_prompt(tok, 1000 * r + 100 * n + i) for i in range(n)]
            for name, prefill in modes.items():
                dt = prefill(msgs)
                if r:
                    seconds[name].append(dt)
        for name, v in seconds.items():
            rec = {
                "batch": n,
                "mode": name,
                "median_ms": round(1e3 * statistics.median(v), 1),
                "min_ms": round(1e3 * min(v), 1),
                "rounds": reps,
            }
            records.append(rec)
            log(f"batch {n:2d}  {name:16s} median {rec['median_ms']:8.1f} ms  min {rec['min_ms']:8.1f} ms")
    result = {"suite": "prefill-ab", "threads": args.threads, "records": records}
    write_json(result, args.json)
    return result
