"""Chain verification: PyTorch reference, Triton kernels, checked wrapper.

Semantics (both implementations, bit-for-bit the same random draws, see `kernels/rng.py`):

- Row b has n_b drafts: draft_tokens[b, :n_b] >= 0, draft_tokens[b, n_b:] == -1 (padding).
- Greedy row (temperature[b] == 0): accept draft j while it equals argmax(target_logits[b, j]) (first
  index on ties); the token after the accepted prefix is that argmax.
- Sampled row: p_j = softmax(target_logits[b, j] / T). Draft j is accepted iff
  u_j * q_j(d_j) < p_j(d_j), u_j = uniform(seed, j, ACCEPT_IDX) (i.e. with probability
  min(1, p/q)). At the first rejection j* the token is argmax_i max(p_i - q_i, 0) / E_i with
  E_i = -log2(uniform(seed, j*, i)) - an exponential race, i.e. a sample of norm(max(p - q, 0)).
  When all n_b drafts are accepted the bonus token is drawn the same way from p_{n_b} (q = 0).
  draft_probs=None means q_j is one-hot at d_j.
- Output: tokens [B, K+1] = accepted drafts, then the recovered/bonus token, then -1;
  num_accepted [B] = number of accepted drafts.

Seeds: the draws depend only on (seed[b], position, index), so the caller must vary seed per
engine step (e.g. hash of request seed and step) to get fresh randomness.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eagleray.kernels import cpu_decode
from eagleray.kernels.grid import program_range
from eagleray.kernels.rng import ACCEPT_IDX, rng_base, rng_bits, torch_uniform
from eagleray.kernels.verify_common import (
    LOG2E,
    Q_FULL,
    Q_NONE,
    Q_REDUCED,
    LaunchConfig,
    _fold_partials,
    check_common,
    check_tensor,
    launch_recover,
    launch_row_partials,
    pick_config,
)


def _first_false(ok: torch.Tensor) -> torch.Tensor:
    """Index of the first False along the last dim of a bool [B, K+1] whose last column is False."""
    return (~ok).to(torch.int64).argmax(-1)


def verify_chain_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy (T = 0): target_logits [B, K+1, V], draft_tokens [B, K] (-1 padding) -> tokens [B, K+1]
    (padded -1), num_accepted [B]; what :func:`verify_chain_reference` returns at temperature 0, from one argmax
    per row (no softmax, no random draws)."""
    arg = cpu_decode.argmax_last(target_logits)  # [B, K+1] (the native kernel on CPU fp32)
    if arg.device.type == "cpu":
        return accept_greedy_host(arg, draft_tokens)
    return accept_greedy(arg, draft_tokens)


def accept_greedy(arg: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's argmax [B, K+1] against the drafts [B, K] (-1 padding) -> tokens [B, K+1], num_accepted [B]
    as tensor ops on the tensors' device (no host read: a CUDA graph captures it)."""
    k = d.shape[1]
    acc = torch.cat([(d >= 0) & (d == arg[:, :k]), torch.zeros_like(d[:, :1], dtype=torch.bool)], 1)  # [B, K+1]
    jstar = _first_false(acc)  # [B]
    cols = torch.arange(k + 1, device=d.device)[None, :]
    padded = torch.cat([d, torch.full_like(d[:, :1], -1)], 1)  # [B, K+1]
    tokens = torch.where(cols < jstar[:, None], padded, torch.full_like(padded, -1))
    b_idx = torch.arange(d.shape[0], device=d.device)
    tokens[b_idx, jstar] = arg[b_idx, jstar]
    return tokens, jstar


def accept_greedy_host(arg: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_greedy` on the host, for CPU tensors: a loop over the B x K ints instead of ten small tensor
    ops, each of which may start a parallel region that wakes the engine's other OpenMP thread (on the 2-core CPU
    the batch-1 k=2 verification took 0.40 ms in the engine against 0.07 for its argmax)."""
    tokens, nacc = [], []
    for a, row in zip(arg.tolist(), d.tolist()):
        j = 0
        while j < len(row) and row[j] == a[j]:  # padding (-1) never equals an argmax: the prefix stops there
            j += 1
        tokens.append(row[:j] + [a[j]] + [-1] * (len(row) - j))
        nacc.append(j)
    k1 = d.shape[1] + 1
    out = torch.tensor(tokens, dtype=d.dtype).reshape(-1, k1)  # [B, K+1] (reshape: B = 0 too)
    return out, torch.tensor(nacc, dtype=torch.int64)


def verify_chain_reference(target_logits, draft_tokens, draft_probs=None, *, temperature, seed):
    """Plain PyTorch reference (materialises softmax); draft_probs is [B, K, V] or None."""
    logits = target_logits.float()  # [B, K+1, V]
    bsz, rows, vocab = logits.shape
    k = rows - 1
    greedy = temperature == 0  # [B]
    c = LOG2E / torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    mx = logits.max(-1).values  # [B, K+1]
    arg = logits.argmax(-1)  # [B, K+1]
    e = torch.exp2((logits - mx[..., None]) * c[:, None, None])  # [B, K+1, V]
    s = e.sum(-1)  # [B, K+1]
    d = draft_tokens  # [B, K]
    dsafe = d.clamp(min=0)
    pos = torch.arange(k, device=d.device)
    p_d = torch.exp2((logits[:, :k].gather(-1, dsafe[..., None])[..., 0] - mx[:, :k]) * c[:, None]) / s[:, :k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(-1, dsafe[..., None])[..., 0]
    u = torch_uniform(seed[:, None], pos[None, :], torch.tensor(ACCEPT_IDX, device=d.device))  # [B, K]
    acc = (d >= 0) & torch.where(greedy[:, None], d == arg[:, :k], u * q_d < p_d)  # [B, K]
    acc = torch.cat([acc, torch.zeros_like(acc[:, :1])], 1)  # [B, K+1]
    jstar = _first_false(acc)  # [B]
    b_idx = torch.arange(bsz, device=d.device)
    d_star = torch.cat([d, torch.full_like(d[:, :1], -1)], 1)[b_idx, jstar]  # [B], -1 = bonus
    p_row = e[b_idx, jstar] / s[b_idx, jstar, None]  # [B, V]
    vids = torch.arange(vocab, device=d.device)
    if draft_probs is None:
        q_row = (vids[None, :] == d_star[:, None]).float()
    else:
        q_row = draft_probs.float()[b_idx, jstar.clamp(max=k - 1)] * (d_star >= 0)[:, None].float()
    u_row = torch_uniform(seed[:, None], jstar[:, None], vids[None, :])  # [B, V]
    sampled = (torch.clamp(p_row - q_row, min=0.0) / -torch.log2(u_row)).argmax(-1)  # [B]
    final = torch.where(greedy, arg[b_idx, jstar], sampled)
    cols = torch.arange(rows, device=d.device)[None, :]
    padded = torch.cat([d, torch.full_like(d[:, :1], -1)], 1)
    tokens = torch.where(cols < jstar[:, None], padded, torch.full_like(padded, -1))
    tokens[b_idx, jstar] = final
    return tokens, jstar


@triton.jit
def _chain_accept_kernel(
    logits_ptr,  # [B, K+1, V] target logits, last stride 1
    draft_ptr,  # [B, K] int64 draft tokens (-1 = padding)
    q_ptr,  # [B, K, Vq] draft probs (Q_FULL: Vq = V; Q_REDUCED: Vq = Vd), last stride 1
    t2d_ptr,  # [V] int32 target id -> draft id or -1 (Q_REDUCED only)
    temp_ptr,  # [B] fp32 temperature (0 = greedy)
    seed_ptr,  # [B] int64 seed
    pmax_ptr,
    psum_ptr,
    parg_ptr,  # [B, K+1, NBLK] block partials of pass 1
    tokens_ptr,  # [B, K+1] int64 out: accepted drafts, recovered/bonus (greedy only here), -1
    nacc_ptr,  # [B] int64 out: number of accepted drafts
    row_ptr,  # [B] int32 out: row of the first rejection / bonus
    dtok_ptr,  # [B] int64 out: rejected draft token at that row, -1 for the bonus
    stat_ptr,  # [B, 2] fp32 out: (M, S) of that row
    stride_lb,
    stride_lr,
    stride_qb,
    stride_qk,
    B,
    K,
    NBLK,
    Q_MODE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    KP: tl.constexpr,
    NBP: tl.constexpr,
):
    b, bok = program_range(0, BLOCK_B, B)  # [BB] each
    j = tl.arange(0, KP)[None, :]  # [1, KP] positions
    d = tl.load(draft_ptr + b[:, None] * K + j, mask=bok[:, None] & (j < K), other=-1)  # [BB, KP]
    n_b = tl.min(tl.where(d < 0, j, KP), 1)  # [BB] drafts in the row
    t = tl.load(temp_ptr + b, mask=bok, other=0.0)
    greedy = (t == 0.0)[:, None]  # [BB, 1]
    c = 1.4426950408889634 / tl.where(t == 0.0, 1.0, t)  # [BB]
    row_ok = bok[:, None] & (j <= n_b[:, None])
    mx, s, arg = _fold_partials(pmax_ptr, psum_ptr, parg_ptr, b, tl.arange(0, KP), row_ok, c, K + 1, NBLK, NBP)  # [BB, KP] each
    dsafe = tl.maximum(d, 0)
    lrow = b.to(tl.int64)[:, None] * stride_lb + j.to(tl.int64) * stride_lr
    l_d = tl.load(logits_ptr + lrow + dsafe, mask=d >= 0, other=0.0).to(tl.float32)  # [BB, KP]
    p_d = tl.exp2((l_d - mx) * c[:, None]) / tl.where(s > 0.0, s, 1.0)
    qrow = b.to(tl.int64)[:, None] * stride_qb + j.to(tl.int64) * stride_qk
    if Q_MODE == 0:
        q_d = tl.where(d >= 0, 1.0, 0.0)
    elif Q_MODE == 1:
        q_d = tl.load(q_ptr + qrow + dsafe, mask=d >= 0, other=0.0).to(tl.float32)
    else:
        di = tl.load(t2d_ptr + dsafe, mask=d >= 0, other=-1)  # [BB, KP] draft-vocab id
        q_d = tl.load(q_ptr + qrow + di, mask=di >= 0, other=0.0).to(tl.float32)
    seed = tl.load(seed_ptr + b, mask=bok, other=0)
    base = rng_base(seed[:, None], j.to(tl.int64))  # [BB, KP]
    u = (rng_bits(base, 2147483647).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    acc = (d >= 0) & tl.where(greedy, d == arg, u * q_d < p_d)  # [BB, KP]
    jstar = tl.min(tl.where(acc, KP, j), 1)  # [BB] first rejection (or n_b: bonus)
    at = j == jstar[:, None]
    tok = tl.where(j < jstar[:, None], d, tl.where(at & greedy, arg, -1))
    tl.store(tokens_ptr + b[:, None] * (K + 1) + j, tok, mask=bok[:, None] & (j <= K))
    tl.store(nacc_ptr + b, jstar.to(tl.int64), mask=bok)
    tl.store(row_ptr + b, jstar.to(tl.int32), mask=bok)
    tl.store(dtok_ptr + b, tl.sum(tl.where(at, d, 0), 1), mask=bok)
    tl.store(stat_ptr + 2 * b, tl.sum(tl.where(at, mx, 0.0), 1), mask=bok)
    tl.store(stat_ptr + 2 * b + 1, tl.sum(tl.where(at, s, 0.0), 1), mask=bok)


def launch_chain(logits, draft_tokens, q, t2d, temperature, seed, q_mode, cfg: LaunchConfig, all_greedy: bool = False):
    """Launch the chain kernels on already-checked inputs; returns (tokens, num_accepted)."""
    bsz, rows, _ = logits.shape
    dev = logits.device
    partials, nblk = launch_row_partials(logits, draft_tokens, temperature, cfg)
    tokens = torch.empty((bsz, rows), dtype=torch.int64, device=dev)  # [B, K+1]
    nacc = torch.empty((bsz,), dtype=torch.int64, device=dev)  # [B]
    row = torch.empty((bsz,), dtype=torch.int32, device=dev)  # [B]
    dtok = torch.empty((bsz,), dtype=torch.int64, device=dev)  # [B]
    stat = torch.empty((bsz, 2), dtype=torch.float32, device=dev)  # [B, 2]
    q_arg = logits if q is None else q
    t2d_arg = draft_tokens if t2d is None else t2d
    sqb, sqk = (0, 0) if q is None else (q.stride(0), q.stride(1))
    bb = cfg.batch_block
    _chain_accept_kernel[(triton.cdiv(bsz, bb),)](
        logits,
        draft_tokens,
        q_arg,
        t2d_arg,
        temperature,
        seed,
        *partials,
        tokens,
        nacc,
        row,
        dtok,
        stat,
        logits.stride(0),
        logits.stride(1),
        sqb,
        sqk,
        bsz,
        rows - 1,
        nblk,
        Q_MODE=q_mode,
        BLOCK_B=bb,
        KP=triton.next_power_of_2(rows),
        NBP=triton.next_power_of_2(nblk),
        num_warps=4,
    )
    if not all_greedy:
        launch_recover(logits, q, t2d, temperature, seed, row, dtok, stat, tokens, q_mode, cfg)
    return tokens, nacc


def verify_chain(
    target_logits,
    draft_tokens,
    draft_probs=None,
    *,
    temperature,
    seed,
    all_greedy: bool = False,
    config: LaunchConfig | None = None,
):
    """Fused chain verification: logits in, tokens out. See the module docstring for semantics.

    target_logits [B, K+1, V] fp32/bf16/fp16 (last stride 1), draft_tokens [B, K] int64
    (-1 = padding), draft_probs [B, K, V] fp32/bf16/fp16 or None, temperature [B] fp32
    (0 = greedy), seed [B] int64. all_greedy=True (a promise that temperature is all zero) skips
    the sampling launches. Returns (tokens [B, K+1] int64, num_accepted [B] int64).
    """
    bsz, rows, vocab = check_common(target_logits, draft_tokens, temperature, seed)
    if draft_probs is not None:
        floats = (torch.float32, torch.bfloat16, torch.float16)
        check_tensor("draft_probs", draft_probs, (bsz, rows - 1, vocab), floats, target_logits.device, False)
    q_mode = Q_NONE if draft_probs is None else Q_FULL
    return launch_chain(
        target_logits, draft_tokens, draft_probs, None, temperature, seed, q_mode, pick_config(config, bsz, vocab), all_greedy
    )


__all__ = ["Q_REDUCED", "launch_chain", "verify_chain", "verify_chain_reference"]
