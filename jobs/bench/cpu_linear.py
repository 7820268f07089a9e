"""``bench cpu-linear``: the native CPU linear (kernels/cpu_decode.c) against torch's (MKL/oneDNN) matmul on
SmolLM2's weights, for the row counts of decode (1), verification (batch x (k+1)) and drafting.

One pass = every linear of a SmolLM2-135M forward (30 layers of fused q/k/v, o, fused gate/up and down,
then the 49152-row lm_head: 0.537 GB of fp32 weights, distinct tensors so nothing stays in cache) at M
rows. The implementations alternate within each repetition (the machine's speed drifts), the fastest
repetition counts; every native result is compared with torch.nn.functional.linear first.

    python -m eagleray.jobs.bench cpu-linear --rows 1,5,8,16,40,64 --threads 2 --json OUT
    python -m eagleray.jobs.bench cpu-linear --impls native ...   # the native kernel alone (on 2 cores torch's
                                                                  # OpenMP workers spin between its calls and take
                                                                  # the native kernel's time with them)
"""

from __future__ import annotations

import argparse
import time

import torch

from eagleray.jobs.bench.common import log, write_json
from eagleray.kernels import cpu_decode
from eagleray.platform.errors import EaglerayError

# SmolLM2-135M: (rows N, width K) of each linear and how many of it a forward runs
SHAPES = {
    "qkv": (960, 576, 30),
    "o": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="eagleray bench cpu-linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,5,8,16,40,64", help="comma-separated M values")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--impls", default="native,torch", help="comma-separated, of native and torch")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    every = {"native": cpu_decode.linear, "torch": torch.nn.functional.linear}
    wanted = args.impls.split(",")
    if any(name not in every for name in wanted):
        raise EaglerayError(f"--impls {args.impls!r}: name native and/or torch\n    fix: --impls native,torch")
    impls = {name: every[name] for name in wanted}
    torch.set_num_threads(args.threads)
    cpu_decode.set_threads(args.threads)
    cpu_decode.configure("native")
    g = torch.Generator().manual_seed(0)
    weights = [(name, torch.randn(n, k, generator=g) * k**-0.5) for name, (n, k, count) in SHAPES.items() for _ in range(count)]
    gbytes = sum(w.numel() for _, w in weights) * 4 / 1e9
    records = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for _, k, _ in SHAPES.values()}
        for _, w in weights:  # values first (and the packed layouts made outside the timing)
            x = xs[w.shape[1]]
            torch.testing.assert_close(cpu_decode.linear(x, w), cpu_decode.linear_reference(x, w), atol=1e-4, rtol=1e-4)
        best = {name: float("inf") for name in impls}
        for _ in range(args.reps):
            for name, fn in impls.items():
                t0 = time.perf_counter()
                for _, w in weights:
                    fn(xs[w.shape[1]], w)
                best[name] = min(best[name], time.perf_counter() - t0)
        flops = 2 * m * gbytes / 4 * 1e9
        rec = {"rows": m, "threads": args.threads, "weights_gb": round(gbytes, 3)}
        for name, s in best.items():
            rec[f"{name}_ms"] = round(s * 1e3, 2)
            rec[f"{name}_gflops"] = round(flops / s / 1e9, 1)
            rec[f"{name}_weight_gb_s"] = round(gbytes / s, 1)
        if len(best) == 2:
            rec["native_vs_torch"] = round(best["torch"] / best["native"], 2)
        records.append(rec)
        log(
            f"M={m:4d}: "
            + " | ".join(
                f"{n} {rec[n + '_ms']:7.2f} ms ({rec[n + '_gflops']:6.1f} GF/s, {rec[n + '_weight_gb_s']:5.1f} GB/s)"
                for n in best
            )
        )
    result = {"suite": "cpu-linear", "records": records}
    write_json(result, args.json)
    return result
