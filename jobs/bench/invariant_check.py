"""GPU check of the batch-invariant decode path: bitwise row invariance, accuracy, and its cost vs cuBLAS.

`python -m eagleray.jobs.bench.invariant_check OUT.json` (on a CUDA machine; ``--sweep``: tile configurations
for every shape at once; ``--tune [--models 8b,smollm2]``: a plan per weight shape, merged into
``kernels/invariant_linear_plans.json`` or the file ``EAGLERAY_INVARIANT_PLANS`` names):

1. :func:`~eagleray.kernels.invariant_linear.invariant_linear` on Llama-3.1-8B and SmolLM2 weight
   shapes (bf16): every row of M = 5, 64, 320 equals the same row computed alone, bit for bit; error
   against an fp32 reference; time per call (CUDA graphs of 20 calls) beside ``F.linear`` (cuBLAS)
   and, at M = 1, the batch-1 GEMV of the fused step.
2. The row step (``DecodeGraphRunner(invariant=True)``, SmolLM2 shapes, random bf16): the logits
   of a sequence scored alone, inside a batch of 8, and as row j of a 5-row chain verification are
   bitwise equal.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagleray.jobs.bench.common import SMOLLM2, log
from eagleray.kernels import invariant_plans
from eagleray.kernels.invariant_linear import invariant_linear, invariant_linear_reference
from eagleray.kernels.invariant_plans import PLANS_FILE, make_plan, measured_plans, plan

# the best plans among the earlier candidates (TUNE_TILES[:OLD_TILES]) beside the plans file, for an A/B on any GPU
OLD_PLANS_FILE = PLANS_FILE.with_suffix(".old-tiles.json")
SHAPES = {
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}


def _graph_time(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn``, replayed from a CUDA graph of ``reps`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def linear_records() -> list[dict]:
    from eagleray.kernels.decode_gemv import gemv

    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, shapes in SHAPES.items():
        for n, k in shapes:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            x = torch.randn(320, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            alone = torch.cat([invariant_linear(x[i : i + 1], w) for i in range(8)])
            rec = {"model": model, "n": n, "k": k, "splits": plan(n, k, w.device).splits}
            for m in (5, 64, 320):
                rec[f"invariant_m{m}"] = bool(torch.equal(invariant_linear(x[:m], w)[: 8 if m >= 8 else m], alone[: min(m, 8)]))
            ref = invariant_linear_reference(x[:64], w).float()
            rec["max_rel_err"] = float(((invariant_linear(x[:64], w).float() - ref).abs().max() / ref.abs().max()))
            gbytes = n * k * 2 / 1e9
            for m in (1, 5, 64, 320):
                xm = x[:m].contiguous()
                t_inv = _graph_time(lambda xm=xm, w=w: invariant_linear(xm, w))
                t_cub = _graph_time(lambda xm=xm, w=w: F.linear(xm, w))
                rec[f"us_invariant_m{m}"], rec[f"us_cublas_m{m}"] = round(t_inv, 2), round(t_cub, 2)
                rec[f"tbs_invariant_m{m}"] = round(gbytes / (t_inv * 1e-6) / 1e3, 3)
            x1 = x[:1].contiguous()
            rec["us_gemv_m1"] = round(_graph_time(lambda x1=x1, w=w: gemv(x1, w)), 2)
            out.append(rec)
            log(json.dumps(rec))
    return out


def step_record() -> dict:
    from eagleray.platform.models.graphs import DecodeGraphRunner
    from eagleray.platform.models.llama import LlamaModel
    from eagleray.platform.models.row_graphs import DecodeRows

    dev = torch.device("cuda")
    model = LlamaModel.from_config(SMOLLM2, dtype="bf16", device=dev, aux_layer_ids=[2, 15, 27])
    kv = model.make_kv_cache(64, 16)
    runner = DecodeGraphRunner(model, kv, 32, buckets=(1, 8, 16, 40), invariant=True)
    runner.capture()
    gen = torch.Generator(device=dev).manual_seed(1)
    ctx = 100  # cached tokens of every sequence
    tables = torch.arange(8 * 8, dtype=torch.int32, device=dev).view(8, 8)  # 8 seqs x 8 blocks of 16
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    ids = torch.randint(0, 49152, (8, 5), device=dev, generator=gen)

    def score(rows_seq, rows_pos, rows_ids):
        pos = torch.tensor(rows_pos, device=dev)
        t = tables[torch.tensor(rows_seq, device=dev)]
        slots = t.gather(1, (pos // 16).unsqueeze(1)).squeeze(1).long() * 16 + pos % 16
        logits, aux = runner.run(DecodeRows(rows_ids, pos, t, (pos + 1).int(), slots))
        return logits.clone(), aux.clone()

    # sequence 0: its 5 rows as a chain verification (rows ctx..ctx+4) among 8 sequences x 5 rows
    seqs = [s for s in range(8) for _ in range(5)]
    poss = [ctx + j for _ in range(8) for j in range(5)]
    verify, vaux = score(seqs, poss, ids.reshape(-1))
    # the same positions one by one, alone (plain decode at batch 1) and as a batch of 8 (plain at batch 8)
    alone = torch.cat([score([0], [ctx + j], ids[0, j : j + 1])[0] for j in range(5)])
    batch8 = torch.stack([score(list(range(8)), [ctx + j] * 8, ids[:, j])[0] for j in range(5)], 1)  # [8, 5, V]
    return {
        "verify_row_equals_alone": bool(torch.equal(verify[:5], alone)),
        "verify_equals_batch8": bool(torch.equal(verify.view(8, 5, -1), batch8)),
        "max_abs_diff_alone": float((verify[:5].float() - alone.float()).abs().max()),
    }


TILES = [
    (16, 64, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 128, 8, 3),
    (32, 128, 64, 4, 4),
]


def sweep_records() -> list[dict]:
    """Per tile configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the GEMM time of one decode step
    (per layer qkv + o + gate_up + down, times the layers, plus lm_head) at M = 1, 5, 64, 320, and invariance."""
    import eagleray.kernels.invariant_linear as il

    layers = {"8b": 32, "smollm2": 30}
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        m: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for n, k in shapes]
        for m, shapes in SHAPES.items()
    }
    saved = (il.BLOCK_M, il.plan)
    out = []
    try:
        for tiles in TILES:
            bn, bk, warps, stages = tiles[1:]
            il.BLOCK_M = tiles[0]
            il.plan = lambda n, k, device=None, bn=bn, bk=bk, w=warps, s=stages: make_plan(  # the tiles reach the plan
                n, k, block_n=bn, block_k=bk, warps=w, stages=s
            )
            rec = {"tiles": list(tiles)}
            for model, ws in weights.items():
                k0 = ws[0].shape[1]
                x = torch.randn(320, max(w.shape[1] for w in ws), device="cuda", dtype=torch.bfloat16, generator=gen)
                alone = invariant_linear(x[:1, :k0].contiguous(), ws[0])
                rec[f"{model}_invariant"] = all(
                    bool(torch.equal(invariant_linear(x[:m, :k0].contiguous(), ws[0])[:1], alone)) for m in (5, 64, 320)
                )
                for m in (1, 5, 64, 320):
                    inputs = [(x[:m, : w.shape[1]].contiguous(), w) for w in ws]
                    per = [_graph_time(lambda xm=xm, w=w: invariant_linear(xm, w)) for xm, w in inputs]
                    rec[f"{model}_step_us_m{m}"] = round(layers[model] * sum(per[:4]) + per[4], 1)
            out.append(rec)
            log(json.dumps(rec))
    finally:
        il.BLOCK_M, il.plan = saved
    rec = {"tiles": "cublas"}
    for model, ws in weights.items():
        for m in (1, 5, 64, 320):
            inputs = [(torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16), w) for w in ws]
            per = [_graph_time(lambda xm=xm, w=w: F.linear(xm, w)) for xm, w in inputs]
            rec[f"{model}_step_us_m{m}"] = round(layers[model] * sum(per[:4]) + per[4], 1)
    out.append(rec)
    log(json.dumps(rec))
    return out


# (block_n, block_k, warps, stages): the first six were the 2026-12-02 tuning's; the rest (narrow column tiles, deeper
# K tiles, more stages) give one row more programs in flight or fewer loop trips (2026-12-07)
TUNE_TILES = [
    (32, 128, 4, 3),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 4),
    (128, 128, 8, 3),
    (32, 64, 4, 4),
    (16, 64, 4, 4),
    (16, 128, 4, 3),
    (16, 256, 4, 3),
    (16, 128, 2, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (32, 128, 2, 3),
    (64, 64, 4, 6),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 4, 3),
]
OLD_TILES = 6  # TUNE_TILES[:6] with no split of two: the earlier tuning's candidates, whose best is recorded beside
TUNE_ROWS = {
    1: 3.0,
    5: 2.0,
    8: 1.0,
    64: 1.0,
    320: 0.25,
}  # rows M -> weight in a plan score (batch 1 first; 5: its k=4 verification, whose step is held to 1.5x batch 1's)


def _candidates(n: int, k: int, tiles: list | None = None, extra_splits: tuple[int, ...] = (2,)) -> list:
    """Plans to try for a weight [N, K]: each tile configuration of ``tiles`` (default :data:`TUNE_TILES`) with no
    split, its default split, half and double, and ``extra_splits`` (make_plan drops splits K cannot hold)."""
    seen, out = set(), []
    for bn, bk, warps, stages in TUNE_TILES if tiles is None else tiles:
        default = make_plan(n, k, None, bn, bk, warps, stages).splits
        for splits in sorted({1, default, max(1, default // 2), default * 2, *extra_splits}):
            p = make_plan(n, k, splits, bn, bk, warps, stages)
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def _old_candidates(n: int, k: int) -> set:
    """The earlier tuning's candidates for a weight [N, K]: its six tile configurations, no split of two."""
    return set(_candidates(n, k, TUNE_TILES[:OLD_TILES], ()))


def _shipped_plans() -> dict:
    """The plans shipped in the package for this GPU (whatever ``EAGLERAY_INVARIANT_PLANS`` names), by shape."""
    shipped = Path(invariant_plans.__file__).with_name("invariant_linear_plans.json")
    return json.loads(shipped.read_text()).get(torch.cuda.get_device_name(), {})


def _try_plan(il, p, w, x) -> tuple | None:
    """One candidate plan on weight ``w``: (score, plan, rows invariant, us by M), or None when it does not fit the GPU
    (Triton's OutOfResources: shared memory or registers)."""
    from triton.runtime.errors import OutOfResources

    il.plan = lambda n_, k_, device=None, p=p: p  # noqa: E731 - this candidate for the shape
    try:
        alone = invariant_linear(x[:4].contiguous(), w)
    except OutOfResources as e:
        log(f"  skip {_plan_dict(p)}: {e}")
        return None
    same = all(torch.equal(invariant_linear(x[:m].contiguous(), w)[:4], alone) for m in (8, 64, 320))
    us = {m: _graph_time(lambda xm=x[:m], w=w: invariant_linear(xm, w)) for m in TUNE_ROWS}
    return sum(TUNE_ROWS[m] * t for m, t in us.items()), p, same, us


def tune_records(models: list[str]) -> tuple[list[dict], dict]:
    """Per weight shape of ``models``: every candidate plan's time at M = 1, 5, 8, 64, 320 (CUDA graphs) and whether
    its rows are bitwise the same at every M; the plan of the best score among the invariant ones, beside the default
    and the shipped plan, merged into the plans file shape by shape -> (records, table)."""
    import eagleray.kernels.invariant_linear as il

    gen = torch.Generator(device="cuda").manual_seed(0)
    saved, records, table, shipped = il.plan, [], {}, _shipped_plans()
    shapes = [(model, n, k) for model in models for n, k in SHAPES[model]]
    t0 = time.monotonic()
    try:
        for i, (model, n, k) in enumerate(shapes):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            x = torch.randn(max(TUNE_ROWS), k, device="cuda", dtype=torch.bfloat16, generator=gen)
            default = make_plan(n, k)
            before = make_plan(n, k, **shipped[f"{n}x{k}"]) if f"{n}x{k}" in shipped else None
            tried = [t for t in (_try_plan(il, p, w, x) for p in _candidates(n, k)) if t is not None]
            best = min((t for t in tried if t[2]), key=lambda t: t[0])
            earlier = _old_candidates(n, k)
            old = min((t for t in tried if t[2] and t[1] in earlier), key=lambda t: t[0])
            rec = {"model": model, "n": n, "k": k, "candidates": len(tried), "invariant": all(t[2] for t in tried)}
            named = [("default", next(t for t in tried if t[1] == default)), ("chosen", best), ("old_tiles", old)]
            named += [("shipped", t) for t in tried if before is not None and t[1] == before]
            for name, t in named:
                rec[name] = {"plan": _plan_dict(t[1]), "score_us": round(t[0], 2)}
                rec[name].update({f"us_m{m}": round(v, 2) for m, v in t[3].items()})
            records.append(rec)
            table[f"{n}x{k}"] = _plan_dict(best[1])
            # written as each shape is done (kept if the run is cut off); the earlier candidates' best beside, to compare
            _write_plans({torch.cuda.get_device_name(): {f"{n}x{k}": table[f"{n}x{k}"]}})
            _write_plans({torch.cuda.get_device_name(): {f"{n}x{k}": _plan_dict(old[1])}}, OLD_PLANS_FILE)
            done = time.monotonic() - t0
            log(f"[{i + 1}/{len(shapes)}] {done:.0f} s, ETA {done / (i + 1) * (len(shapes) - i - 1):.0f} s")
            log(json.dumps(rec))
    finally:
        il.plan = saved
    return records, {torch.cuda.get_device_name(): table}


def _plan_dict(p) -> dict:
    return {"splits": p.splits, "block_n": p.block_n, "block_k": p.block_k, "warps": p.warps, "stages": p.stages}


def _write_plans(table: dict, path: Path | None = None) -> None:
    """Merge ``table`` (device name -> shape -> plan) into the plans the kernel reads (or the file ``path``)."""
    path = path or PLANS_FILE
    old = json.loads(path.read_text()) if path.exists() else {}
    for device, shapes in table.items():  # shape by shape: a tuning of one model keeps the other's plans
        old.setdefault(device, {}).update(shapes)
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    measured_plans.cache_clear()
    log(f"wrote {path}")


def main(argv: list[str]) -> int:
    out = argv[0] if argv else "invariant-check.json"
    result = {"device": torch.cuda.get_device_name()}
    if "--tune" in argv:  # --models 8b,smollm2 (default both)
        models = argv[argv.index("--models") + 1].split(",") if "--models" in argv else list(SHAPES)
        result["tune"], table = tune_records(models)
        result["plans"] = table
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return 0
    if "--sweep" in argv:
        result["sweep"] = sweep_records()
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return 0
    result["step"] = step_record()
    log(json.dumps(result["step"]))
    result["linear"] = linear_records()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
