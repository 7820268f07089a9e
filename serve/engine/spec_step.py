"""One speculative step: draft (chain or top-k tree) -> one target forward -> verify -> KV bookkeeping.

Chain, in the spirit of gpt-fast's ``speculative_decode``::

    d, q   = draft k tokens            # greedy rows: argmax; sampled rows: d ~ q = softmax(draft / T)
    p      = target([last, d_1..d_k])  # one forward, k+1 logits rows
    tokens = verify(p, d, q)           # accept d_j w.p. min(1, p/q); resample from norm(max(p - q, 0))
    commit accepted KV, roll back the rest

Positions: a sequence of N tokens has target KV for 0..N-2. The draft's position i pairs token
i+1 with the target's aux state at i, so "catching up" the draft over the newly committed positions
also yields the logits of d_1. Draft KV written beyond N-2 while drafting is scratch; the next
catch-up overwrites it with states computed from the target's hidden states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eagleray.platform.guard import assert_aux_shape
from eagleray.serve.engine.model_runner import DraftRunner, ForwardBatch, TargetRunner, block_table_tensor
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sampling import filter_logits, scaled_probs
from eagleray.serve.engine.sequence import Sequence
from eagleray.serve.engine.tree import DraftTree
from eagleray.serve.engine.tree_draft import draft_tree
from eagleray.serve.engine.verify import ChainVerifier


@dataclass
class SpecContext:
    target: TargetRunner
    draft: DraftRunner
    verifier: ChainVerifier
    prof: StepProfiler
    aux_checked: bool = False
    draft_seconds: float = 0.0  # the last step's drafting (catch-up + chain or tree), for the adaptive policy
    verify_seconds: float = 0.0  # the last step's target forward + verification


@dataclass
class SeqResult:
    """Outcome of verification for one sequence."""

    tokens: list[int]  # accepted drafts + one recovered/bonus token
    aux: torch.Tensor  # [len(tokens), A] target aux states of the positions these tokens follow
    num_draft_tokens: int
    num_accepted: int
    src_positions: list[int] | None = None  # tree: cache positions of the accepted path (to compact)


@dataclass
class RowParams:
    temperature: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] f32
    seed: torch.Tensor  # [B] int64, varies per step

    @classmethod
    def of(cls, seqs: list[Sequence], device) -> "RowParams":
        def t(vals, dt):
            return torch.tensor(vals, dtype=dt, device=device)
        seeds = [(s.seed * 1_000_003 + s.step * 7919 + len(s.output_token_ids)) % (1 << 62) for s in seqs]
        return cls(t([s.params.temperature for s in seqs], torch.float32), t([s.params.top_k for s in seqs], torch.int64),
                   t([s.params.top_p for s in seqs], torch.float32), t(seeds, torch.int64))


def _draft_batch(seqs: list[Sequence], tokens: list[list[int]], starts: list[int], runner, device,
                 tree_masks=None, context_lens=None) -> ForwardBatch:
    positions = [list(range(s, s + len(t))) for s, t in zip(starts, tokens)]
    ctx = context_lens if context_lens is not None else starts
    return ForwardBatch.build(tokens, positions, ctx, [s.block_table for s in seqs], runner.block_size, device, tree_masks)


def draft_catch_up(ctx: SpecContext, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the draft every committed position it has not seen -> draft logits [B, Vd], hidden [B, H] at N-2."""
    with ctx.prof.phase("prepare"):
        tokens = [s.tokens[s.draft_cached + 1:s.num_tokens] for s in seqs]
        aux = torch.cat([s.take_aux() for s in seqs], dim=0)  # [T, n_aux*H_t]
        if not ctx.aux_checked:
            assert_aux_shape(aux, ctx.draft.num_aux, ctx.target.model.hidden_size)
            ctx.aux_checked = True
        batch = _draft_batch(seqs, tokens, [s.draft_cached for s in seqs], ctx.draft, ctx.draft.device)
    with ctx.prof.phase("draft"):
        normed, hidden = ctx.draft.forward(batch, aux.to(ctx.draft.device), from_aux=True)  # [T, H] each
        logits = ctx.draft.logits(normed[batch.last_index])  # [B, Vd]
    for s in seqs:
        s.draft_cached = s.num_tokens - 1
    return logits, hidden[batch.last_index]


def sample_draft(logits: torch.Tensor, rows: RowParams, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ids [B] (argmax for greedy rows, a draw from q for sampled rows) and q [B, Vd] (None if all greedy)."""
    ids = logits.argmax(-1)  # [B]
    if all(s.params.temperature == 0 for s in seqs):
        return ids, None
    q = scaled_probs(logits, rows.temperature)  # [B, Vd]
    for b, s in enumerate(seqs):
        if s.params.temperature > 0:
            ids[b] = torch.multinomial(q[b], 1, generator=s.generator)[0]
    return ids, q


def draft_chain(ctx: SpecContext, seqs: list[Sequence], k: int, rows: RowParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k draft tokens per sequence: target ids [B, k], draft probs [B, k, Vd] (None if every row is greedy)."""
    logits, hidden = draft_catch_up(ctx, seqs)  # [B, Vd], [B, H]
    with ctx.prof.phase("draft_sample"):
        ids, q = sample_draft(logits, rows, seqs)
    all_ids, all_q = [ids], [q]
    ones = [1] * len(seqs)
    tables = block_table_tensor([s.block_table for s in seqs], ctx.draft.device)  # [B, max_blocks], once for the chain
    first = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64, device=ctx.draft.device)  # [B]
    for j in range(1, k):
        with ctx.prof.phase("prepare"):
            ctx_lens = [s.num_tokens - 2 + j for s in seqs]
            batch = ForwardBatch.of(ctx.draft.to_target_ids(ids), first + (j - 1), ones, ctx_lens, tables, ctx.draft.block_size)
        with ctx.prof.phase("draft"):
            normed, hidden = ctx.draft.forward(batch, hidden, from_aux=False)  # [B, H]
            logits = ctx.draft.logits(normed)  # [B, Vd]
        with ctx.prof.phase("draft_sample"):
            ids, q = sample_draft(logits, rows, seqs)
        all_ids.append(ids)
        all_q.append(q)
    draft_ids = torch.stack(all_ids, dim=1)  # [B, k]
    probs = None if all_q[0] is None else torch.stack(all_q, dim=1)  # [B, k, Vd]
    return ctx.draft.to_target_ids(draft_ids), probs


def target_verify_forward(ctx: SpecContext, seqs: list[Sequence], drafts: list[list[int]],
                          trees: list[DraftTree] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One target forward over [last, drafts...] per sequence -> logits [K_b+1, V] and aux [K_b+1, A] per sequence."""
    tokens = [[s.last_token] + d for s, d in zip(seqs, drafts)]
    starts = [s.num_tokens - 1 for s in seqs]
    if trees is None:
        positions = [list(range(st, st + len(t))) for st, t in zip(starts, tokens)]
        masks = None
    else:
        positions = [[st] + (st + tr.depths).tolist() for st, tr in zip(starts, trees)]
        masks = [tr.mask() for tr in trees]
    with ctx.prof.phase("prepare"):
        batch = ForwardBatch.build(tokens, positions, starts, [s.block_table for s in seqs], ctx.target.block_size,
                                   ctx.target.device, masks)
    with ctx.prof.phase("target"):
        logits, aux = ctx.target.forward(batch)  # [T, V], [T, A]
    sizes = [len(t) for t in tokens]
    aux_parts = list(aux.split(sizes)) if aux is not None else [None] * len(seqs)
    return list(logits.split(sizes)), aux_parts


def chain_step(ctx: SpecContext, seqs: list[Sequence], k: int) -> list[SeqResult]:
    """Speculative step with a k-token chain for every sequence."""
    t0 = time.perf_counter()
    with ctx.prof.phase("prepare"):
        rows = RowParams.of(seqs, ctx.target.device)
    draft_tokens, q = draft_chain(ctx, seqs, k, rows)  # [B, k], [B, k, Vd] or None
    drafts = draft_tokens.tolist()  # waits for the draft on a GPU
    t1 = time.perf_counter()
    logits, aux = target_verify_forward(ctx, seqs, drafts)
    with ctx.prof.phase("verify"):
        p = filter_logits(torch.cat(logits).view(len(seqs) * (k + 1), -1), rows.top_k.repeat_interleave(k + 1),
                          rows.top_p.repeat_interleave(k + 1)).view(len(seqs), k + 1, -1)  # [B, k+1, V]
        tokens, nacc = ctx.verifier(p, draft_tokens.to(p.device), None if q is None else q.to(p.device), rows.temperature, rows.seed)
        tokens, nacc = tokens.tolist(), nacc.tolist()  # the step's one device -> host transfer of results
    ctx.draft_seconds, ctx.verify_seconds = t1 - t0, time.perf_counter() - t1
    return [SeqResult(tokens[b][:n + 1], aux[b][:n + 1], k, n) for b, n in enumerate(nacc)]


def tree_step(ctx: SpecContext, seqs: list[Sequence], depth: int, topk: int, num_nodes: int) -> list[SeqResult]:
    """Speculative step with an EAGLE top-k tree per sequence, verified in one target forward."""
    t0 = time.perf_counter()
    with ctx.prof.phase("prepare"):
        rows = RowParams.of(seqs, ctx.target.device)
    logits0, hidden0 = draft_catch_up(ctx, seqs)  # [B, Vd], [B, H]
    with ctx.prof.phase("draft"):
        trees = draft_tree(ctx.draft, seqs, logits0, hidden0, depth, topk, num_nodes)
        drafts = [t.tokens.tolist() for t in trees]
    t1 = time.perf_counter()
    logits, aux = target_verify_forward(ctx, seqs, drafts, trees)
    with ctx.prof.phase("verify"):
        rows_p = [filter_logits(logits[b], rows.top_k[b].expand(t.size + 1), rows.top_p[b].expand(t.size + 1))
                  for b, t in enumerate(trees)]  # [M_b+1, V] each
        verdicts = ctx.verifier.tree(rows_p, trees, rows.temperature, rows.seed)
    ctx.draft_seconds, ctx.verify_seconds = t1 - t0, time.perf_counter() - t1
    out = []
    for b, (s, tree, (path, toks)) in enumerate(zip(seqs, trees, verdicts)):
        start = s.num_tokens - 1
        out.append(SeqResult(toks, aux[b][path], tree.size, len(path) - 1, [start + i for i in path]))
    return out
