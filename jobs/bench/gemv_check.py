"""GPU check + tile sweep for the batch-1 decode GEMVs, then the decode bench (one device call).

Run: `python -m eagleray.jobs.bench.gemv_check OUT_DIR [bench options]`.

1. correctness: 8B-shaped random bf16 model, one batch-1 step at context 64: Triton-GEMV step (eager and
   CUDA graph) vs the cuBLAS fused step and the model's own forward: logits relative error, argmax.
2. sweep: per weight shape, tiles x warps x stages, 16 launches on distinct weight copies in a CUDA
   graph (weights never L2-resident) -> GB/s of weight read; the best goes into ``decode_gemv.CONFIGS``.
3. ``bench gpu`` with the given options (old and new batch-1 paths side by side).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import torch

from eagleray.jobs.bench import gpu as bench_gpu
from eagleray.jobs.bench.common import LLAMA_8B, log
from eagleray.kernels import decode_gemv
from eagleray.kernels.decode_ops import KVWrite
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.graphs import DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows

SHAPES = {
    "qkv_rope": (6144, 4096),
    "o_res": (4096, 4096),
    "gate_up_norm": (28672, 4096),
    "down_silu_res": (4096, 14336),
    "lm_head_norm": (128256, 4096),
}
COPIES = 16
GRID = [
    (8, 512, 4, 3),
    (16, 512, 4, 3),
    (4, 512, 4, 3),
    (8, 1024, 4, 3),
    (16, 1024, 8, 3),
    (8, 256, 4, 4),
    (16, 256, 4, 4),
    (4, 1024, 4, 3),
    (8, 512, 8, 3),
    (16, 512, 8, 3),
    (32, 256, 8, 3),
    (8, 512, 4, 2),
    (8, 512, 4, 4),
    (16, 512, 4, 2),
    (32, 512, 8, 2),
    (4, 256, 4, 4),
    (16, 1024, 4, 2),
    (32, 128, 4, 4),
]


def correctness(model: LlamaModel) -> dict:
    dev = torch.device("cuda")
    kv = model.make_kv_cache(8, 16)
    tables = torch.arange(5, device=dev, dtype=torch.int32).view(1, 5)
    ids = torch.randint(0, model.arch.vocab_size, (64,), device=dev)
    with torch.inference_mode():
        attn = AttentionMetadata.build([64], [0], tables, 16)
        hidden, _ = model(ids, torch.arange(64, device=dev), attn, kv)
        tok = model.compute_logits(hidden[-1:]).argmax(-1)  # [1]
        pos, slots, lens = (
            torch.tensor([64], device=dev),
            torch.tensor([64], device=dev),
            torch.tensor([65], device=dev, dtype=torch.int32),
        )
        attn = AttentionMetadata.build([1], [64], tables, 16)
        h, _ = model(tok, pos, attn, kv)
        ref = model.compute_logits(h).float()  # [1, V] the model's own forward
        out = {}
        for name, kw in {
            "gemv_eager": dict(use_graphs=False),
            "cublas_eager": dict(use_graphs=False, use_gemv=False),
            "gemv_graph": {},
        }.items():
            runner = DecodeGraphRunner(model, kv, 5, buckets=(1,), **kw)
            runner.capture()
            got = runner.run(DecodeRows(tok, pos, tables, lens, slots))[0].float()
            out[name] = dict(
                rel_err=float((got - ref).norm() / ref.norm()),
                argmax_equal=bool((got.argmax(-1) == ref.argmax(-1)).all()),
                finite=bool(torch.isfinite(got).all()),
            )
            out[name + "_logits"] = got
    out["graph_vs_eager_max_abs"] = float((out.pop("gemv_graph_logits") - out.pop("gemv_eager_logits")).abs().max())
    out.pop("cublas_eager_logits")
    log(f"correctness: {out}")
    return out


def _launcher(name: str, n: int, k: int, bufs: dict):
    """A closure launching the kernel of ``name`` on weight copy i."""
    dev = torch.device("cuda")
    if name == "qkv_rope":
        kc = torch.randn(64, 16, 8, 128, device=dev, dtype=torch.bfloat16)
        pos, slot, inv = torch.tensor([100], device=dev), torch.tensor([7], device=dev), torch.rand(64, device=dev)
        kv = KVWrite(pos, inv, kc, kc, slot, 32, 8)
        return lambda w: decode_gemv.qkv_rope_gemv(bufs["x"][:, :k], bufs["nw"][:k], 1e-5, w, None, kv)
    if name.endswith("_norm"):
        return lambda w: decode_gemv.gemv(bufs["x"][:, :k], w, mode="norm", norm_weight=bufs["nw"][:k], eps=1e-5)
    if name == "down_silu_res":
        return lambda w: decode_gemv.gemv(bufs["x"][:, : 2 * k], w, mode="silu", residual=bufs["x"][:, :n])
    return lambda w: decode_gemv.gemv(bufs["x"][:, :k], w, residual=bufs["x"][:, :n])


def _time_graph(fn, weights) -> float:
    for w in weights[:2]:
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def sweep(budget_s: float) -> dict:
    dev = torch.device("cuda")
    bufs = dict(
        x=torch.randn(1, 2 * 14336, device=dev, dtype=torch.bfloat16),
        nw=torch.rand(14336, device=dev, dtype=torch.bfloat16) + 0.5,
    )
    results = {}
    for name, (n, k) in SHAPES.items():
        t_end = time.perf_counter() + budget_s / len(SHAPES)
        copies = max(2, min(COPIES, (2 << 30) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        fn, rows = _launcher(name, n, k, bufs), []
        default = decode_gemv.config(n // 2 if name == "qkv_rope" else n, k)
        for cfg in [default] + [c for c in GRID if c != default]:
            if time.perf_counter() > t_end and rows:
                break
            decode_gemv.CONFIGS[(n // 2 if name == "qkv_rope" else n, k)] = cfg
            try:
                sec = _time_graph(fn, weights)
            except Exception as exc:  # noqa: BLE001 - a config may not compile; record and go on
                rows.append(dict(cfg=cfg, error=str(exc)[:200]))
                continue
            rows.append(dict(cfg=cfg, us=round(sec * 1e6, 2), GBps=round(n * k * 2 / sec / 1e9, 1)))
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        decode_gemv.CONFIGS[(n // 2 if name == "qkv_rope" else n, k)] = tuple(best["cfg"])
        results[name] = dict(default=ok[0], best=best, tried=len(rows), rows=rows)
        log(f"sweep {name}: default {ok[0]} best {best} ({len(rows)} tried)")
        del weights
    return results


def main(argv: list[str]) -> None:
    out = pathlib.Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaModel.from_config(LLAMA_8B, dtype="bf16", device=torch.device("cuda"))
    result = dict(correctness_default=correctness(model))
    del model
    torch.cuda.empty_cache()
    result["sweep"] = sweep(float(argv[1]))
    result["configs"] = {f"{n}x{k}": c for (n, k), c in decode_gemv.CONFIGS.items()}
    (out / "gemv_check.json").write_text(json.dumps(result, indent=1))
    torch.manual_seed(0)
    model = LlamaModel.from_config(LLAMA_8B, dtype="bf16", device=torch.device("cuda"))
    result["correctness_tuned"] = correctness(model)
    (out / "gemv_check.json").write_text(json.dumps(result, indent=1))
    del model
    torch.cuda.empty_cache()
    bench_gpu.run(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
