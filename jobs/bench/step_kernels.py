"""``bench step-kernels``: where a decode step's time goes, kernel by kernel (GPU).

The engine's plain decode step (the batch-invariant fused step in a CUDA graph, as ``engine.decode_path: rows``
runs it) on SmolLM2 or Llama-3.1-8B shapes (random bf16 weights: the shapes set the time), one graph replay timed
by CUDA events, then ``torch.profiler`` over ``--replays`` replays: each kernel's count and mean time per step,
grouped by kernel name, largest first. The sum of kernel times against the replay time says how much of the step
is gaps between kernels. ``--variant gemv`` profiles the batch-1 GEMV step (not batch-invariant) beside it.

    python -m eagleray.jobs.bench step-kernels --model smollm2 --batch 1 --json OUT
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from eagleray.jobs.bench.common import CONFIGS, print_rows, run_suite
from eagleray.platform.errors import EaglerayError
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows

BLOCK = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", choices=["smollm2", "8b"], help="the shapes of the step")
    p.add_argument("--batch", type=int, default=1, help="rows of the step")
    p.add_argument("--context", type=int, default=200, help="tokens cached per sequence")
    p.add_argument("--replays", type=int, default=50, help="replays profiled")
    p.add_argument("--variant", default="invariant", choices=["invariant", "gemv"], help="the step's kernels")
    p.add_argument("--json", default=None, help="write the results here")


def measure(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise EaglerayError("bench step-kernels needs a CUDA GPU\n    fix: run it on a GPU machine")
    dev, b, ctx = torch.device("cuda"), args.batch, args.context
    model = LlamaModel.from_config(CONFIGS[args.model], dtype=torch.bfloat16, device=dev, std=0.02)
    blocks = -(-(ctx + 2) // BLOCK)
    kv = model.make_kv_cache(b * blocks + 1, BLOCK)
    runner = DecodeGraphRunner(model, kv, blocks, buckets=(b,), invariant=args.variant == "invariant")
    runner.capture([b])
    tables = torch.arange(b * blocks, device=dev, dtype=torch.int32).view(b, blocks)  # [B, MB]
    pos = torch.full((b,), ctx, device=dev)
    slots = tables[:, ctx // BLOCK].long() * BLOCK + ctx % BLOCK
    rows = DecodeRows(torch.zeros(b, dtype=torch.int64, device=dev), pos, tables, (pos + 1).int(), slots)
    with torch.inference_mode():
        for _ in range(10):
            runner.run(rows)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            runner.run(rows)
        end.record()
        torch.cuda.synchronize()
        step_us = 1e3 * start.elapsed_time(end) / 200
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                runner.run(rows)
            torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.device_time
    table = sorted(
        (
            {"kernel": n[:70], "per_step": c / args.replays, "us_per_step": t / args.replays, "us_each": t / c}
            for n, (c, t) in kernels.items()
        ),
        key=lambda r: -r["us_per_step"],
    )
    busy = sum(r["us_per_step"] for r in table)
    return {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "batch": b,
        "context": ctx,
        "variant": args.variant,
        "step_us": round(step_us, 2),
        "kernel_us": round(busy, 2),
        "kernels_per_step": round(sum(r["per_step"] for r in table), 1),
        "kernels": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in table],
    }


def print_table(result: dict) -> None:
    cols = [("kernel", "<70"), ("per step", ">9"), ("us/step", ">9"), ("us each", ">9")]
    print_rows(cols, ([r["kernel"], r["per_step"], r["us_per_step"], r["us_each"]] for r in result["kernels"]))
    print(
        f"{result['model']} b{result['batch']} {result['variant']}: step {result['step_us']} us (graph replay), "
        f"kernels {result['kernel_us']} us over {result['kernels_per_step']} launches"
    )


def run(args: argparse.Namespace | list[str] | None = None) -> dict:
    return run_suite(args, "eagleray bench step-kernels", __doc__, add_arguments, measure, print_table)
