"""The draft's catch-up: feeding it the committed positions it has not seen (the previous step's accepted tokens,
a joined sequence's prompt, the tokens of plain steps), with the target's aux rows those positions produced.

- :func:`draft_catch_up`: every unseen position in one forward -> the draft's logits and hidden state at N-2 (the
  first draft of the next chain); a long catch-up is timed as lag, its prompt part (:func:`prompt_part`) as the
  draft's prefill of joined sequences.
- :func:`settle_draft`: all but the last unseen position as rows through the draft's graphs, so the chain step's
  graphs catch up one row a sequence.
"""

from __future__ import annotations

import torch

from eagleray.platform.checkpoints.guard import assert_aux_shape
from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.serve.engine.model_runner import DraftRunner, ForwardBatch, block_table_tensor
from eagleray.serve.engine.sequence import Sequence, gather_aux
from eagleray.serve.engine.spec_context import SpecContext


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
        ctx.lag_prompt = prompt_part(seqs) if lagging else (0.0, 0)
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
            with ctx.threads.for_rows(sum(lens)):  # the wide forward; its B rows of logits stay decode-sized
                normed, hidden = ctx.draft.forward(batch, aux.to(ctx.draft.device), from_aux=True)  # [T, H] each
            logits, hidden = ctx.draft.logits(normed[last]), hidden[last]  # [B, Vd], [B, H]
    for s in seqs:
        s.draft_cached = s.num_tokens - 1
    if lagging:
        ctx.lag_marks = (start, ctx.clock.mark())
    return logits, hidden


def prompt_part(seqs: list[Sequence]) -> tuple[float, int]:
    """Of the positions the draft has not seen in ``seqs``, (the share that are prompt positions, how many): a
    catch-up over them is the draft's prefill of sequences that joined (a cost of speculating at all, which the
    adaptive policy counts), the rest the price of plain steps taken meanwhile (which it does not)."""
    rows = sum(s.num_tokens - 1 - s.draft_cached for s in seqs)
    prompt = sum(max(0, min(len(s.prompt_token_ids), s.num_tokens - 1) - s.draft_cached) for s in seqs)
    return (prompt / rows if rows > 0 else 0.0), prompt


def joined_positions(seqs: list[Sequence]) -> int:
    """Sequences just prefilled: the prompt positions the draft will catch up on, each kept on its sequence
    (``joined_positions``: the adaptive policy counts them per token of its life) -> their sum."""
    for s in seqs:
        s.joined_positions = max(0, len(s.prompt_token_ids) - s.draft_cached)  # prompt_part's count once it is prefilled
    return sum(s.joined_positions for s in seqs)


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
        lasts = [s.pending_aux.last() for s in seqs]  # the row the step graphs' catch-up reads
        aux, counts = take_aux(ctx, seqs)  # [T + B, A]
        for s, last in zip(seqs, lasts):
            s.pending_aux.append(*last)  # emptied by take_aux
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
