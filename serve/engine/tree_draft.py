"""Drafting an EAGLE-2/3 top-k tree with the draft model (batched over sequences).

Depth 1: the top-k tokens of the draft's next-token distribution. Depth d: the draft runs over
every frontier node drafted so far (one forward, tree mask = ancestors), each of the k newest
frontier nodes proposes its top-k children scored by cumulative log probability, and the k best
of those k*k children become the next frontier. Finally the ``num_nodes`` best candidates (an
ancestor-closed set) form the tree. Earlier frontier nodes are re-fed at every depth because the
paged cache contract masks only new tokens; the draft is one layer, so this costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
    runner: DraftRunner, seqs: list[Sequence], logits0: torch.Tensor, hidden0: torch.Tensor, depth: int, topk: int, num_nodes: int
) -> list[DraftTree]:
    """logits0 [B, Vd], hidden0 [B, H] from the draft catch-up -> one DraftTree per sequence."""
    bsz, h = hidden0.shape
    k = min(topk, logits0.shape[-1])
    cands = [_Candidates() for _ in seqs]
    val, idx = logits0.log_softmax(-1).topk(k, dim=-1)  # [B, k]
    tok = runner.to_target_ids(idx).tolist()
    frontier = [[c.add(tok[b][i], -1, 1, float(val[b, i])) for i in range(k)] for b, c in enumerate(cands)]
    frontier_hidden = hidden0[:, None, :].expand(bsz, k, h)  # [B, k, H] input hidden of each frontier node
    fed: list[list[int]] = [[] for _ in seqs]
    fed_hidden = hidden0.new_zeros((bsz, 0, h))  # [B, F, H]
    for d in range(2, depth + 1):
        for b in range(bsz):
            fed[b] += frontier[b]
        fed_hidden = torch.cat([fed_hidden, frontier_hidden], dim=1)  # [B, F, H]
        normed, nxt = _forward_fed(runner, seqs, cands, fed, fed_hidden)  # [B, F, H] each
        logp = runner.logits(normed[:, -k:].reshape(bsz * k, h)).log_softmax(-1)  # [B*k, Vd]
        v, ix = logp.topk(k, dim=-1)  # [B*k, k]
        v, ix = v.view(bsz, k, k), runner.to_target_ids(ix).view(bsz, k, k)  # [B, k(parent), k(child)]
        new_frontier, parent_slot = _expand(cands, frontier, v, ix, d, k)
        frontier = new_frontier
        frontier_hidden = torch.gather(nxt[:, -k:], 1, parent_slot[..., None].expand(bsz, k, h))  # [B, k, H]
    trees = []
    for c in cands:
        chosen = select_nodes(c.scores, c.parents, c.depths, min(num_nodes, len(c.tokens)))
        trees.append(build_tree(c.tokens, c.parents, c.depths, chosen))
    return trees


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
