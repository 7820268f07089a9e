"""Drafting an EAGLE-2/3 top-k tree with the draft model (batched over sequences).

Depth 1: the top-k tokens of the draft's next-token distribution. Depth d: the draft runs over
every frontier node drafted so far (one forward, tree mask = ancestors), each of the k newest
frontier nodes proposes its top-k children scored by cumulative log probability, and the k best
of those k*k children become the next frontier. Finally the ``num_nodes`` best candidates (an
ancestor-closed set) form the tree.

Fed node i (in feeding order: the k of depth 1, then the k of depth 2, ...) keeps its K/V at cache index start + i.
On the draft's row step (:class:`_RowFeed`) each depth feeds only its frontier, k rows a sequence, each reading its
fed ancestors through its tail (:meth:`DecodeRows.of_paths`). The eager forward (:class:`_EagerFeed`) re-feeds every
earlier frontier node at every depth (its paged cache contract masks only new tokens; the draft is one layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagleray.platform.models.row_graphs import DecodeRows
from eagleray.serve.engine.model_runner import DraftRunner, ForwardBatch
from eagleray.serve.engine.sequence import Sequence
from eagleray.serve.engine.tree import DraftTree, build_tree, select_nodes


@dataclass
class _Candidates:
    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)  # candidate index or -1 (root)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft log prob

    def add(self, token: int, parent: int, depth: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.scores.append(score)
        return len(self.tokens) - 1

    def path(self, c: int) -> list[int]:
        """Candidate ``c``'s ancestors from depth 1 down to ``c`` itself, last."""
        out = [c]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def ancestor_mask(self, nodes: list[int]) -> torch.Tensor:
        """[F, F] bool over the fed nodes: self or ancestor."""
        where = {c: i for i, c in enumerate(nodes)}
        mask = torch.eye(len(nodes), dtype=torch.bool)  # [F, F]
        for i, c in enumerate(nodes):
            p = self.parents[c]
            if p >= 0:
                mask[i] |= mask[where[p]]
        return mask


def draft_tree(
    runner: DraftRunner,
    seqs: list[Sequence],
    logits0: torch.Tensor,
    hidden0: torch.Tensor,
    depth: int,
    topk: int,
    num_nodes: int,
    tables: torch.Tensor | None = None,
) -> list[DraftTree]:
    """logits0 [B, Vd], hidden0 [B, H] from the draft catch-up -> one DraftTree per sequence. ``tables`` [B, MB] (the
    block tables on the draft's device): feed the nodes as rows of the draft's row step, else its eager forward."""
    bsz, h = hidden0.shape
    k = min(topk, logits0.shape[-1])
    cands = [_Candidates() for _ in seqs]
    val, idx = logits0.float().log_softmax(-1).topk(k, dim=-1)  # [B, k]
    tok = runner.to_target_ids(idx).tolist()
    frontier = [[c.add(tok[b][i], -1, 1, float(val[b, i])) for i in range(k)] for b, c in enumerate(cands)]
    frontier_hidden = hidden0[:, None, :].expand(bsz, k, h)  # [B, k, H] input hidden of each frontier node
    feed = _RowFeed(runner, seqs, cands, tables) if tables is not None else _EagerFeed(runner, seqs, cands)
    for d in range(2, depth + 1):
        logits, nxt = feed(frontier, frontier_hidden)  # [B*k, Vd] of the frontier, [B, k, H] its next hidden
        v, ix = logits.float().log_softmax(-1).topk(k, dim=-1)  # [B*k, k]
        v, ix = v.view(bsz, k, k), runner.to_target_ids(ix).view(bsz, k, k)  # [B, k(parent), k(child)]
        frontier, parent_slot = _expand(cands, frontier, v, ix, d, k)
        frontier_hidden = torch.gather(nxt, 1, parent_slot[..., None].expand(bsz, k, h))  # [B, k, H]
    trees = []
    for c in cands:
        chosen = select_nodes(c.scores, c.parents, c.depths, min(num_nodes, len(c.tokens)))
        trees.append(build_tree(c.tokens, c.parents, c.depths, chosen))
    return trees


class _EagerFeed:
    """The draft's eager forward over every node fed so far (tree mask = ancestors), at each depth."""

    def __init__(self, runner: DraftRunner, seqs: list[Sequence], cands: list[_Candidates]):
        self.runner, self.seqs, self.cands = runner, seqs, cands
        self.fed: list[list[int]] = [[] for _ in seqs]
        self.fed_hidden = None  # [B, F, H]

    def __call__(self, frontier: list[list[int]], frontier_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``frontier`` (k a sequence) with frontier_hidden [B, k, H] -> logits [B*k, Vd], next hidden [B, k, H]."""
        bsz, k, h = frontier_hidden.shape
        for b in range(bsz):
            self.fed[b] += frontier[b]
        old = self.fed_hidden if self.fed_hidden is not None else frontier_hidden.new_zeros((bsz, 0, h))
        self.fed_hidden = torch.cat([old, frontier_hidden], dim=1)  # [B, F, H]
        normed, nxt = _forward_fed(self.runner, self.seqs, self.cands, self.fed, self.fed_hidden)  # [B, F, H] each
        return self.runner.logits(normed[:, -k:].reshape(bsz * k, h)), nxt[:, -k:]


class _RowFeed:
    """The draft's row step over each depth's frontier alone: node i fed at cache index start + i, its fed ancestors
    read through its tail."""

    def __init__(self, runner: DraftRunner, seqs: list[Sequence], cands: list[_Candidates], tables: torch.Tensor):
        self.runner, self.cands, self.tables = runner, cands, tables
        self.starts = [s.num_tokens - 1 for s in seqs]
        self.fed_at: list[dict[int, int]] = [{} for _ in seqs]  # candidate -> its fed index, per sequence
        self.width = runner.rows.rows.tail_width

    def __call__(self, frontier: list[list[int]], frontier_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`_EagerFeed.__call__`."""
        bsz, k, h = frontier_hidden.shape
        paths = []
        for b, (c, fed_at, start) in enumerate(zip(self.cands, self.fed_at, self.starts)):
            for node in frontier[b]:
                fed_at[node] = len(fed_at)
                paths.append((b, c.tokens[node], start, [fed_at[a] for a in c.path(node)]))
        rows = DecodeRows.of_paths(paths, self.tables, self.runner.block_size, self.width)
        logits, nxt = self.runner.decode(rows, frontier_hidden.reshape(bsz * k, h), from_aux=False)  # [B*k, Vd], [B*k, H]
        return logits, nxt.view(bsz, k, h)


def _forward_fed(
    runner: DraftRunner, seqs: list[Sequence], cands: list[_Candidates], fed: list[list[int]], fed_hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the draft over the fed nodes of every sequence -> normed, next_hidden [B, F, H]."""
    bsz, f, h = fed_hidden.shape
    tokens = [[c.tokens[i] for i in nodes] for c, nodes in zip(cands, fed)]
    starts = [s.num_tokens - 1 for s in seqs]
    positions = [[st + c.depths[i] - 1 for i in nodes] for st, c, nodes in zip(starts, cands, fed)]
    masks = [c.ancestor_mask(nodes) for c, nodes in zip(cands, fed)]
    batch = ForwardBatch.build(tokens, positions, starts, [s.block_table for s in seqs], runner.block_size, runner.device, masks)
    normed, nxt = runner.forward(batch, fed_hidden.reshape(bsz * f, h), from_aux=False)  # [B*F, H] each
    return normed.view(bsz, f, h), nxt.view(bsz, f, h)


def _expand(
    cands: list[_Candidates], frontier: list[list[int]], v: torch.Tensor, ix: torch.Tensor, d: int, k: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Add the k*k children of each sequence; return the next frontier and each one's parent slot [B, k]."""
    bsz = len(cands)
    parent_scores = torch.tensor([[cands[b].scores[c] for c in frontier[b]] for b in range(bsz)])  # [B, k]
    total = (parent_scores[..., None] + v.cpu()).view(bsz, k * k)  # [B, k*k]
    best = total.topk(k, dim=-1).indices  # [B, k]
    ix_l, total_l = ix.view(bsz, k * k).tolist(), total.tolist()
    new_frontier = []
    for b, c in enumerate(cands):
        made = [c.add(ix_l[b][j], frontier[b][j // k], d, total_l[b][j]) for j in range(k * k)]
        new_frontier.append([made[j] for j in best[b].tolist()])
    return new_frontier, (best // k).to(v.device)
