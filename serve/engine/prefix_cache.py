"""Automatic prefix caching: full KV blocks kept by the hash of every token up to their end, so that a prompt that
begins as an earlier one did (a chat template's system prompt, a conversation's earlier turns) prefills only the
rest.

A block is *registered* once the engine has committed all of its positions (its K/V are final: speculation writes
only past a sequence's committed positions), under the chain hash of its tokens: sha256 of the previous block's hash
and this block's token ids, so a block matches only where every token before it matches too. A registered block
that no sequence holds stays in the cache, least recently released first out, until a new block is needed; a
sequence admitted later takes the longest run of registered blocks its tokens hash to, always leaving its last
token to compute (its logits give the first new token).

With a draft the same block ids hold the draft's K/V too, and its K/V at a position pair that position's target aux
row with the *next* token (EAGLE-3's input), so a block's draft K/V are final once the draft has caught up past it
and depend on one token past its end: a speculative engine registers a block only then, under :func:`draft_key` (the
chain hash and that next token), and a sequence that matches it starts with the draft caught up to the same
position. A new draft's K/V are another model's: installing one empties the cache (``LLMEngine._use_prefix_cache``).

Serving capture keeps every position's hidden states of a captured request, so a captured request reuses a block only
where the block's rows were kept beside it (:meth:`PrefixCache.keep_rows`: a captured request that registered it
finished); the rows leave with the block (evicted, or the cache emptied).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

ROOT = b"eagleray-prefix-v1"  # the chain's seed: hashes of another scheme never collide with these


def chain_hashes(tokens: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """The chain hashes of every full block of ``tokens``, extending ``known`` (the hashes already computed for this
    sequence's first blocks) in place; returns it."""
    for i in range(len(known), len(tokens) // block_size):
        prev = known[-1] if known else ROOT
        ids = array("q", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        known.append(hashlib.sha256(prev + ids).digest())
    return known


def draft_key(digest: bytes, next_token: int) -> bytes:
    """A block's key in a speculative engine: its chain hash and the token after its last position (the draft's K/V
    at that position were computed with it)."""
    return hashlib.sha256(digest + int(next_token).to_bytes(8, "little", signed=True)).digest()


@dataclass
class PrefixStats:
    """Prompt tokens of admitted requests looked up in the cache (vLLM's prefix_cache_queries), and of those found."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """The registered blocks: hash <-> block id, and the LRU order of those no sequence holds (evictable)."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, held by no sequence; oldest first
        self._rows: dict[int, torch.Tensor] = {}  # registered block -> its positions' captured hidden rows [bs, W]

    def __len__(self) -> int:
        return len(self._hash_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def registered(self, block: int) -> bool:
        return block in self._hash_of

    def register(self, block: int, digest: bytes) -> None:
        """``block`` (held, its positions committed) holds the tokens of ``digest``; a digest already held by another
        block keeps that one (two sequences with one prefix prefilled in the same step)."""
        if digest not in self._block_of and block not in self._hash_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest

    def wants_rows(self, block: int) -> bool:
        """Whether ``block`` is registered and has no captured rows kept yet."""
        return block in self._hash_of and block not in self._rows

    def keep_rows(self, block: int, rows: torch.Tensor) -> None:
        """Keep the captured hidden rows [block_size, W] of registered ``block``'s positions beside it (rows already
        kept stay: every captured holder of a block computed it or took it with those rows)."""
        if self.wants_rows(block):
            self._rows[block] = rows

    def rows(self, block: int) -> torch.Tensor | None:
        """The captured hidden rows kept beside ``block``, or None."""
        return self._rows.get(block)

    def park(self, block: int) -> None:
        """No sequence holds ``block`` any more: it stays cached, last in line for eviction."""
        self._idle[block] = None

    def take(self, block: int) -> None:
        """A sequence holds ``block`` again: it leaves the eviction line."""
        self._idle.pop(block, None)

    def evict(self) -> int:
        """The least recently parked block, forgotten (its K/V are about to be overwritten)."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self._rows.pop(block, None)
        return block

    def clear(self) -> list[int]:
        """Forget every registration; returns the idle blocks (free now)."""
        idle = list(self._idle)
        self._block_of.clear()
        self._hash_of.clear()
        self._idle.clear()
        self._rows.clear()
        return idle
