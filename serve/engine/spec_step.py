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

from eagleray.kernels import cpu_decode
from eagleray.platform.checkpoints.guard import assert_aux_shape
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.platform.models.spec_graphs import ChainStepGraphs
from eagleray.serve.engine.model_runner import DraftRunner, ForwardBatch, TargetRunner, block_table_tensor
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sampling import filter_logits, scaled_probs
from eagleray.serve.engine.sequence import AuxRows, Sequence, gather_aux
from eagleray.serve.engine.tree import DraftTree
from eagleray.serve.engine.tree_draft import draft_tree
from eagleray.serve.engine.verify import Verifier


class StepClock:
    """Marks in the step's stream: CUDA events on CUDA (read after the step's one synchronisation, so GPU
    time lands in the phase that queued it), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class SpecContext:
    target: TargetRunner
    draft: DraftRunner
    verifier: Verifier
    prof: StepProfiler
    aux_checked: bool = False
    draft_seconds: float = 0.0  # the last step's drafting (catch-up + chain or tree), for the adaptive policy
    lag_seconds: float = 0.0  # the last step's catch-up over plain steps' positions (kept out of drafting)
    join_seconds: float = 0.0  # the share of lag_seconds spent on prompt positions: the draft's prefill of new sequences
    lag_prompt_share: float = 0.0  # of the rows of the last long catch-up, the share that were prompt positions
    clock: StepClock | None = None
    lag_marks: tuple | None = None  # a catch-up over more than a step's positions (after plain steps), not drafting cost
    graphs: ChainStepGraphs | None = None  # CUDA rows: greedy chain steps as two graphs per (batch bucket, k)
    measured: bool = True  # False when the last step also captured a graph (its times are not the step's cost)

    def __post_init__(self):
        self.clock = self.clock or StepClock(self.target.device)

    def record_times(self, m0, m1, measured: bool = True) -> None:
        """Draft seconds (m0..m1, less a long catch-up) of the step just done; the engine takes the rest of the
        step as its verify cost."""
        lag = self.clock.seconds(*self.lag_marks) if self.lag_marks is not None else 0.0
        self.lag_marks, self.lag_seconds = None, lag
        self.join_seconds, self.lag_prompt_share = lag * self.lag_prompt_share, 0.0
        self.draft_seconds = max(self.clock.seconds(m0, m1) - lag, 0.0)
        self.measured = measured


@dataclass
class SeqResult:
    """Outcome of verification for one sequence."""

    tokens: list[int]  # accepted drafts + one recovered/bonus token
    aux: AuxRows | None  # [len(tokens), A] target aux states of the positions these tokens follow
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
        seeds = [(s.seed * 1_000_003 + s.step * 7919 + len(s.output_token_ids)) % (1 << 62) for s in seqs]
        ints = torch.tensor([[s.params.top_k for s in seqs], seeds], dtype=torch.int64).to(device)  # [2, B]: one copy
        floats = torch.tensor([[s.params.temperature for s in seqs], [s.params.top_p for s in seqs]], dtype=torch.float32).to(
            device
        )  # [2, B]
        return cls(floats[0], ints[0], floats[1], ints[1])


def _draft_batch(
    seqs: list[Sequence], tokens: list[list[int]], starts: list[int], runner, device, tree_masks=None, context_lens=None
) -> ForwardBatch:
    positions = [list(range(s, s + len(t))) for s, t in zip(starts, tokens)]
    ctx = context_lens if context_lens is not None else starts
    return ForwardBatch.build(tokens, positions, ctx, [s.block_table for s in seqs], runner.block_size, device, tree_masks)


def draft_catch_up(
    ctx: SpecContext, seqs: list[Sequence], tables: torch.Tensor | None = None, steady: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed the draft every committed position it has not seen -> draft logits [B, Vd], hidden [B, H] at N-2.

    ``tables`` [B, MB]: the block tables on the draft's device, for the row step (short catch-ups). ``steady``:
    the most positions a catch-up holds between speculative steps (the previous step's drafts + 1); a longer one
    follows plain steps, and its time is kept out of the drafting cost the adaptive policy measures (it is the
    price of having switched, not of the next speculative step)."""
    with ctx.prof.phase("prepare"):
        tokens = [s.tokens[s.draft_cached + 1 : s.num_tokens] for s in seqs]
        aux = take_aux(ctx, seqs)[0]  # [T, n_aux*H_t]
        lens = [len(t) for t in tokens]
        use_rows = tables is not None and sum(lens) <= ctx.draft.max_rows
        if steady is not None:
            lagging = max(lens) > steady
        else:
            lagging = max(lens) > ctx.draft.max_rows // max(len(seqs), 1) if tables is not None else max(lens) > 64
        start = ctx.clock.mark() if lagging else None
        ctx.lag_prompt_share = prompt_share(seqs) if lagging else 0.0
        if use_rows:
            rows, last = _catch_up_rows(seqs, tokens, lens, tables, ctx.draft)
        else:
            batch = _draft_batch(seqs, tokens, [s.draft_cached for s in seqs], ctx.draft, ctx.draft.device)
            last = batch.last_index
    with ctx.prof.phase("draft"):
        if use_rows:
            logits, hidden = ctx.draft.decode(rows, aux.to(ctx.draft.device), from_aux=True)  # [T, Vd], [T, H]
            logits, hidden = logits[last], hidden[last]  # [B, Vd], [B, H]
        else:
            normed, hidden = ctx.draft.forward(batch, aux.to(ctx.draft.device), from_aux=True)  # [T, H] each
            logits, hidden = ctx.draft.logits(normed[last]), hidden[last]  # [B, Vd], [B, H]
    for s in seqs:
        s.draft_cached = s.num_tokens - 1
    if lagging:
        ctx.lag_marks = (start, ctx.clock.mark())
    return logits, hidden


def prompt_share(seqs: list[Sequence]) -> float:
    """Of the positions the draft has not seen in ``seqs``, the share that are prompt positions: a catch-up over them
    is the draft's prefill of sequences that joined (a cost of speculating at all, which the adaptive policy counts),
    the rest the price of plain steps taken meanwhile (which it does not)."""
    rows = sum(s.num_tokens - 1 - s.draft_cached for s in seqs)
    prompt = sum(max(0, min(len(s.prompt_token_ids), s.num_tokens - 1) - s.draft_cached) for s in seqs)
    return prompt / rows if rows > 0 else 0.0


def _catch_up_rows(
    seqs: list[Sequence], tokens: list[list[int]], lens: list[int], tables: torch.Tensor, runner: DraftRunner
) -> tuple[DecodeRows, torch.Tensor]:
    """Catch-up as rows: row (b, i) is token tokens[b][i] at position draft_cached_b + i -> rows, last row of each b."""
    dev = tables.device
    host = torch.tensor(
        [t for seq in tokens for t in seq] + [s.draft_cached + i for s, n in zip(seqs, lens) for i in range(n)] + lens,
        dtype=torch.int64,
    ).to(dev)  # one host -> device copy: ids [T], positions [T], lens [B]
    t = sum(lens)
    ids, pos, counts = host[:t], host[t : 2 * t], host[2 * t :]
    row_seq = torch.repeat_interleave(torch.arange(len(seqs), device=dev), counts, output_size=t)  # [T]
    return DecodeRows.of(ids, pos, tables, runner.block_size, row_seq), counts.cumsum(0) - 1


def sample_draft(logits: torch.Tensor, rows: RowParams, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ids [B] (argmax for greedy rows, a draw from q for sampled rows) and q [B, Vd] (None if all greedy)."""
    ids = cpu_decode.argmax_last(logits)  # [B]
    if all(s.params.temperature == 0 for s in seqs):
        return ids, None
    q = scaled_probs(logits, rows.temperature)  # [B, Vd]
    for b, s in enumerate(seqs):
        if s.params.temperature > 0:
            ids[b] = torch.multinomial(q[b], 1, generator=s.generator)[0]
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
    with ctx.prof.phase("target"):
        logits, aux = ctx.target.forward(batch)  # [T, V], [T, A]
    sizes = [len(t) for t in tokens]
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
            p, draft_tokens.to(p.device), None if q is None else q.to(p.device), rows.temperature, rows.seed
        )
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
        ctx.lag_prompt_share = prompt_share(lagging)
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


def take_aux(ctx: SpecContext, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
    """The aux rows ``seqs`` queued for the draft -> [T, A] (the draft's columns), rows per sequence; checked
    against the draft's shape at the first speculative step."""
    aux, counts = gather_aux(seqs, ctx.target.model.hidden_size if ctx.target.capture_final else 0)
    if not ctx.aux_checked:
        assert_aux_shape(aux, ctx.draft.num_aux, ctx.target.model.hidden_size)
        ctx.aux_checked = True
    return aux, counts


def settle_draft(ctx: SpecContext, seqs: list[Sequence]) -> None:
    """Feed the draft all but the last of the positions it has not seen (after a prefill, plain steps or a longer
    chain), so that the step graphs' catch-up holds one row for these sequences: as catch-up rows through the draft's
    graphs, ``max_rows`` at a time (a row's K/V stays in the cache for the rows after it). Not drafting cost: the price
    of having decoded without the draft."""
    with ctx.prof.phase("settle"):
        lasts = [s.pending_aux[-1].last() for s in seqs]  # the row the step graphs' catch-up reads
        aux, counts = take_aux(ctx, seqs)  # [T + B, A]
        for s, last in zip(seqs, lasts):
            s.pending_aux = [last]
        starts = [sum(counts[:b]) for b in range(len(seqs))]
        keep = [i for st, c in zip(starts, counts) for i in range(st, st + c - 1)]
        aux = aux[torch.tensor(keep, dtype=torch.int64, device=aux.device)].to(ctx.draft.device)  # [T, A]: all but lasts
        tokens = [s.tokens[s.draft_cached + 1 : s.num_tokens - 1] for s in seqs]
        tables = block_table_tensor([s.block_table for s in seqs], ctx.draft.device)  # [B, MB]
        rows, _ = _catch_up_rows(seqs, tokens, [len(t) for t in tokens], tables, ctx.draft)
        step = ctx.draft.max_rows
        for i in range(0, rows.num_rows, step):  # writes the draft's K/V of those positions
            ctx.draft.decode(rows.slice(i, i + step), aux[i : i + step], from_aux=True)
    for s in seqs:
        s.draft_cached = s.num_tokens - 2


def tree_step(ctx: SpecContext, seqs: list[Sequence], depth: int, topk: int, num_nodes: int) -> list[SeqResult]:
    """Speculative step with an EAGLE top-k tree per sequence, verified in one target forward."""
    m0 = ctx.clock.mark()
    with ctx.prof.phase("prepare"):
        rows = RowParams.of(seqs, ctx.target.device)
    logits0, hidden0 = draft_catch_up(ctx, seqs, steady=depth + 1)  # [B, Vd], [B, H]
    with ctx.prof.phase("draft"):
        trees = draft_tree(ctx.draft, seqs, logits0, hidden0, depth, topk, num_nodes)
        drafts = [t.tokens.tolist() for t in trees]
    m1 = ctx.clock.mark()
    logits, aux = target_verify_forward(ctx, seqs, drafts, trees)
    with ctx.prof.phase("verify"):
        rows_p = [
            filter_logits(logits[b], rows.top_k[b].expand(t.size + 1), rows.top_p[b].expand(t.size + 1))
            for b, t in enumerate(trees)
        ]  # [M_b+1, V] each
        verdicts = ctx.verifier.tree(rows_p, trees, rows.temperature, rows.seed)
    ctx.record_times(m0, m1)
    out = []
    for b, (s, tree, (path, toks)) in enumerate(zip(seqs, trees, verdicts)):
        start = s.num_tokens - 1
        rows = None if aux[b] is None else AuxRows.of(aux[b].tensor()[path])  # [len(path), A]: the accepted path's
        out.append(SeqResult(toks, rows, tree.size, len(path) - 1, [start + i for i in path]))
    return out
