"""Pieces shared by the chain, reduced-vocabulary and tree verification kernels.

Data flow (one read of the target logits, no probability tensor in HBM):

1. `_row_partials_kernel`, grid (V blocks, rows, B): for every logit row and vocabulary block,
   the block max of the raw logits, the block argmax (greedy rows) or the block sum of
   exp2((l - max) * log2(e) / T) (sampled rows). This is the only full read of the logits.
2. A per-batch-row kernel (chain: `_chain_accept_kernel`; tree: `_tree_walk_kernel`) folds the
   block partials into the row max M, sum S and argmax, decides acceptance from gathered
   scalars (p = exp2((l[d] - M) c) / S, q[d]) and writes the accepted tokens.
3. Sampled rows only: `_recover_partials_kernel` reads ONE logit row per batch row (the row of the
   first rejection, or the bonus row) and the matching draft-prob row, and runs an exponential race
   argmax_i max(p_i - q_i, 0) / E_i, E_i = -log2(u_i) (a sample from norm(max(p - q, 0)) without
   normalising it); `_recover_final_kernel` folds the block winners.

`c = log2(e) / T`; T == 0 marks a greedy row. Padding: a draft token of -1 means "no draft here";
drafts are a prefix of each row (draft_tokens[b, n:] == -1 after n drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from eagleray.kernels.errors import VerifyInputError
from eagleray.kernels.grid import program_range
from eagleray.kernels.launch import interpreting
from eagleray.kernels.rng import ACCEPT_IDX, U_SCALE, rng_base, rng_bits

LOG2E = 1.4426950408889634
# How draft probabilities are given: none (q one-hot at the draft token), full target vocab,
# or over a reduced draft vocab reached through a target->draft index.
Q_NONE, Q_FULL, Q_REDUCED = 0, 1, 2


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes; the benchmark sweeps these on the GPU. batch_block > 1 is for the interpreter."""

    # Defaults: the fastest of the sweep on an H200 (docs/bench/verify-h200.json, "sweep").
    block_v: int = 4096  # vocab elements per program in the full logits pass
    warps: int = 4  # warps per program in the full logits pass
    recover_block_v: int = 2048  # vocab elements per program in the recovery pass
    recover_warps: int = 4
    batch_block: int = 1  # logit rows (pass 1) / batch rows (other passes) per program

    @staticmethod
    def for_interpreter(bsz: int, vocab: int) -> "LaunchConfig":
        """Few, wide programs: the interpreter pays per program, numpy pays per element."""
        bv = triton.next_power_of_2(vocab)
        bb = min(triton.next_power_of_2(bsz), 1024)
        return LaunchConfig(block_v=bv, warps=1, recover_block_v=bv, recover_warps=1, batch_block=bb)


DEFAULT_CONFIG = LaunchConfig()


def pick_config(config: "LaunchConfig | None", bsz: int, vocab: int) -> LaunchConfig:
    if config is not None:
        return config
    return LaunchConfig.for_interpreter(bsz, vocab) if interpreting() else DEFAULT_CONFIG


@triton.jit
def _row_partials_kernel(
    logits_ptr,  # [B, R, V] fp32/bf16/fp16, last stride 1
    draft_ptr,  # [B, R - 1] int64 draft token per row-1 (-1 = padded: row not needed)
    temp_ptr,  # [B] fp32 temperature (0 = greedy)
    pmax_ptr,  # [B, R, NBLK] fp32 block max of the raw logits
    psum_ptr,  # [B, R, NBLK] fp32 block sum of exp2((l - blockmax) * c)   (sampled rows)
    parg_ptr,  # [B, R, NBLK] int32 block argmax, first index                (greedy rows)
    stride_lb,
    stride_lr,
    B,
    R,
    V,
    NBLK,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    blk = tl.program_id(0)
    n, nok = program_range(1, BLOCK_N, B * R)  # [BLOCK_N] each, flattened (b, r)
    b = n // R
    r = n % R
    prev = tl.load(draft_ptr + b * (R - 1) + r - 1, mask=nok & (r > 0), other=0)
    need = nok & (prev >= 0)  # [BLOCK_N] rows past a row's drafts are not read
    t = tl.load(temp_ptr + b, mask=need, other=1.0)  # [BLOCK_N]
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = b.to(tl.int64) * stride_lb + r.to(tl.int64) * stride_lr
    ok = need[:, None] & (offs < V)[None, :]
    x = tl.load(logits_ptr + rows[:, None] + offs[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 1)  # [BLOCK_N]
    out = n * NBLK + blk
    tl.store(pmax_ptr + out, m, mask=need)
    if tl.min(t, 0) == 0.0:
        arg = (blk * BLOCK_V + tl.argmax(x, 1)).to(tl.int32)
        tl.store(parg_ptr + out, arg, mask=need & (t == 0.0))
    if tl.max(tl.where(need, t, 0.0), 0) > 0.0:
        c = 1.4426950408889634 / tl.where(t > 0.0, t, 1.0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp2((x - m_safe[:, None]) * c[:, None]), 1)
        tl.store(psum_ptr + out, s, mask=need & (t > 0.0))


@triton.jit
def _fold_partials(
    pmax_ptr,
    psum_ptr,
    parg_ptr,  # [B, R, NBLK] block partials (see _row_partials_kernel)
    b,
    rows,
    row_ok,
    c,
    R,
    NBLK,  # b [BB], rows [RP], row_ok [BB, RP] bool, c [BB] = log2e / T
    NBP: tl.constexpr,
):
    """Row max M, sum S (of exp2((l - M) c)) and first argmax, each [BB, RP]."""
    blks = tl.arange(0, NBP)[None, None, :]  # [1, 1, NBP]
    ok = row_ok[:, :, None] & (blks < NBLK)  # [BB, RP, NBP]
    offs = (b[:, None, None] * R + rows[None, :, None]) * NBLK + blks
    pm = tl.load(pmax_ptr + offs, mask=ok, other=float("-inf"))  # [BB, RP, NBP]
    mx = tl.max(pm, 2)  # [BB, RP]
    first = tl.min(tl.where(ok & (pm == mx[:, :, None]), blks, NBP), 2)  # [BB, RP]
    pa = tl.load(parg_ptr + offs, mask=ok & (blks == first[:, :, None]), other=0)
    arg = tl.sum(pa, 2)  # [BB, RP]
    ps = tl.load(psum_ptr + offs, mask=ok, other=0.0)  # [BB, RP, NBP]
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    scale = tl.where(ok, tl.exp2((pm - mx_safe[:, :, None]) * c[:, None, None]), 0.0)
    s = tl.sum(tl.where(ok, ps * scale, 0.0), 2)  # [BB, RP]
    return mx, s, arg


@triton.jit
def _recover_partials_kernel(
    logits_ptr,  # [B, R, V] target logits, last stride 1
    q_ptr,  # [B, R - 1, Vq] draft probs (Q_FULL: Vq = V, Q_REDUCED: Vq = Vd), last stride 1
    t2d_ptr,  # [V] int32 target id -> draft id or -1 (Q_REDUCED only)
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    row_ptr,  # [B] int32 row to sample from (first rejection, or the bonus row)
    dtok_ptr,  # [B] int64 the rejected draft token at that row, -1 at the bonus row
    stat_ptr,  # [B, 2] fp32 (M, S) of that row
    best_ptr,  # [B, NBLK] fp32 block best score
    bidx_ptr,  # [B, NBLK] int32 block best index
    stride_lb,
    stride_lr,
    stride_qb,
    stride_qk,
    B,
    V,
    NBLK,
    Q_MODE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    blk = tl.program_id(0)
    b, bok = program_range(1, BLOCK_B, B)  # [BB] each
    t = tl.load(temp_ptr + b, mask=bok, other=0.0)
    live = t > 0.0  # [BB] sampled rows
    if tl.max(live.to(tl.int32), 0) == 0:
        return
    row = tl.load(row_ptr + b, mask=live, other=0).to(tl.int64)
    d = tl.load(dtok_ptr + b, mask=live, other=-1)
    mx = tl.load(stat_ptr + 2 * b, mask=live, other=0.0)
    s = tl.load(stat_ptr + 2 * b + 1, mask=live, other=1.0)
    c = 1.4426950408889634 / tl.where(live, t, 1.0)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = live[:, None] & (offs < V)[None, :]  # [BB, BLOCK_V]
    qmask = mask & (d >= 0)[:, None]  # no q at the bonus row
    lrow = b.to(tl.int64) * stride_lb + row * stride_lr
    x = tl.load(logits_ptr + lrow[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp2((x - mx[:, None]) * c[:, None]) / s[:, None]  # [BB, BLOCK_V]
    qrow = (b.to(tl.int64) * stride_qb + row * stride_qk)[:, None]
    if Q_MODE == 0:
        q = tl.where(offs[None, :] == d[:, None], 1.0, 0.0)
    elif Q_MODE == 1:
        q = tl.load(q_ptr + qrow + offs[None, :], mask=qmask, other=0.0).to(tl.float32)
    else:
        di = tl.load(t2d_ptr + offs, mask=offs < V, other=-1)  # [BLOCK_V] draft id per target id
        q = tl.load(q_ptr + qrow + di[None, :], mask=qmask & (di >= 0)[None, :], other=0.0).to(tl.float32)
    base = rng_base(tl.load(seed_ptr + b, mask=live, other=0), row)  # [BB]
    u = (rng_bits(base[:, None], offs[None, :].to(tl.int64)).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    score = tl.where(mask, tl.maximum(p - q, 0.0) / -tl.log2(u), -1.0)  # [BB, BLOCK_V]
    out = b * NBLK + blk
    tl.store(best_ptr + out, tl.max(score, 1), mask=live)
    tl.store(bidx_ptr + out, (blk * BLOCK_V + tl.argmax(score, 1)).to(tl.int32), mask=live)


@triton.jit
def _recover_final_kernel(
    temp_ptr,  # [B] fp32
    best_ptr,  # [B, NBLK] fp32 block best score
    bidx_ptr,  # [B, NBLK] int32 block best index
    row_ptr,  # [B] int32 output column of the recovered token
    tokens_ptr,  # [B, W] int64 output tokens
    B,
    W,
    NBLK,
    BLOCK_B: tl.constexpr,
    NBP: tl.constexpr,
):
    b, bok = program_range(0, BLOCK_B, B)  # [BB] each
    live = tl.load(temp_ptr + b, mask=bok, other=0.0) > 0.0
    blks = tl.arange(0, NBP)[None, :]
    ok = live[:, None] & (blks < NBLK)  # [BB, NBP]
    sc = tl.load(best_ptr + b[:, None] * NBLK + blks, mask=ok, other=-2.0)
    first = tl.min(tl.where(ok & (sc == tl.max(sc, 1)[:, None]), blks, NBP), 1)  # [BB]
    idx = tl.sum(tl.load(bidx_ptr + b[:, None] * NBLK + blks, mask=ok & (blks == first[:, None]), other=0), 1)
    col = tl.load(row_ptr + b, mask=live, other=0)
    tl.store(tokens_ptr + b * W + col, idx.to(tl.int64), mask=live)


def launch_row_partials(logits, draft, temperature, cfg: LaunchConfig):
    """Pass 1 over all logit rows; returns the block partials (pmax, psum, parg) and NBLK."""
    bsz, rows, vocab = logits.shape
    nblk = triton.cdiv(vocab, cfg.block_v)
    dev = logits.device
    pmax = torch.empty((bsz, rows, nblk), dtype=torch.float32, device=dev)  # [B, R, NBLK]
    psum = torch.empty((bsz, rows, nblk), dtype=torch.float32, device=dev)  # [B, R, NBLK]
    parg = torch.empty((bsz, rows, nblk), dtype=torch.int32, device=dev)  # [B, R, NBLK]
    _row_partials_kernel[(nblk, triton.cdiv(bsz * rows, cfg.batch_block))](
        logits,
        draft,
        temperature,
        pmax,
        psum,
        parg,
        logits.stride(0),
        logits.stride(1),
        bsz,
        rows,
        vocab,
        nblk,
        BLOCK_N=cfg.batch_block,
        BLOCK_V=cfg.block_v,
        num_warps=cfg.warps,
    )
    return (pmax, psum, parg), nblk


def launch_recover(logits, q, t2d, temperature, seed, row, dtok, stat, tokens, q_mode, cfg):
    """Pass 3 (sampled rows): sample the token at column `row[b]` of `tokens`."""
    bsz, _, vocab = logits.shape
    nblk = triton.cdiv(vocab, cfg.recover_block_v)
    best = torch.empty((bsz, nblk), dtype=torch.float32, device=logits.device)  # [B, NBLK]
    bidx = torch.empty((bsz, nblk), dtype=torch.int32, device=logits.device)  # [B, NBLK]
    q_arg = logits if q is None else q
    t2d_arg = row if t2d is None else t2d
    sqb, sqk = (0, 0) if q is None else (q.stride(0), q.stride(1))
    bb = cfg.batch_block
    _recover_partials_kernel[(nblk, triton.cdiv(bsz, bb))](
        logits,
        q_arg,
        t2d_arg,
        temperature,
        seed,
        row,
        dtok,
        stat,
        best,
        bidx,
        logits.stride(0),
        logits.stride(1),
        sqb,
        sqk,
        bsz,
        vocab,
        nblk,
        Q_MODE=q_mode,
        BLOCK_B=bb,
        BLOCK_V=cfg.recover_block_v,
        num_warps=cfg.recover_warps,
    )
    _recover_final_kernel[(triton.cdiv(bsz, bb),)](
        temperature,
        best,
        bidx,
        row,
        tokens,
        bsz,
        tokens.shape[1],
        nblk,
        BLOCK_B=bb,
        NBP=triton.next_power_of_2(nblk),
        num_warps=1,
    )


def _fail(arg: str, expected: str, got: str, fix: str) -> None:
    raise VerifyInputError(arg, expected, got, fix)


def check_tensor(name: str, t, shape: tuple, dtypes: tuple, device, contiguous: bool) -> None:
    """Shape (None = any size), dtype, device and stride checks with a fixable message."""
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__, f"pass {name} as a tensor")
    if t.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, t.shape)):
        want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
        _fail(name, f"shape {want}", f"shape {list(t.shape)}", f"reshape {name} to {want}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        _fail(name, names, str(t.dtype), f"convert with {name}.to({dtypes[0]})")
    if t.device != device:
        _fail(name, f"device {device} (that of target_logits)", str(t.device), f"move {name} to {device}")
    if contiguous and not t.is_contiguous():
        _fail(name, "a contiguous tensor", f"strides {t.stride()}", f"pass {name}.contiguous()")
    if not contiguous and t.stride(-1) != 1:
        _fail(name, "last-dim stride 1", f"strides {t.stride()}", f"pass {name}.contiguous()")


def check_common(target_logits, draft_tokens, temperature, seed) -> tuple[int, int, int]:
    """Checks shared by every entry point; returns (B, R, V) of target_logits."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 3:
        got = getattr(target_logits, "shape", type(target_logits).__name__)
        _fail("target_logits", "a 3-D tensor [B, K+1, V]", str(got), "pass logits as [B, K+1, V]")
    bsz, rows, vocab = target_logits.shape
    dev = target_logits.device
    floats = (torch.float32, torch.bfloat16, torch.float16)
    check_tensor("target_logits", target_logits, (bsz, rows, vocab), floats, dev, False)
    if dev.type != "cuda" and not interpreting():
        _fail(
            "target_logits",
            "a CUDA tensor",
            f"device {dev}",
            "move inputs to the GPU, or set TRITON_INTERPRET=1 before importing triton",
        )
    if rows < 2:
        _fail("target_logits", "at least 2 rows per batch entry (K >= 1 drafts + bonus)", f"{rows}", "pass K+1 rows")
    check_tensor("draft_tokens", draft_tokens, (bsz, rows - 1), (torch.int64,), dev, True)
    check_tensor("temperature", temperature, (bsz,), (torch.float32,), dev, True)
    check_tensor("seed", seed, (bsz,), (torch.int64,), dev, True)
    return bsz, rows, vocab


__all__ = [
    "ACCEPT_IDX",
    "DEFAULT_CONFIG",
    "LOG2E",
    "LaunchConfig",
    "Q_FULL",
    "Q_NONE",
    "Q_REDUCED",
    "U_SCALE",
    "check_common",
    "check_tensor",
    "launch_recover",
    "launch_row_partials",
    "pick_config",
]
