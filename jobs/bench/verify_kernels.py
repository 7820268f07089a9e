"""Benchmark suite `verify`: eagleray's chain verification vs the PyTorch reference and vLLM.

Run: `python -m eagleray.jobs.bench verify [--quick] [--out docs/bench/verify-h200.json]`.
vLLM's kernels come from `.vllm_kernels/` (made by `python -m eagleray.jobs.bench.vllm_extract`).

Roofline: the bytes that must be read once - the logits B*(K+1)*V*elem, plus for sampled rows the
draft probs B*K*V*4 (the definition under which vLLM's v1 pipeline is 0.18 of a 116.5 us roofline
at B=64, K=7, V=128256) - over the device-to-device copy bandwidth measured in the same run
(bytes read + written / time). eagleray reads the draft probs of one row per batch row only, so its
fraction can exceed 1 for sampled cases; `bytes_read` records what it actually reads.
"""

from __future__ import annotations

import datetime
import json
import math
import pathlib
import sys
import time
from itertools import product

import torch
import triton

from eagleray.kernels.verify_chain import verify_chain, verify_chain_reference
from eagleray.kernels.verify_common import DEFAULT_CONFIG, LaunchConfig
from eagleray.platform.host import pick_device

FULL_GRID = dict(B=(1, 8, 64, 256), K=(1, 3, 7), V=(32000, 128256), dtype=("fp32", "bf16"), mode=("greedy", "sampled"))
QUICK_GRID = dict(B=(1, 4), K=(1, 3), V=(64,), dtype=("fp32", "bf16"), mode=("greedy", "sampled"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
KEY_CASE = dict(bsz=64, k=7, vocab=128256, dtype="fp32")


def make_case(bsz, k, vocab, dtype, mode, device, seed=0):
    """Random inputs: target logits, draft probs q, drafts ~ q, temperature, seeds."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(bsz, k + 1, vocab, device=device, generator=g) * 3).to(DTYPES[dtype])  # [B, K+1, V]
    q = torch.softmax(torch.randn(bsz, k, vocab, device=device, generator=g) * 3, -1)  # [B, K, V]
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(bsz, k)  # [B, K]
    temp = torch.full((bsz,), 0.0 if mode == "greedy" else 1.0, device=device)  # [B]
    seeds = torch.arange(bsz, device=device, dtype=torch.int64) * 1000003 + 17  # [B]
    return dict(logits=logits, q=q if mode == "sampled" else None, draft=draft, temp=temp, seed=seeds)


def eagleray_fn(case, cfg):
    greedy = bool((case["temp"] == 0).all())
    return lambda: verify_chain(
        case["logits"], case["draft"], case["q"], temperature=case["temp"], seed=case["seed"], all_greedy=greedy, config=cfg
    )


def reference_fn(case):
    return lambda: verify_chain_reference(case["logits"], case["draft"], case["q"], temperature=case["temp"], seed=case["seed"])


def vllm_v1_fn(case):
    """vLLM v1 pipeline on the K draft rows: temperature + softmax (or argmax) + its kernels."""
    import vllm_v1_kernels as v1

    logits, draft, q, temp = case["logits"], case["draft"], case["q"], case["temp"]
    bsz, rows, vocab = logits.shape
    k = rows - 1
    dev = logits.device
    cu = (torch.arange(1, bsz + 1, device=dev) * k).to(torch.int32)  # [B] end offsets
    draft_ids = draft.reshape(-1).to(torch.int32)  # [B*K]
    bonus = torch.zeros(bsz, dtype=torch.int64, device=dev)  # bonus sampling not charged
    is_greedy = temp == 0
    q2 = None if q is None else q.reshape(-1, vocab)  # [B*K, V]

    def greedy():
        out = torch.full((bsz, k + 1), -1, dtype=torch.int32, device=dev)
        argmax = logits[:, :k].reshape(-1, vocab).argmax(-1)
        v1.rejection_greedy_sample_kernel[(bsz,)](out, cu, draft_ids, argmax, bonus, None, k, None, None, SYNTHETIC_MODE=False)
        return out

    def sampled():
        out = torch.full((bsz, k + 1), -1, dtype=torch.int32, device=dev)
        probs = (logits[:, :k].float() / temp[:, None, None]).reshape(-1, vocab).softmax(-1, dtype=torch.float32)
        uniform = torch.rand(bsz * k, dtype=torch.float64, device=dev)
        inv_q = torch.empty(bsz, vocab, device=dev).exponential_().reciprocal()
        rec = torch.empty_like(draft_ids)
        v1.sample_recovered_tokens_kernel[(bsz, k)](
            rec, cu, draft_ids, q2, probs, inv_q, vocab, BLOCK_SIZE=8192, NO_DRAFT_PROBS=q2 is None, USE_FP64_GUMBEL=False
        )
        v1.rejection_random_sample_kernel[(bsz,)](
            out,
            cu,
            draft_ids,
            q2,
            probs,
            bonus,
            rec,
            uniform,
            is_greedy,
            k,
            vocab,
            None,
            NO_DRAFT_PROBS=q2 is None,
            SYNTHETIC_MODE=False,
        )
        return out

    return greedy if bool(is_greedy.all()) else sampled


def vllm_mrv2_fn(case):
    """vLLM's logits-in sampler (MRV2); draft logits = log(q) so the same bytes are read."""
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    logits, draft, q, temp, seed = case["logits"], case["draft"], case["q"], case["temp"], case["seed"]
    bsz, rows, vocab = logits.shape
    dev = logits.device
    flat = logits.reshape(-1, vocab)  # [B*(K+1), V]
    sampled = torch.cat([torch.zeros_like(draft[:, :1]), draft], 1).reshape(-1)  # row i+1 verifies draft i
    cu = torch.arange(bsz + 1, device=dev, dtype=torch.int32) * rows
    pos = torch.arange(bsz * rows, device=dev, dtype=torch.int64)
    idx = torch.arange(bsz, device=dev, dtype=torch.int32)
    exp_idx = idx.repeat_interleave(rows)
    local = torch.arange(rows, device=dev, dtype=torch.int32).repeat(bsz)
    draft_logits = None if q is None else torch.log(q)
    return lambda: rejection_sample(flat, draft_logits, sampled, cu, pos, idx, exp_idx, local, temp, seed, rows - 1)


def time_us(fn, graph: bool) -> tuple[float, str]:
    """Median microseconds; CUDA-graph replay when possible (what a serving engine does)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=25) * 1e3, "cudagraph"
        except RuntimeError as err:  # capture not possible: fall back to stream timing, say so
            print(f"  cudagraph capture failed ({str(err)[:80]}); timing without graphs", file=sys.stderr)
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3, "stream"


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = 512 * 1024 * 1024  # 2 GiB of fp32
    x = torch.empty(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    x = y = None  # free the buffers
    return 2 * n * 4 / (ms * 1e-3)


def roofline_bytes(bsz, k, vocab, dtype, mode) -> tuple[int, int]:
    """(bytes that must be read once, bytes eagleray reads)."""
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    logits = bsz * (k + 1) * vocab * elem
    if mode == "greedy":
        return logits, logits
    return logits + bsz * k * vocab * 4, logits + bsz * vocab * (elem + 4)


def check_gpu(device) -> dict:
    """Kernel vs reference on the GPU: greedy exact, sampled mismatching rows counted."""
    out = {}
    for mode, dtype in product(("greedy", "sampled"), ("fp32", "bf16")):
        for with_q in (True, False):
            case = make_case(64, 7, 128256, dtype, mode, device, seed=1)
            if not with_q:
                case["q"] = None
            got = eagleray_fn(case, None)()
            want = reference_fn(case)()
            bad = int(((got[0] != want[0]).any(1) | (got[1] != want[1])).sum())
            out[f"{mode}-{dtype}-{'q' if with_q else 'noq'}"] = dict(
                mismatched_rows=bad, rows=64, mean_accepted=float(got[1].float().mean())
            )
    return out


def sweep_configs(device) -> tuple[LaunchConfig, list]:
    """Try a few tile shapes on the key case; pick the fastest sampled+greedy total."""
    results, best, best_t = [], DEFAULT_CONFIG, math.inf
    for bv, w, rbv in product((2048, 4096, 8192), (4, 8), (2048, 8192)):
        cfg = LaunchConfig(block_v=bv, warps=w, recover_block_v=rbv, recover_warps=w)
        total = 0.0
        for mode in ("greedy", "sampled"):
            us, _ = time_us(eagleray_fn(make_case(**KEY_CASE, mode=mode, device=device), cfg), True)
            results.append(dict(block_v=bv, warps=w, recover_block_v=rbv, mode=mode, us=round(us, 2)))
            total += us
        if total < best_t:
            best, best_t = cfg, total
    return best, results


IMPLS = ("eagleray", "torch_ref", "vllm_v1", "vllm_mrv2")


def _impl_fn(impl, case, cfg):
    if impl == "eagleray":
        return eagleray_fn(case, cfg)
    if impl == "torch_ref":
        return reference_fn(case)
    return vllm_v1_fn(case) if impl == "vllm_v1" else vllm_mrv2_fn(case)


def _time(fn, device, graph) -> tuple[float, str]:
    if device.type != "cuda":  # CPU smoke run (interpreter): one wall-clock call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "wall"
    return time_us(fn, graph)


def run_grid(grid, device, cfg, bw) -> list[dict]:
    records = []
    for bsz, k, vocab, dtype, mode in product(grid["B"], grid["K"], grid["V"], grid["dtype"], grid["mode"]):
        case = make_case(bsz, k, vocab, dtype, mode, device)
        need, reads = roofline_bytes(bsz, k, vocab, dtype, mode)
        roof_us = need / bw * 1e6
        for impl in IMPLS:
            rec = dict(impl=impl, mode=mode, B=bsz, K=k, V=vocab, dtype=dtype)
            try:
                us, timer = _time(_impl_fn(impl, case, cfg), device, graph=impl != "torch_ref")
            except Exception as err:  # noqa: BLE001  recorded in the JSON and printed, never dropped
                rec.update(us=None, roofline_fraction=None, error=f"{type(err).__name__}: {str(err)[:200]}")
                records.append(rec)
                print(f"{impl:10s} {mode:8s} B={bsz} K={k} V={vocab} {dtype}: FAILED {rec['error']}")
                continue
            rec.update(
                us=round(us, 2),
                roofline_fraction=round(roof_us / us, 3),
                roofline_us=round(roof_us, 2),
                bytes=need,
                bytes_read=reads if impl == "eagleray" else None,
                timer=timer,
            )
            records.append(rec)
            print(
                f"{impl:10s} {mode:8s} B={bsz:3d} K={k} V={vocab:6d} {dtype}: {us:9.1f} us  roof {rec['roofline_fraction']:.3f}"
            )
        del case
    return records


def run(argv: list[str]) -> dict:
    import argparse

    ap = argparse.ArgumentParser(prog="eagleray bench verify")
    ap.add_argument("--quick", action="store_true", help="tiny grid (CPU interpreter smoke run)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    ap.add_argument("--vllm-kernels", default=".vllm_kernels", help="folder made by jobs/bench/vllm_extract.py")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile-size sweep")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(args.vllm_kernels).resolve()))
    device = pick_device()
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET)",
        torch=torch.__version__,
        triton=triton.__version__,
        command="python -m eagleray.jobs.bench verify " + " ".join(argv),
    )
    cfg, sweep = None, []
    if device.type == "cuda":
        meta["copy_bandwidth_GBps"] = round(copy_bandwidth(device) / 1e9, 1)
        meta["gpu_check"] = check_gpu(device)
        print("gpu check:", json.dumps(meta["gpu_check"]))
        if not args.no_sweep:
            cfg, sweep = sweep_configs(device)
    bw = meta.get("copy_bandwidth_GBps", 4300.0) * 1e9
    meta["config"] = vars(cfg) if cfg is not None else "default"
    records = run_grid(QUICK_GRID if args.quick else FULL_GRID, device, cfg, bw)
    result = dict(meta=meta, sweep=sweep, records=records)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return result
