"""Benchmark suite `gpu`: target decode tok/s (eager vs CUDA graphs) against the HBM roofline, and
hidden-state extraction throughput against the bf16 matrix peak.

Run: `python -m eagleray.jobs.bench gpu [--models 8b,smollm2] [--out engine.json]` (see --help).

- decode: greedy, one new token per sequence per step, ``--prompt`` tokens prefilled, ``--steps``
  timed steps (CUDA events around the loop, argmax and slot arithmetic included). Variants:
  ``graph`` (fused step in a CUDA graph; batch 1 through the Triton GEMVs), ``eager`` (the same fused step, no graph),
  ``graph_cublas`` (the fused step with cuBLAS products at batch 1 too, the v1 graph path),
  ``graph_generic`` (``model.forward`` with DecodeMetadata, in a graph), ``engine_eager`` (the paged
  ``AttentionMetadata`` path the engine runs today, with its host syncs).
- roofline: bytes a step must read (every weight except the input embedding table, plus the K/V
  of all cached tokens at the mean context) / the device-to-device copy bandwidth measured in the
  same run (bytes read + written).
- extraction: ``forward_full`` with aux layers (2, N//2, N-3) on [batch, len] random ids; FLOP
  fraction = 2 * (parameters except the input embedding) * tokens / time / measured bf16 matmul rate.
- peer: transformers ``generate`` (random init with ``from_config``, bf16) at batch 1.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import sys
import time

import torch

from eagleray.jobs.bench.common import CONFIGS, log, step_times, write_json
from eagleray.platform.host import pick_device
from eagleray.platform.models.attention import AttentionMetadata
from eagleray.platform.models.graphs import BUCKETS, DecodeGraphRunner
from eagleray.platform.models.llama import LlamaModel
from eagleray.platform.models.row_graphs import DecodeRows

BLOCK = 16


def timed(fn, reps: int, device) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (events on CUDA)."""
    fn()
    return statistics.median(step_times(fn, reps, device))


def ceilings(device) -> dict:
    """Measured copy bandwidth (read + write bytes/s) and bf16 matmul FLOP/s on random data."""
    if device.type != "cuda":
        return dict(copy_GBps=None, matmul_TFLOPs=None)
    x = torch.randn(1 << 29, device=device)  # 2 GiB fp32
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / timed(lambda: y.copy_(x), 10, device)
    x = y = None  # free the 4 GiB before the runs
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * 8192**3 / timed(lambda: a @ b, 10, device)
    return dict(copy_GBps=round(bw / 1e9, 1), matmul_TFLOPs=round(flops / 1e12, 1))


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of every parameter a decode step reads (tied embeddings once; untied input table excluded)."""
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embed)


def kv_bytes(model: LlamaModel, tokens: float) -> float:
    attn = model.layers[0].self_attn
    return tokens * model.arch.num_layers * 2 * attn.kv_heads * attn.head_dim * model.arch.dtype.itemsize


def prefill(model: LlamaModel, kv, tables: torch.Tensor, batch: int, prompt: int, device) -> torch.Tensor:
    """Random prompts [B, prompt] through the paged forward -> first greedy tokens [B]."""
    ids = torch.randint(0, model.arch.vocab_size, (batch, prompt), device=device)
    positions = torch.arange(prompt, device=device).repeat(batch)  # [B*P]
    attn = AttentionMetadata.build([prompt] * batch, [0] * batch, tables, BLOCK)
    with torch.inference_mode():
        hidden, _ = model(ids.reshape(-1), positions, attn, kv)  # [B*P, H]
        return model.compute_logits(hidden.view(batch, prompt, -1)[:, -1]).argmax(-1)  # [B]


class EngineStep:
    """The engine's current path: AttentionMetadata from host lengths, paged SDPA per sequence."""

    def __init__(self, model: LlamaModel, kv, tables: torch.Tensor, prompt: int):
        self.model, self.kv, self.tables, self.prompt, self.step = model, kv, tables, prompt, 0

    def __call__(self, rows: DecodeRows):
        b = rows.num_rows
        attn = AttentionMetadata.build([1] * b, [self.prompt + self.step] * b, self.tables, BLOCK)
        self.step += 1
        hidden, _ = self.model(rows.input_ids, rows.positions, attn, self.kv)
        return self.model.compute_logits(hidden), None


def greedy(step_fn, first: torch.Tensor, prompt: int, tables: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy decode steps from position ``prompt`` -> tokens [steps, B]; no host sync."""
    tok = first.clone()
    pos = torch.full_like(first, prompt)  # [B]
    out = []
    for _ in range(steps):
        slots = tables.gather(1, (pos // BLOCK).unsqueeze(1).to(torch.int64)).squeeze(1).long() * BLOCK + pos % BLOCK
        logits, _ = step_fn(DecodeRows(tok, pos, tables, (pos + 1).to(torch.int32), slots))  # [B, V]
        tok = logits.argmax(-1)
        out.append(tok)
        pos = pos + 1
    return torch.stack(out)


def decode_case(model: LlamaModel, name: str, batch: int, args, ceil: dict, device) -> list[dict]:
    """All decode variants for one model and batch size."""
    blocks = -(-(args.prompt + args.steps + 1) // BLOCK)
    kv = model.make_kv_cache(batch * blocks + 1, BLOCK)  # + the pad block
    tables = torch.arange(batch * blocks, device=device, dtype=torch.int32).view(batch, blocks)  # [B, blocks]
    first = prefill(model, kv, tables, batch, args.prompt, device)
    cuda = device.type == "cuda"
    fused = DecodeGraphRunner(model, kv, blocks, use_graphs=False)
    runners = {"eager": fused}
    if cuda:
        t0 = time.perf_counter()
        runners["graph"] = DecodeGraphRunner(model, kv, blocks)
        runners["graph"].capture()
        first_bucket = [b for b in BUCKETS if b >= batch][:1]
        if "graph_generic" in args.variants:
            runners["graph_generic"] = DecodeGraphRunner(model, kv, blocks, fused=False)
            runners["graph_generic"].capture(first_bucket)
        if "graph_cublas" in args.variants:  # the fused step with cuBLAS products at batch 1 too (v1)
            runners["graph_cublas"] = DecodeGraphRunner(model, kv, blocks, use_gemv=False)
            runners["graph_cublas"].capture(first_bucket)
        log(f"  captured {len(BUCKETS)} + 1 graphs in {time.perf_counter() - t0:.1f} s")
    engine = EngineStep(model, kv, tables, args.prompt)
    bw = (ceil["copy_GBps"] or 0) * 1e9
    roof_s = (weight_bytes(model) + kv_bytes(model, batch * (args.prompt + args.steps / 2))) / bw if bw else None
    records, ref = [], None
    for variant in ("graph", "graph_cublas", "eager", "graph_generic", "engine_eager"):
        if variant not in args.variants or (variant not in runners and variant != "engine_eager"):
            continue
        steps = args.steps if variant != "engine_eager" else max(4, args.steps // 8)
        fn = engine if variant == "engine_eager" else runners[variant].run
        with torch.inference_mode():

            def once(fn=fn, steps=steps):
                engine.step = 0
                return greedy(fn, first, args.prompt, tables, steps)

            sec = timed(once, 2, device)
            toks = once()
        agree = None
        if ref is None:
            ref = toks
        else:
            agree = float((toks == ref[:steps]).float().mean())
        tps = batch * steps / sec
        rec = dict(
            model=name,
            batch=batch,
            variant=variant,
            steps=steps,
            prompt=args.prompt,
            step_ms=round(sec / steps * 1e3, 3),
            tok_per_s=round(tps, 1),
            token_agreement_vs_graph=agree,
            roofline_tok_per_s=round(batch / roof_s, 1) if roof_s else None,
            roofline_fraction=round(tps * roof_s / batch, 3) if roof_s else None,
        )
        records.append(rec)
        log(
            f"  {name:8s} B={batch:3d} {variant:14s} {rec['step_ms']:8.2f} ms/step {tps:9.1f} tok/s "
            f"roof {rec['roofline_tok_per_s']} frac {rec['roofline_fraction']} agree {agree}"
        )
    del runners, fused, kv
    torch.cuda.empty_cache() if cuda else None
    return records


def extraction_case(model: LlamaModel, name: str, args, ceil: dict, device) -> dict:
    n = model.arch.num_layers
    model.set_aux_layers([2, n // 2, n - 3])
    ids = torch.randint(0, model.arch.vocab_size, (args.extract_batch, args.extract_len), device=device)
    sec = timed(lambda: model.forward_full(ids), 3, device)
    tokens = ids.numel()
    params = sum(p.numel() for p in model.parameters()) - (
        0 if model.lm_head.weight is model.embed_tokens.weight else model.embed_tokens.weight.numel()
    )
    flops = 2 * params * tokens / sec
    peak = (ceil["matmul_TFLOPs"] or 0) * 1e12
    rec = dict(
        model=name,
        batch=args.extract_batch,
        seq_len=args.extract_len,
        aux_layers=model.aux_layer_ids,
        seconds=round(sec, 4),
        tok_per_s=round(tokens / sec, 1),
        TFLOPs=round(flops / 1e12, 1),
        flop_fraction=round(flops / peak, 3) if peak else None,
        params=params,
    )
    log(f"  extract {name}: {tokens / sec:,.0f} tok/s, {flops / 1e12:.1f} TFLOP/s, fraction {rec['flop_fraction']}")
    model.set_aux_layers([])
    return rec


def convert_gguf(gguf: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """GGUF (e.g. SmolLM2's Q4_1) -> bf16 HF directory via transformers (needs the gguf package)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if getattr(hf, "hf_quantizer", None) is not None:  # dequantised already; drop the GGUF marker to save
        hf.hf_quantizer.remove_quantization_config(hf)
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(str(out), safe_serialization=True)
    log(f"converted {gguf} -> {out}")
    return out


def build_model(name: str, args, device) -> LlamaModel:
    if name == "smollm2" and args.smollm2_gguf and not args.smollm2_dir:
        args.smollm2_dir = str(convert_gguf(pathlib.Path(args.smollm2_gguf), pathlib.Path("/tmp/smollm2-bf16")))
    if name == "smollm2" and args.smollm2_dir:
        log(f"loading SmolLM2 weights from {args.smollm2_dir}")
        return LlamaModel.from_dir(args.smollm2_dir, dtype=args.dtype, device=device)
    return LlamaModel.from_config(CONFIGS[name], dtype=args.dtype, device=device)


def hf_generate(name: str, args, device) -> list[dict]:
    """transformers' generate at batch 1 on the same config (random init), dynamic and static caches."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in CONFIGS[name].items() if k != "model_type"})
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=device)
    out = []
    for cache in ["dynamic", "static"] if args.hf_static else ["dynamic"]:
        kw = dict(do_sample=False, pad_token_id=0, cache_implementation=None if cache == "dynamic" else "static")
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
            sec = timed(lambda kw=kw: hf.generate(ids, max_new_tokens=args.steps, min_new_tokens=args.steps, **kw), 1, device)
        out.append(
            dict(
                model=name,
                batch=1,
                variant=f"transformers_generate_{cache}",
                steps=args.steps,
                prompt=args.prompt,
                tok_per_s=round(args.steps / sec, 1),
                note="includes the prefill",
            )
        )
        log(f"  transformers generate ({cache} cache): {args.steps / sec:.1f} tok/s")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="eagleray bench gpu")
    ap.add_argument("--models", default="8b,smollm2", help="comma list of 8b, smollm2, tiny")
    ap.add_argument("--smollm2-dir", default=None, help="HF dir with real SmolLM2 weights (default: random)")
    ap.add_argument("--smollm2-gguf", default=None, help="SmolLM2 GGUF file to convert and use (needs gguf)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--extract-batch", type=int, default=16)
    ap.add_argument("--extract-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument(
        "--variants",
        default="graph,eager,graph_generic,engine_eager",
        help="comma list of graph, graph_cublas (batch-1 cuBLAS products), eager, graph_generic, engine_eager",
    )
    ap.add_argument("--skip", default="", help="comma list of decode, extract, hf")
    ap.add_argument("--hf-static", action="store_true", help="also transformers generate with a static cache")
    ap.add_argument("--quick", action="store_true", help="tiny model, short runs (CPU smoke)")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    args.variants = set(args.variants.split(","))
    if args.quick:
        args.models, args.prompt, args.steps, args.extract_batch, args.extract_len = "tiny", 24, 8, 2, 32
        args.batches, args.dtype = "1,3", "fp32"
    return args


def run(argv: list[str]) -> dict:
    args = parse(argv)
    device = pick_device()
    skip = set(filter(None, args.skip.split(",")))
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        command="python -m eagleray.jobs.bench gpu " + " ".join(argv),
    )
    meta.update(ceilings(device))
    log(f"ceilings: {meta}")
    result = dict(meta=meta, decode=[], extraction=[])
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = build_model(name, args, device)
        meta[f"{name}_weights"] = args.smollm2_gguf or args.smollm2_dir if name == "smollm2" else "random"
        if "decode" not in skip:
            for batch in (int(b) for b in args.batches.split(",")):
                result["decode"].extend(decode_case(model, name, batch, args, meta, device))
        if "extract" not in skip:
            result["extraction"].append(extraction_case(model, name, args, meta, device))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "hf" not in skip and name != "tiny" and device.type == "cuda":
            result["decode"].extend(hf_generate(name, args, device))
        write_json(result, args.out)
    print(table(result))
    return result


def table(result: dict) -> str:
    lines = ["| model | B | variant | ms/step | tok/s | roofline tok/s | fraction |", "|---|---|---|---|---|---|---|"]
    for r in result["decode"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['variant']} | {r.get('step_ms', '-')} | {r['tok_per_s']} | "
            f"{r.get('roofline_tok_per_s', '-')} | {r.get('roofline_fraction', '-')} |"
        )
    lines += ["", "| model | batch x len | tok/s | TFLOP/s | FLOP fraction |", "|---|---|---|---|---|"]
    for r in result["extraction"]:
        lines.append(f"| {r['model']} | {r['batch']}x{r['seq_len']} | {r['tok_per_s']} | {r['TFLOPs']} | {r['flop_fraction']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run(sys.argv[1:])
