"""Where a prefill step's time goes: SmolLM2 (bf16 on CUDA, fp32 elsewhere), prefills of 1 and 8 prompts timed, then
one one-prompt prefill under ``torch.profiler`` (the top operators by host time and by device time).

`python -m eagleray.jobs.bench.prefill_profile --prompts mtbench`
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from eagleray.platform.config.schemas import TargetConfig
from eagleray.platform.host import pick_device
from eagleray.platform.prompts import load_prompts
from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams, load_models


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="mtbench", help="prompt source (mtbench, humaneval or a file); 16 are used")
    args = p.parse_args(argv)
    device = pick_device()
    tcfg = TargetConfig(
        model="smollm2", dtype="bf16" if device.type == "cuda" else "fp32", device=device.type, max_model_len=2048
    )
    target, _, tok, _ = load_models(tcfg, None)
    msgs = [r.to_dict()["messages"] for r in load_prompts(args.prompts, limit=16).records]
    engine = LLMEngine(target, tok, EngineConfig(target=tcfg, max_num_seqs=8))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate(msgs[:8], params)  # warm-up
    for n in (1, 8):
        for _ in range(3):
            for m in msgs[8 : 8 + n]:
                engine.add_request(m, params)
            _sync(device)
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            print(f"prefill of {n} prompt(s): {1e3 * (time.perf_counter() - t0):.1f} ms")
            while engine.has_unfinished():
                engine.step()
    engine.add_request(msgs[9], params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
        _sync(device)
    table = prof.key_averages()
    print(table.table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))
    if device.type == "cuda":
        print(table.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
