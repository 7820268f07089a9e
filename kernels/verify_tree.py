"""Tree verification for EAGLE top-k draft trees: PyTorch reference, Triton kernels, wrapper.

Tree: N draft nodes per batch row, `parents[b, i]` in {-1 (root), 0..i-1} (topological order),
`draft_tokens[b, i]` the node's token (-1 = padded node, with no children). Logit row 0 is the
target's distribution after the root (the last verified token); row i + 1 is the distribution after
node i. Children of a node are tried in index order.

Rule (documented choice): recursive rejection sampling over siblings with q one-hot at each child
(EAGLE top-k trees choose children deterministically, so q is a point mass; SGLang's
`tree_speculative_sampling_target_only` makes the same choice). At a node with target p, rejected
sibling mass m (initially 0): child x is accepted iff u * (1 - m) < p(x) (probability
p(x) / (1 - m) = norm(p with rejected siblings removed)(x)); a child repeating an already rejected
token is rejected; on rejection m += p(x), i.e. p <- norm(max(p - onehot(x), 0)). If every child is
rejected the token is an exponential-race sample from p without the rejected tokens. This is
sampling without replacement, so each output token is distributed exactly as the target p.
Greedy rows: follow the first child equal to argmax(p); the last token is that argmax.
u = uniform(seed, i + 1, ACCEPT_IDX) for node i; the final draw uses uniform(seed, row, vocab id).

Cost: the logits are read once (shared pass 1); the walk is O(depth * N^2) scalar work per row.
Returns (tokens [B, N+1], num_accepted [B], path [B, N] accepted node ids, -1 padded).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from eagleray.kernels.grid import program_range
from eagleray.kernels.rng import ACCEPT_IDX, rng_base, rng_bits, torch_uniform
from eagleray.kernels.verify_common import (
    LOG2E,
    LaunchConfig,
    _fold_partials,
    _recover_final_kernel,
    check_common,
    check_tensor,
    launch_row_partials,
    pick_config,
)


def _reference_row(par, tok, probs, arg, u_acc, e_row, greedy):
    """Walk one batch row (python lists / float32 numpy); returns (tokens, path)."""
    node, row, toks, path = -1, 0, [], []
    while True:
        kids = [i for i in range(len(par)) if par[i] == node and tok[i] >= 0]
        removed, rejected, found = np.float32(0.0), [], -1
        for i in kids:
            if greedy:
                ok = tok[i] == arg[row]
            else:
                p_x = probs[row][tok[i]]
                ok = tok[i] not in rejected and u_acc[i] * (np.float32(1.0) - removed) < p_x
                if not ok and tok[i] not in rejected:
                    removed = np.float32(removed + p_x)
                    rejected.append(tok[i])
            if ok:
                found = i
                break
        if found < 0:
            break
        toks.append(tok[found])
        path.append(found)
        node, row = found, found + 1
    if greedy:
        toks.append(int(arg[row]))
    else:
        p = torch.from_numpy(probs[row].copy())
        p[[tok[i] for i in kids]] = 0.0
        toks.append(int((p / e_row[row]).argmax()))
    return toks, path


def verify_tree_greedy_host(arg: list[int], draft_tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """One greedy tree on the host: the target's argmax of each logit row ``arg`` [N+1] (row 0 = the root's), node
    tokens [N] (-1 = padded) and parents [N] (-1 = root) as ints -> (tokens: the accepted nodes' then the final argmax,
    path: the accepted node ids). What :func:`verify_tree_reference` returns for a row at temperature 0, without its
    softmax and random draws over the vocabulary (12.8 ms of a CPU tree step at batch 1, this walk ~0.1 ms)."""
    node, row, toks, path = -1, 0, [], []
    while True:
        found = next((i for i, (p, t) in enumerate(zip(parents, draft_tokens)) if p == node and t >= 0 and t == arg[row]), -1)
        if found < 0:
            toks.append(arg[row])
            return toks, path
        toks.append(draft_tokens[found])
        path.append(found)
        node, row = found, found + 1


def verify_tree_reference(target_logits, draft_tokens, parents, *, temperature, seed):
    """PyTorch/numpy reference with the kernel's float32 arithmetic and random draws."""
    logits = target_logits.float()  # [B, N+1, V]
    bsz, rows, vocab = logits.shape
    n = rows - 1
    greedy = temperature == 0
    c = LOG2E / torch.where(greedy, torch.ones_like(temperature), temperature)  # [B]
    mx = logits.max(-1).values  # [B, N+1]
    e = torch.exp2((logits - mx[..., None]) * c[:, None, None])  # [B, N+1, V]
    probs = (e / e.sum(-1, keepdim=True)).cpu().numpy()
    arg = logits.argmax(-1).cpu().tolist()
    dev = logits.device
    u_acc = torch_uniform(seed[:, None], torch.arange(1, n + 1, device=dev)[None], torch.tensor(ACCEPT_IDX))
    u_acc = u_acc.cpu().numpy()  # [B, N] float32
    u_v = torch_uniform(
        seed[:, None, None], torch.arange(rows, device=dev)[None, :, None], torch.arange(vocab, device=dev)[None, None, :]
    )
    e_v = (-torch.log2(u_v)).cpu()  # [B, N+1, V]
    tokens = torch.full((bsz, rows), -1, dtype=torch.int64)
    path = torch.full((bsz, n), -1, dtype=torch.int64)
    nacc = torch.zeros(bsz, dtype=torch.int64)
    par, tok = parents.cpu().tolist(), draft_tokens.cpu().tolist()
    for b in range(bsz):
        toks, pth = _reference_row(par[b], tok[b], probs[b], arg[b], u_acc[b], e_v[b], bool(greedy[b]))
        tokens[b, : len(toks)] = torch.tensor(toks)
        path[b, : len(pth)] = torch.tensor(pth, dtype=torch.int64)
        nacc[b] = len(pth)
    return tokens.to(dev), nacc.to(dev), path.to(dev)


@triton.jit
def _tree_walk_kernel(
    logits_ptr,  # [B, N+1, V] target logits, last stride 1
    draft_ptr,  # [B, N] int64 node tokens (-1 = padded node)
    parent_ptr,  # [B, N] int64 parent node (-1 = root)
    temp_ptr,  # [B] fp32 temperature (0 = greedy)
    seed_ptr,  # [B] int64
    pmax_ptr,
    psum_ptr,
    parg_ptr,  # [B, N+1, NBLK] block partials of pass 1
    tokens_ptr,  # [B, N+1] int64 out (pre-filled with -1): accepted tokens, final (greedy)
    path_ptr,  # [B, N] int64 out (pre-filled with -1): accepted node ids
    nacc_ptr,  # [B] int64 out: accepted drafts
    frow_ptr,  # [B] int32 out: logit row of the final token
    fnode_ptr,  # [B] int64 out: node whose children were all rejected (-1 = root)
    stat_ptr,  # [B, 2] fp32 out: (M, S) of the final row
    stride_lb,
    stride_lr,
    B,
    N,
    NBLK,
    BLOCK_B: tl.constexpr,
    RP: tl.constexpr,
    NBP: tl.constexpr,
):
    b, bok = program_range(0, BLOCK_B, B)  # [BB] each
    t = tl.load(temp_ptr + b, mask=bok, other=0.0)
    greedy = t == 0.0
    c = 1.4426950408889634 / tl.where(greedy, 1.0, t)
    rr = tl.arange(0, RP)[None, :]  # [1, RP] logit rows
    prev = tl.load(draft_ptr + b[:, None] * N + rr - 1, mask=bok[:, None] & (rr > 0) & (rr <= N), other=0)
    row_ok = bok[:, None] & (rr <= N) & (prev >= 0)
    mx, s, arg = _fold_partials(pmax_ptr, psum_ptr, parg_ptr, b, tl.arange(0, RP), row_ok, c, N + 1, NBLK, NBP)
    seed = tl.load(seed_ptr + b, mask=bok, other=0)
    node = tl.full([BLOCK_B], -1, tl.int64)
    row = tl.zeros([BLOCK_B], tl.int32)
    depth = tl.zeros([BLOCK_B], tl.int32)
    live = bok
    while tl.max(live.to(tl.int32), 0) > 0:
        m_row = tl.sum(tl.where(rr == row[:, None], mx, 0.0), 1)  # [BB] stats of the current row
        s_row = tl.sum(tl.where(rr == row[:, None], s, 0.0), 1)
        a_row = tl.sum(tl.where(rr == row[:, None], arg, 0), 1)
        lrow = b.to(tl.int64) * stride_lb + row.to(tl.int64) * stride_lr
        removed = tl.zeros([BLOCK_B], tl.float32)
        found = tl.full([BLOCK_B], -1, tl.int64)
        for ch in range(0, N):
            par = tl.load(parent_ptr + b * N + ch, mask=live, other=-2)
            tk = tl.load(draft_ptr + b * N + ch, mask=live, other=-1)
            kid = live & (par == node) & (found < 0) & (tk >= 0)
            dup = tl.zeros([BLOCK_B], tl.int1)
            for ch2 in range(0, ch):
                par2 = tl.load(parent_ptr + b * N + ch2, mask=kid, other=-2)
                tk2 = tl.load(draft_ptr + b * N + ch2, mask=kid, other=-1)
                dup = dup | ((par2 == node) & (tk2 == tk))
            l_x = tl.load(logits_ptr + lrow + tl.maximum(tk, 0), mask=kid, other=0.0).to(tl.float32)
            p_x = tl.exp2((l_x - m_row) * c) / tl.where(s_row > 0.0, s_row, 1.0)
            bits = rng_bits(rng_base(seed, tl.zeros([BLOCK_B], tl.int64) + ch + 1), 2147483647)
            u = (bits.to(tl.float32) + 0.5) * 1.1920928955078125e-07
            acc = kid & tl.where(greedy, tk == a_row, (~dup) & (u * (1.0 - removed) < p_x))
            removed = tl.where(kid & (~acc) & (~dup) & (~greedy), removed + p_x, removed)
            found = tl.where(acc, ch, found)
        adv = live & (found >= 0)
        ftok = tl.load(draft_ptr + b * N + tl.maximum(found, 0), mask=adv, other=-1)
        tl.store(tokens_ptr + b * (N + 1) + depth, ftok, mask=adv)
        tl.store(path_ptr + b * N + depth, found, mask=adv)
        stop = live & (found < 0)
        tl.store(tokens_ptr + b * (N + 1) + depth, a_row.to(tl.int64), mask=stop & greedy)
        tl.store(nacc_ptr + b, depth.to(tl.int64), mask=stop)
        tl.store(frow_ptr + b, depth, mask=stop)
        tl.store(fnode_ptr + b, node, mask=stop)
        tl.store(stat_ptr + 2 * b, m_row, mask=stop)
        tl.store(stat_ptr + 2 * b + 1, s_row, mask=stop)
        node = tl.where(adv, found, node)
        row = tl.where(adv, found + 1, row).to(tl.int32)
        depth = tl.where(adv, depth + 1, depth)
        live = adv


@triton.jit
def _tree_final_partials_kernel(
    logits_ptr,  # [B, N+1, V] target logits, last stride 1
    draft_ptr,  # [B, N] int64 node tokens
    parent_ptr,  # [B, N] int64 parents
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    fnode_ptr,  # [B] int64 node whose children were all rejected
    stat_ptr,  # [B, 2] fp32 (M, S) of its row
    best_ptr,  # [B, NBLK] fp32 out: block best score
    bidx_ptr,  # [B, NBLK] int32 out: block best index
    stride_lb,
    stride_lr,
    B,
    N,
    V,
    NBLK,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    blk = tl.program_id(0)
    b, bok = program_range(1, BLOCK_B, B)  # [BB] each
    t = tl.load(temp_ptr + b, mask=bok, other=0.0)
    live = t > 0.0
    if tl.max(live.to(tl.int32), 0) == 0:
        return
    node = tl.load(fnode_ptr + b, mask=live, other=-1)
    row = (node + 1).to(tl.int64)
    mx = tl.load(stat_ptr + 2 * b, mask=live, other=0.0)
    s = tl.load(stat_ptr + 2 * b + 1, mask=live, other=1.0)
    c = 1.4426950408889634 / tl.where(live, t, 1.0)
    offs = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = live[:, None] & (offs < V)[None, :]  # [BB, BLOCK_V]
    lrow = b.to(tl.int64) * stride_lb + row * stride_lr
    x = tl.load(logits_ptr + lrow[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp2((x - mx[:, None]) * c[:, None]) / s[:, None]  # [BB, BLOCK_V]
    for ch in range(0, N):  # remove the rejected children's tokens
        par = tl.load(parent_ptr + b * N + ch, mask=live, other=-2)
        tk = tl.load(draft_ptr + b * N + ch, mask=live, other=-1)
        hit = ((par == node) & (tk >= 0))[:, None] & (offs[None, :] == tk[:, None])
        p = tl.where(hit, 0.0, p)
    base = rng_base(tl.load(seed_ptr + b, mask=live, other=0), row)  # [BB]
    u = (rng_bits(base[:, None], offs[None, :].to(tl.int64)).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    score = tl.where(mask, p / -tl.log2(u), -1.0)
    out = b * NBLK + blk
    tl.store(best_ptr + out, tl.max(score, 1), mask=live)
    tl.store(bidx_ptr + out, (blk * BLOCK_V + tl.argmax(score, 1)).to(tl.int32), mask=live)


def verify_tree(target_logits, draft_tokens, parents, *, temperature, seed, config: LaunchConfig | None = None):
    """Fused tree verification (q one-hot per child; see the module docstring for the rule).

    target_logits [B, N+1, V] fp32/bf16/fp16 (last stride 1), draft_tokens [B, N] int64
    (-1 = padded node), parents [B, N] int64 (-1 = root, else an earlier node), temperature [B]
    fp32 (0 = greedy), seed [B] int64. Returns (tokens [B, N+1], num_accepted [B], path [B, N]).
    """
    bsz, rows, vocab = check_common(target_logits, draft_tokens, temperature, seed)
    dev = target_logits.device
    check_tensor("parents", parents, (bsz, rows - 1), (torch.int64,), dev, True)
    cfg = pick_config(config, bsz, vocab)
    partials, nblk = launch_row_partials(target_logits, draft_tokens, temperature, cfg)
    tokens = torch.full((bsz, rows), -1, dtype=torch.int64, device=dev)  # [B, N+1]
    path = torch.full((bsz, rows - 1), -1, dtype=torch.int64, device=dev)  # [B, N]
    nacc = torch.empty((bsz,), dtype=torch.int64, device=dev)  # [B]
    frow = torch.empty((bsz,), dtype=torch.int32, device=dev)  # [B]
    fnode = torch.empty((bsz,), dtype=torch.int64, device=dev)  # [B]
    stat = torch.empty((bsz, 2), dtype=torch.float32, device=dev)  # [B, 2]
    bb = cfg.batch_block
    sl = (target_logits.stride(0), target_logits.stride(1))
    _tree_walk_kernel[(triton.cdiv(bsz, bb),)](
        target_logits,
        draft_tokens,
        parents,
        temperature,
        seed,
        *partials,
        tokens,
        path,
        nacc,
        frow,
        fnode,
        stat,
        *sl,
        bsz,
        rows - 1,
        nblk,
        BLOCK_B=bb,
        RP=triton.next_power_of_2(rows),
        NBP=triton.next_power_of_2(nblk),
        num_warps=4,
    )
    fblk = triton.cdiv(vocab, cfg.recover_block_v)
    best = torch.empty((bsz, fblk), dtype=torch.float32, device=dev)  # [B, NBLK]
    bidx = torch.empty((bsz, fblk), dtype=torch.int32, device=dev)  # [B, NBLK]
    _tree_final_partials_kernel[(fblk, triton.cdiv(bsz, bb))](
        target_logits,
        draft_tokens,
        parents,
        temperature,
        seed,
        fnode,
        stat,
        best,
        bidx,
        *sl,
        bsz,
        rows - 1,
        vocab,
        fblk,
        BLOCK_B=bb,
        BLOCK_V=cfg.recover_block_v,
        num_warps=cfg.recover_warps,
    )
    _recover_final_kernel[(triton.cdiv(bsz, bb),)](
        temperature, best, bidx, frow, tokens, bsz, rows, fblk, BLOCK_B=bb, NBP=triton.next_power_of_2(fblk), num_warps=1
    )
    return tokens, nacc, path


__all__ = ["verify_tree", "verify_tree_greedy_host", "verify_tree_reference"]
