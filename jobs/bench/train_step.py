"""Benchmark suite `train`: EAGLE-3 training throughput (TTT optimiser steps) of a SmolLM2-shaped and
a Llama-3.1-8B-shaped draft, on synthetic batches already on the device.

Run: `python -m eagleray.jobs.bench train [--models smollm2,8b] [--batch 8] [--seq-len 2048] [--out train.json]`
(see --help; ``--quick`` is a tiny CPU smoke run).

- draft: built from the target's CONFIG only (no target weights): :func:`eagleray.training.build.new_draft`
  (draft vocab ``--draft-vocab`` capped at the target vocab, aux layers 2, N//2, N-3, lm_head from the
  target head's rows) and :func:`~eagleray.training.build.draft_module` (fp32 parameters), wrapped in
  :class:`~eagleray.training.ttt.TTTModel` with a random fp32 target embedding and lm_head [V, H]
  (one tensor when the target ties them; TTTModel keeps its own copies, as in training).
- optimiser and step: :func:`eagleray.training.loop.make_optimizer` and
  :func:`eagleray.training.loop.train_step`, the functions the trainer runs (AdamW, bf16 autocast on
  CUDA, grad clip 0.5, warmup+cosine schedule). Not timed: the host-to-device batch copy, the
  metric meter and logging of the trainer's loop.
- batch: random token ids [B, T], loss mask all ones, aux states [B, T, n_aux*H] and final hidden
  states [B, T, H] N(0, 1) in ``--input-dtype`` (fp32 default: what ``training.data.collate`` yields).
- timing: ``--warmup`` untimed steps, then ``--steps`` steps, each between CUDA events (perf_counter
  on CPU); train_step ends with a host sync (the grad norm as a float), so steps do not overlap.
- tokens/s = B * T / (median step seconds): input positions (slots) per second, each trained through
  ``ttt_steps`` unrolled draft steps; this is the trainer's ``tokens_per_s`` (loss-mask tokens) with
  an all-ones mask.
- model FLOP/s fraction = model FLOPs per step / median step seconds / (``--peak-tflops`` * 1e12), with
  (k = ttt_steps, Hq heads of dim D, V target vocab, H hidden)::

      FLOPs = 6 * B*T * (P_fc + k * (P_layer + P_lm_head))     # draft matmuls, forward + backward
            + 3 * k * 4 * B * T^2 * Hq * D                     # step-0 scores and values (full T x T
                                                               #   product, as computed), fwd + bwd, every step
            + 2 * B*T * V * H                                  # frozen target logits (soft labels), forward only

  P_fc (fc, run once per slot), P_layer (the decoder layer and final norm) and P_lm_head (draft
  vocab x H) are trainable parameter counts; the peak default 989 TFLOP/s is the H200's dense bf16.
- peak memory: ``torch.cuda.max_memory_allocated`` from before the model is built to the last step;
  ``static_memory_GiB``: allocated after building the model, the target tensors and the batch (no optimiser state yet).
  A case that runs out of memory is recorded with its ``error`` and the next model still runs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import pathlib
import statistics
import sys
import time

import torch

from eagleray.jobs.bench.common import CONFIGS as COMMON_CONFIGS
from eagleray.jobs.bench.common import TINY, log, step_times, write_json
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import TrainingConfig
from eagleray.platform.host import pick_device
from eagleray.training.build import draft_module, new_draft
from eagleray.training.loop import make_optimizer, train_step, use_bf16
from eagleray.training.ttt import TTTBatch, TTTModel

CONFIGS = dict(COMMON_CONFIGS, tiny=dict(TINY, num_hidden_layers=8))
FLOP_FORMULA = (
    "6*B*T*(P_fc + k*(P_layer + P_lm_head)) + 3*k*4*B*T^2*Hq*D + 2*B*T*V*H "
    "(draft matmuls fwd+bwd; step-0 attention as a full TxT product at each of k steps, fwd+bwd; "
    "frozen target logits fwd)"
)
TOKENS = "B*T input positions per step (each trained through ttt_steps unrolled steps) / median step seconds"


def target_config(name: str, args) -> dict:
    if name == "smollm2" and args.smollm2_dir:
        return dict(TargetSpec.from_dir(args.smollm2_dir).config)
    return dict(CONFIGS[name])


def build(name: str, args, device: torch.device) -> tuple[TTTModel, TargetSpec, list[int]]:
    """The TTT model for target ``name``: random target embedding/head, a fresh draft from the config."""
    spec = TargetSpec(path=pathlib.Path(f"<synthetic {name}>"), config=target_config(name, args))
    aux_ids = spec.default_aux_layer_ids  # 2, N//2, N-3
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (spec.vocab_size, spec.hidden_size)
    embed = torch.randn(shape, device=device, generator=gen) * 0.02  # [V, H] fp32, as target_embed_and_head
    tied = bool(spec.config.get("tie_word_embeddings", False))
    head = embed if tied else torch.randn(shape, device=device, generator=gen) * 0.02  # [V, H]
    init = new_draft(spec, None, args.draft_vocab, aux_layer_ids=aux_ids, seed=args.seed, target_head=head)
    draft = draft_module(init, device)
    model = TTTModel(draft, embed, head, init.t2d, args.ttt_steps, args.loss_decay).to(device)
    del embed, head, init
    return model, spec, aux_ids


def synthetic_batch(b: int, t: int, n_aux: int, h: int, vocab: int, dtype: torch.dtype, device, seed: int) -> TTTBatch:
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (b, t), device=device, generator=gen)  # [B, T]
    mask = torch.ones(b, t, device=device)  # [B, T]
    aux = torch.randn(b, t, n_aux * h, device=device, generator=gen).to(dtype)  # [B, T, n_aux*H]
    final = torch.randn(b, t, h, device=device, generator=gen).to(dtype)  # [B, T, H]
    return TTTBatch(ids, mask, aux, final)


def param_counts(model: TTTModel) -> dict[str, int]:
    d = model.draft
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fc, head = d.fc.weight.numel(), d.lm_head.weight.numel()
    return dict(trainable=trainable, fc=fc, lm_head=head, layer=trainable - fc - head)


def model_flops(model: TTTModel, params: dict[str, int], b: int, t: int) -> dict[str, float]:
    """Model FLOPs of one optimiser step (formula in the module doc / FLOP_FORMULA)."""
    k = min(model.ttt_steps, t - 1)
    attn = model.draft.midlayer.self_attn
    v, h = model.target_head.shape
    parts = dict(
        draft_matmuls=6.0 * b * t * (params["fc"] + k * (params["layer"] + params["lm_head"])),
        attention=3.0 * k * 4 * b * t * t * attn.heads * attn.head_dim,
        target_logits=2.0 * b * t * v * h,
    )
    return {**parts, "total": sum(parts.values())}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def case(name: str, args, device: torch.device) -> dict:
    """Build, warm up and time one model; the record of the result table."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, spec, aux_ids = build(name, args, device)
    b, t = args.batch, args.seq_len
    batch = synthetic_batch(b, t, len(aux_ids), spec.hidden_size, spec.vocab_size, args.input_dtype, device, args.seed)
    cfg = TrainingConfig(
        data_dir="synthetic",
        output_dir="unused",
        ttt_steps=args.ttt_steps,
        loss_decay=args.loss_decay,
        max_steps=args.warmup + args.steps,
        batch_size=b,
        max_seq_len=max(16, t),
        autocast=args.autocast,
        draft_vocab_size=args.draft_vocab,
    )  # optimiser defaults of training
    opt, sched = make_optimizer(model, cfg)
    amp = use_bf16(cfg, device)
    static_bytes = torch.cuda.memory_allocated(device) if cuda else None
    build_s = time.perf_counter() - t0
    state: dict = {}

    def step():
        state["out"], state["grad_norm"], state["lr"] = train_step(model, batch, opt, sched, amp, cfg.grad_clip)

    losses = []
    for _ in range(args.warmup):
        step()
        losses.append(float(state["out"].loss.detach()))
    times = step_times(step, args.steps, device)
    loss = float(state["out"].loss.detach())
    sec = statistics.median(times)
    params = param_counts(model)
    flops = model_flops(model, params, b, t)
    peak = args.peak_tflops * 1e12
    rec = dict(
        model=name,
        batch=b,
        seq_len=t,
        ttt_steps=model.ttt_steps,
        draft_vocab=model.draft.draft_vocab_size,
        target_vocab=spec.vocab_size,
        hidden=spec.hidden_size,
        aux_layer_ids=aux_ids,
        autocast_bf16=amp,
        input_dtype=str(args.input_dtype).replace("torch.", ""),
        warmup_steps=args.warmup,
        timed_steps=len(times),
        step_ms=round(sec * 1e3, 3),
        step_ms_mean=round(statistics.fmean(times) * 1e3, 3),
        step_ms_min=round(min(times) * 1e3, 3),
        step_ms_max=round(max(times) * 1e3, 3),
        tokens_per_s=round(b * t / sec, 1),
        params=params,
        model_flops_per_step={k: _sig(v) for k, v in flops.items()},
        model_TFLOPs=_sig(flops["total"] / sec / 1e12),
        flop_fraction=_sig(flops["total"] / sec / peak),
        peak_memory_GiB=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        static_memory_GiB=round(static_bytes / 2**30, 2) if cuda else None,
        loss_first=losses[0] if losses else None,
        loss_last=loss,
        grad_norm_last=state["grad_norm"],
        build_s=round(build_s, 2),
    )
    log(
        f"  {name:8s} B={b} T={t} k={model.ttt_steps}: {rec['step_ms']:.1f} ms/step, {rec['tokens_per_s']:,.0f} tok/s, "
        f"{rec['model_TFLOPs']} TFLOP/s ({rec['flop_fraction']:.1%} of {args.peak_tflops}), "
        f"peak {rec['peak_memory_GiB'] or '-'} GiB, loss {loss:.3f}"
    )
    return rec


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="eagleray bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,8b", help="comma list of smollm2, 8b, tiny")
    ap.add_argument("--smollm2-dir", default=None, help="read the SmolLM2 config from this HF dir (weights unused)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--loss-decay", type=float, default=0.8)
    ap.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (capped at the target's)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--autocast", default="auto", choices=["auto", "bf16", "off"], help="as training.autocast")
    ap.add_argument(
        "--input-dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="dtype of the aux/final hidden states in the batch (collate yields fp32)",
    )
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for the FLOP fraction (H200: 989)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--quick", action="store_true", help="tiny target, tiny batch, few steps (CPU smoke)")
    ap.add_argument("--out", "--json", dest="out", type=pathlib.Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.batch, args.seq_len, args.warmup, args.steps, args.draft_vocab = "tiny", 2, 32, 1, 2, 128
    args.input_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.input_dtype]
    return args


def run(argv: list[str]) -> dict:
    args = parse(argv)
    device = pick_device(args.device or "auto", "--device")
    meta = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        command="python -m eagleray.jobs.bench train " + " ".join(argv),
        peak_tflops=args.peak_tflops,
        flop_formula=FLOP_FORMULA,
        tokens=TOKENS,
        timed="eagleray.training.loop.train_step on a batch already on the device (no H2D copy, meter, logging)",
    )
    log(
        f"bench train on {meta['device']}: models {args.models}, batch {args.batch} x {args.seq_len}, "
        f"ttt_steps {args.ttt_steps}, {args.warmup} warm-up + {args.steps} timed steps"
    )
    result = dict(meta=meta, train=[])
    for name in args.models.split(","):
        try:
            result["train"].append(case(name, args, device))
        except torch.cuda.OutOfMemoryError as err:
            msg = str(err).split("\n")[0]
            log(f"  {name}: out of memory at batch {args.batch} x {args.seq_len} ({msg}); try a smaller --batch")
            result["train"].append(dict(model=name, batch=args.batch, seq_len=args.seq_len, error=f"out of memory: {msg}"))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_json(result, args.out)
    print(table(result))
    return result


def table(result: dict) -> str:
    lines = [
        "| model | B x T | k | draft params (M) | ms/step | tokens/s | model TFLOP/s | FLOP fraction | peak GiB | loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["train"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']}x{r['seq_len']} | - | - | - | - | - | - | - | {r['error']} |")
            continue
        lines.append(
            f"| {r['model']} | {r['batch']}x{r['seq_len']} | {r['ttt_steps']} | {r['params']['trainable'] / 1e6:.1f} | "
            f"{r['step_ms']} | {r['tokens_per_s']:,.0f} | {r['model_TFLOPs']} | {r['flop_fraction']} | "
            f"{'-' if r['peak_memory_GiB'] is None else r['peak_memory_GiB']} | {r['loss_last']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    run(sys.argv[1:])
