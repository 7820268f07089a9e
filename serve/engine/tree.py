"""EAGLE top-k draft trees: construction bookkeeping and attention masks.

A tree has M draft nodes under a root (the sequence's last committed token). Node i (1..M) holds
``tokens[i-1]`` with parent ``parents[i-1]`` (0 = root) and depth ``depths[i-1]``; nodes are
ordered parents-first. The target verifies all M+1 tokens in one forward with :meth:`DraftTree.mask`, or - on
the row step - as M+1 rows (:func:`tree_rows`): node i's K/V go to the sequence's cache index start + i (scratch
past the committed tokens), and its row, at position start + depth, reads its ancestors there through its tail,
so its logits are bitwise a plain row's at that position; the accepted path's K/V are then moved to their positions.

Verification is the kernels' ``verify_tree`` (see :meth:`eagleray.serve.engine.verifier.Verifier.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagleray.platform.models.row_graphs import DecodeRows


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [M] int64 target ids of the draft nodes
    parents: torch.Tensor  # [M] int64 parent node index (0 = root)
    depths: torch.Tensor  # [M] int64 depth of each node (1 = child of the root)

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def mask(self) -> torch.Tensor:
        """[M+1, M+1] bool: node i may attend to node j iff j is i or an ancestor of i (root = 0)."""
        m = self.size + 1
        mask = torch.eye(m, dtype=torch.bool)  # [M+1, M+1]
        for i in range(1, m):
            mask[i] |= mask[int(self.parents[i - 1])]
        return mask

    def paths(self) -> list[list[int]]:
        """paths[n]: the nodes from the root to node n, n last (depth + 1 of them; the root's is [0])."""
        out = [[0]]
        for i, p in enumerate(self.parents.tolist()):
            out.append(out[p] + [i + 1])
        return out

    def children(self) -> list[list[int]]:
        """children[n]: node indices whose parent is node n, in node order."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p].append(i + 1)
        return out


def select_nodes(scores: list[float], parents: list[int], depths: list[int], budget: int) -> list[int]:
    """Top ``budget`` candidates by score (ties: creation order) ordered parents-first.

    Candidates are indexed in creation order, ``parents[i]`` is a candidate index or -1 (root); a
    child's score never exceeds its parent's (log probs add), so the top set is ancestor-closed.
    """
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:budget]
    chosen = set(order)
    for i in order:
        p = parents[i]
        if p >= 0 and p not in chosen:
            raise AssertionError(f"draft tree selection is not ancestor-closed at candidate {i} (engine bug)")
    return sorted(order, key=lambda i: (depths[i], i))


def build_tree(cand_tokens: list[int], cand_parents: list[int], cand_depths: list[int], chosen: list[int]) -> DraftTree:
    """A DraftTree from the chosen candidate indices (parents-first)."""
    node_of = {c: n + 1 for n, c in enumerate(chosen)}
    parents = [0 if cand_parents[c] < 0 else node_of[cand_parents[c]] for c in chosen]
    return DraftTree(
        torch.tensor([cand_tokens[c] for c in chosen], dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor([cand_depths[c] for c in chosen], dtype=torch.int64),
    )


def tree_rows(
    trees: list[DraftTree], roots: list[int], starts: list[int], tables: torch.Tensor, block_size: int, width: int
) -> DecodeRows:
    """The rows of the trees' verification, sequence by sequence, node by node (root first): node i of sequence b
    (its token; the root's is ``roots[b]``) at position starts[b] + depth, its K/V at cache index starts[b] + i, its
    tail from starts[b]: its path's cache indices, ``width`` >= the deepest path (:meth:`DecodeRows.of_paths`).
    ``tables`` [B, MB] int32 on the device."""
    paths = [
        (b, tok, start, path)
        for b, (tree, root, start) in enumerate(zip(trees, roots, starts))
        for tok, path in zip([root] + tree.tokens.tolist(), tree.paths())
    ]
    return DecodeRows.of_paths(paths, tables, block_size, width)
