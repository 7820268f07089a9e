"""One speculative step: draft (chain or top-k tree) -> one target forward -> verify -> KV bookkeeping.

Chain, in the spirit of gpt-fast's ``speculative_decode``::

    d, q   = draft k tokens            # greedy rows: argmax; sampled rows: d ~ q = softmax(draft / T)
    p      = target([last, d_1..d_k])  # one forward, k+1 logits rows
    tokens = verify(p, d, q)           # accept d_j w.p. min(1, p/q); resample from norm(max(p - q, 0))
    commit accepted KV, roll back the rest

Positions: a sequence of N tokens has target KV for 0..N-2. The draft's position i pairs token
i+1 with the target's aux state at i, so "catching up" the draft over the newly committed positions
also yields the logits of d_1 (:mod:`~eagleray.serve.engine.draft_catch_up`). Draft KV written beyond N-2 while
drafting is scratch; the next catch-up overwrites it with states computed from the target's hidden states. The
step's context and results: :mod:`~eagleray.serve.engine.spec_context`.
"""

from __future__ import annotations

import torch

from eagleray.kernels import cpu_decode
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.serve.engine.draft_catch_up import draft_catch_up, prompt_part, settle_draft, take_aux
from eagleray.serve.engine.model_runner import ForwardBatch, block_table_tensor
from eagleray.serve.engine.sampling import draw, filter_logits, scaled_probs
from eagleray.serve.engine.sequence import AuxRows, Sequence
from eagleray.serve.engine.spec_context import RowParams, SeqResult, SpecContext
from eagleray.serve.engine.tree import DraftTree, tree_rows
from eagleray.serve.engine.tree_draft import draft_tree


def sample_draft(logits: torch.Tensor, rows: RowParams, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ids [B] (argmax for greedy rows, a draw from q for sampled rows) and q [B, Vd] (None if all greedy)."""
    ids = cpu_decode.argmax_last(logits)  # [B]
    if all(s.params.temperature == 0 for s in seqs):
        return ids, None
    q = scaled_probs(logits, rows.temperature)  # [B, Vd]
    sampled = [b for b, s in enumerate(seqs) if s.params.temperature > 0]
    if sampled:
        ids[torch.tensor(sampled, device=ids.device)] = draw(q[sampled], [seqs[b].generator for b in sampled]).to(ids.dtype)
    return ids, q


def draft_chain(
    ctx: SpecContext, seqs: list[Sequence], k: int, rows: RowParams, tables: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """k draft tokens per sequence: target ids [B, k], draft probs [B, k, Vd] (None if every row is greedy).
    ``tables``: the block tables [B, MB] on the device, if the caller made them already."""
    if tables is None:
        tables = block_table_tensor([s.block_table for s in seqs], ctx.draft.device)  # [B, max_blocks], once a step
    tables_or_none = tables if ctx.draft.rows is not None else None
    logits, hidden = draft_catch_up(ctx, seqs, tables_or_none, steady=k + 1)  # [B, Vd], [B, H]
    with ctx.prof.phase("draft_sample"):
        ids, q = sample_draft(logits, rows, seqs)
    all_ids, all_q = [ids], [q]
    ones = [1] * len(seqs)
    first = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.int64, device=ctx.draft.device)  # [B]
    if ctx.draft.rows is not None and q is None and k > 1:  # every row greedy: the rest of the chain in one graph
        with ctx.prof.phase("draft"):
            rest = ctx.draft.rows.chain(ctx.draft.to_target_ids(ids), hidden, first, tables, k - 1)  # [B, k-1]
        return torch.cat([ctx.draft.to_target_ids(ids)[:, None], rest], dim=1), None
    if ctx.draft.rows is not None and k > 1:  # the k-1 chain steps' rows at once: step j is column j-1
        chain = DecodeRows.of(
            first.repeat_interleave(k - 1),
            (first[:, None] + torch.arange(k - 1, device=first.device)).reshape(-1),
            tables,
            ctx.draft.block_size,
            torch.arange(len(seqs), device=first.device).repeat_interleave(k - 1),
        )
    for j in range(1, k):
        with ctx.prof.phase("prepare"):
            if ctx.draft.rows is not None:
                step = chain.column(j - 1, k - 1, ctx.draft.to_target_ids(ids))
            else:
                ctx_lens = [s.num_tokens - 2 + j for s in seqs]
                batch = ForwardBatch.of(
                    ctx.draft.to_target_ids(ids), first + (j - 1), ones, ctx_lens, tables, ctx.draft.block_size
                )
        with ctx.prof.phase("draft"):
            if ctx.draft.rows is not None:
                logits, hidden = ctx.draft.decode(step, hidden, from_aux=False)  # [B, Vd], [B, H]
            else:
                normed, hidden = ctx.draft.forward(batch, hidden, from_aux=False)  # [B, H]
                logits = ctx.draft.logits(normed)  # [B, Vd]
        with ctx.prof.phase("draft_sample"):
            ids, q = sample_draft(logits, rows, seqs)
        all_ids.append(ids)
        all_q.append(q)
    draft_ids = torch.stack(all_ids, dim=1)  # [B, k]
    probs = None if all_q[0] is None else torch.stack(all_q, dim=1)  # [B, k, Vd]
    return ctx.draft.to_target_ids(draft_ids), probs


def target_verify_forward(
    ctx: SpecContext, seqs: list[Sequence], drafts: list[list[int]], trees: list[DraftTree] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
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
        batch = ForwardBatch.build(
            tokens, positions, starts, [s.block_table for s in seqs], ctx.target.block_size, ctx.target.device, masks
        )
    with ctx.prof.phase("target"), ctx.threads.for_rows(batch.input_ids.shape[0]):
        logits, aux = ctx.target.forward(batch)  # [T, V], [T, A]
    sizes = [len(t) for t in tokens]
    return list(logits.split(sizes)), (AuxRows.split(aux, sizes) if aux is not None else [None] * len(seqs))


def target_verify_tree_rows(
    ctx: SpecContext, seqs: list[Sequence], trees: list[DraftTree]
) -> tuple[list[torch.Tensor], list[AuxRows | None]]:
    """Tree verification on the target's row step (:func:`~eagleray.serve.engine.tree.tree_rows`: each node a row,
    bitwise a plain row at its position) -> logits [M_b+1, V] fp32 and aux rows per sequence, as
    :func:`target_verify_forward`."""
    sizes = [t.size + 1 for t in trees]
    with ctx.prof.phase("prepare"):
        tables = block_table_tensor([s.block_table for s in seqs], ctx.target.device)  # [B, MB]
        roots, starts = [s.last_token for s in seqs], [s.num_tokens - 1 for s in seqs]
        rows = tree_rows(trees, roots, starts, tables, ctx.target.block_size, ctx.target.tail_width)
    with ctx.prof.phase("target"):
        logits, aux = ctx.target.prefill_rows(rows, list(range(rows.num_rows)))  # [R, V], [R, A] | None: every row
    return list(logits.split(sizes)), (AuxRows.split(aux, sizes) if aux is not None else [None] * len(seqs))


def target_verify_rows(
    ctx: SpecContext, seqs: list[Sequence], draft_tokens: torch.Tensor, k: int, tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chain verification as k+1 rows a sequence (the target's row step, no host sync); ``tables`` [B, MB]
    -> logits [B*(k+1), V] fp32, aux [B*(k+1), A] or None."""
    dev, b = ctx.target.device, len(seqs)
    with ctx.prof.phase("prepare"):
        host = torch.tensor([[s.last_token, s.num_tokens - 1] for s in seqs], dtype=torch.int64).to(dev)  # [B, 2]
        ids = torch.cat([host[:, :1], draft_tokens.to(dev)], dim=1).reshape(-1)  # [B*(k+1)]
        pos = (host[:, 1:] + torch.arange(k + 1, device=dev)).reshape(-1)  # [B*(k+1)]
        row_seq = torch.arange(b, device=dev).repeat_interleave(k + 1)  # [B*(k+1)]
        rows = DecodeRows.of(ids, pos, tables, ctx.target.block_size, row_seq)
    with ctx.prof.phase("target"):
        return ctx.target.decode(rows)


def chain_step(ctx: SpecContext, seqs: list[Sequence], k: int) -> list[SeqResult]:
    """Speculative step with a k-token chain for every sequence (greedy batches on the step graphs when there are)."""
    if ctx.graphs is not None and all(s.params.greedy for s in seqs):
        return graph_chain_step(ctx, seqs, k)
    m0 = ctx.clock.mark()
    with ctx.prof.phase("prepare"):
        rows = RowParams.of(seqs, ctx.target.device)
        tables = block_table_tensor([s.block_table for s in seqs], ctx.target.device)  # [B, MB]: draft and verify
    draft_tokens, q = draft_chain(ctx, seqs, k, rows, tables)  # [B, k], [B, k, Vd] or None
    m1 = ctx.clock.mark()
    if ctx.target.rows is not None:
        flat, flat_aux = target_verify_rows(ctx, seqs, draft_tokens, k, tables)  # [B*(k+1), V], [B*(k+1), A]
        aux = AuxRows.split(flat_aux, [k + 1] * len(seqs)) if flat_aux is not None else [None] * len(seqs)
    else:
        logits, aux = target_verify_forward(ctx, seqs, draft_tokens.tolist())  # .tolist() waits for the draft
        flat = torch.cat(logits)
    with ctx.prof.phase("verify"):
        p = flat.view(len(seqs) * (k + 1), -1)  # [B*(k+1), V]
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):  # a host check: no device sync
            p = filter_logits(p, rows.top_k.repeat_interleave(k + 1), rows.top_p.repeat_interleave(k + 1))
        p = p.view(len(seqs), k + 1, -1)  # [B, k+1, V]
        tokens, nacc = ctx.verifier.chain(
            p, draft_tokens.to(p.device), None if q is None else q.to(p.device), rows.temperature, rows.seed,
            all(s.params.greedy for s in seqs),
        )  # fmt: skip
        tokens, nacc = tokens.tolist(), nacc.tolist()  # the step's one device -> host transfer of results
    ctx.record_times(m0, m1)
    return [SeqResult(tokens[b][: n + 1], None if aux[b] is None else aux[b].head(n + 1), k, n) for b, n in enumerate(nacc)]


def graph_chain_step(ctx: SpecContext, seqs: list[Sequence], k: int) -> list[SeqResult]:
    """:func:`chain_step` of greedy sequences on :class:`ChainStepGraphs`: one staging copy, a drafting and a
    verification replay, one read-back of the accepted tokens."""
    g, n, w = ctx.graphs, len(seqs), k + 1
    m0 = ctx.clock.mark()
    lagging = [s for s in seqs if s.num_tokens - 1 - s.draft_cached > g.columns]
    if lagging:
        ctx.lag_prompt = prompt_part(lagging)
        settle_draft(ctx, lagging)
        ctx.lag_marks = (m0, ctx.clock.mark())
    with ctx.prof.phase("prepare"):
        for b, s in enumerate(seqs):
            g.put(b, s.tail(s.num_tokens - 1 - s.draft_cached), s.draft_cached, s.last_token, s.num_tokens - 1, s.block_table)
        bucket = g.load(n, take_aux(ctx, seqs)[0])  # [T, A]: the catch-up rows, sequence by sequence
        for s in seqs:
            s.draft_cached = s.num_tokens - 1
    captures = g.graphs.captures
    with ctx.prof.phase("draft"):
        g.draft(bucket, k)
    m1 = ctx.clock.mark()
    with ctx.prof.phase("target"):
        tokens, nacc, aux_out = g.verify(bucket, k)  # [bucket, k+1], [bucket], [bucket*(k+1), A] | None
    with ctx.prof.phase("verify"):
        rows = None if aux_out is None else aux_out[: n * w].clone()  # [n*(k+1), A]: outlives the next replay
        host = torch.cat([tokens[:n].reshape(-1), nacc[:n]]).tolist()  # the step's one device -> host transfer
    ctx.record_times(m0, m1, measured=g.graphs.captures == captures)
    out = []
    for b in range(n):
        a = host[n * w + b]
        part = None if rows is None else AuxRows(rows, b * w, a + 1)
        out.append(SeqResult(host[b * w : b * w + a + 1], part, k, a))
    return out


def tree_step(ctx: SpecContext, seqs: list[Sequence], depth: int, topk: int, num_nodes: int) -> list[SeqResult]:
    """Speculative step with an EAGLE top-k tree per sequence, verified in one target forward."""
    m0 = ctx.clock.mark()
    with ctx.prof.phase("prepare"):
        rows = RowParams.of(seqs, ctx.target.device)
        tables = None  # [B, MB] on the draft's device: the draft's catch-up and tree as rows
        if ctx.draft.rows is not None:
            tables = block_table_tensor([s.block_table for s in seqs], ctx.draft.device)
    logits0, hidden0 = draft_catch_up(ctx, seqs, tables, steady=depth + 1)  # [B, Vd], [B, H]
    with ctx.prof.phase("draft"):
        trees = draft_tree(ctx.draft, seqs, logits0, hidden0, depth, topk, num_nodes, tables)
        drafts = [t.tokens.tolist() for t in trees]
    m1 = ctx.clock.mark()
    if ctx.target.rows is not None:
        logits, aux = target_verify_tree_rows(ctx, seqs, trees)
    else:
        logits, aux = target_verify_forward(ctx, seqs, drafts, trees)
    with ctx.prof.phase("verify"):
        greedy = all(s.params.greedy for s in seqs)  # argmax rows, as plain greedy decoding's (no top-k/top-p)
        rows_p = (
            logits
            if greedy
            else [
                filter_logits(logits[b], rows.top_k[b].expand(t.size + 1), rows.top_p[b].expand(t.size + 1))
                for b, t in enumerate(trees)
            ]
        )  # [M_b+1, V] each
        verdicts = ctx.verifier.tree(rows_p, trees, rows.temperature, rows.seed, greedy)
    ctx.record_times(m0, m1)
    out = []
    for b, (s, tree, (path, toks)) in enumerate(zip(seqs, trees, verdicts)):
        start = s.num_tokens - 1
        rows = None if aux[b] is None else AuxRows.of(aux[b].tensor()[path])  # [len(path), A]: the accepted path's
        out.append(SeqResult(toks, rows, tree.size, len(path) - 1, [start + i for i in path]))
    return out
