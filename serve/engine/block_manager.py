"""Paged KV block allocation: a free list of block ids, per-sequence block tables, rollback, and the prefix cache's
shared blocks (:mod:`~eagleray.serve.engine.prefix_cache`).

Target and draft caches share the block ids (same number of blocks, same block size): position
i of a sequence lives in block ``block_table[i // block_size]`` of both caches.
"""

from __future__ import annotations

from collections import deque

import torch

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.prefix_cache import PrefixCache, PrefixStats, chain_hashes, draft_key
from eagleray.serve.engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks; ``ensure`` grows a table, ``truncate`` rolls back, ``free`` releases; with
    ``prefix_caching`` on, ``match_prefix`` reuses registered blocks and ``register`` adds a sequence's committed ones."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise EaglerayError(f"engine.num_kv_blocks={num_blocks} and engine.block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._holders: dict[int, set[int]] = {}  # block id -> seq_ids holding it (several: a shared prefix block)
        self.cache = PrefixCache()
        self.prefix_caching = False  # the engine turns it on (LLMEngine._use_prefix_cache -> use_prefix_cache)
        self.draft_keyed = False  # a draft shares the blocks: keys take the next token, registration waits for it
        self.stats = PrefixStats()  # the engine's metrics read it

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: never used, or cached with no holder (evicted on the way)."""
        return len(self._free) + self.cache.num_idle

    def blocks_for(self, num_positions: int) -> int:
        return (num_positions + self.block_size - 1) // self.block_size

    def can_ensure(self, seq: Sequence, num_positions: int) -> bool:
        return self.blocks_for(num_positions) - len(seq.block_table) <= self.num_free

    def ensure(self, seq: Sequence, num_positions: int) -> None:
        """Grow ``seq.block_table`` so that positions 0..num_positions-1 have a slot."""
        need = self.blocks_for(num_positions) - len(seq.block_table)
        if need > self.num_free:
            raise EaglerayError(
                f"KV cache full: sequence {seq.seq_id} needs {need} more blocks, {self.num_free} free\n"
                f"    fix: raise engine.num_kv_blocks or lower engine.max_num_seqs"
            )
        for _ in range(max(need, 0)):
            block = self._free.popleft() if self._free else self.cache.evict()
            self._holders[block] = {seq.seq_id}
            seq.block_table.append(block)

    def match_prefix(self, seq: Sequence) -> int:
        """A sequence being admitted with no blocks takes the registered blocks its tokens' full blocks hash to, from
        the first on, leaving its last token to compute -> positions cached (``seq.num_cached``; with a draft also
        ``seq.draft_cached``); 0 when prefix caching is off. A request that captures hidden states (every position's)
        takes a block only with its captured rows kept (:meth:`keep_captured`), which it takes too (``seq.captured``)."""
        if not self.prefix_caching or seq.block_table:
            return 0
        tokens = seq.tokens
        hashes = chain_hashes(tokens, self.block_size, seq.block_hashes)
        for i in range((len(tokens) - 1) // self.block_size):
            block = self.cache.lookup(self._key(tokens, hashes, i))
            rows = None if block is None or seq.captured is None else self.cache.rows(block)
            if block is None or (seq.captured is not None and rows is None):
                break  # not cached, or cached without the hidden rows this capture needs: computed from here on
            if rows is not None:
                seq.captured.append(rows)  # [bs, W]: the block's positions' rows, in position order
            self.cache.take(block)
            self._holders.setdefault(block, set()).add(seq.seq_id)
            seq.block_table.append(block)
        seq.num_cached = len(seq.block_table) * self.block_size
        seq.blocks_registered = len(seq.block_table)  # registered already: they were found
        if self.draft_keyed:
            seq.draft_cached = seq.num_cached  # the blocks' draft K/V came with them
        return seq.num_cached

    def _key(self, tokens: list[int], hashes: list[bytes], i: int) -> bytes:
        """Block ``i``'s key: its chain hash, with a draft also the token after it (:func:`draft_key`)."""
        return draft_key(hashes[i], tokens[(i + 1) * self.block_size]) if self.draft_keyed else hashes[i]

    def admitted(self, seq: Sequence) -> None:
        """Count an admitted sequence's prompt lookup (its tokens, and how many were cached)."""
        if self.prefix_caching:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_cached

    def unmatch(self, seq: Sequence) -> None:
        """Undo :meth:`match_prefix` for a sequence that stays waiting: its blocks back to the cache."""
        if not seq.block_table:
            return
        self.free(seq)
        seq.num_cached = seq.blocks_registered = seq.draft_cached = 0
        if seq.captured is not None:
            seq.captured = []  # the matched blocks' rows went with them

    def register(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks whose positions are all committed (``num_cached``; with a draft, also in the
        draft's cache: ``draft_cached``) under their keys."""
        done = min(seq.num_cached, seq.draft_cached) if self.draft_keyed else seq.num_cached
        full = done // self.block_size
        if not self.prefix_caching or full <= seq.blocks_registered:
            return
        tokens = seq.tokens
        hashes = chain_hashes(tokens[: full * self.block_size], self.block_size, seq.block_hashes)
        for i in range(seq.blocks_registered, full):
            self.cache.register(seq.block_table[i], self._key(tokens, hashes, i))
        seq.blocks_registered = full

    def keep_captured(self, seq: Sequence, rows: torch.Tensor) -> None:
        """A finished captured sequence's hidden rows [T, W] (positions 0..T-1), kept beside its registered blocks
        that have none yet (a copy a block), for the captured requests that match them later."""
        bs = self.block_size
        for i in range(min(seq.blocks_registered, rows.shape[0] // bs)):
            if self.cache.wants_rows(seq.block_table[i]):
                self.cache.keep_rows(seq.block_table[i], rows[i * bs : (i + 1) * bs].clone())  # [bs, W]

    def use_prefix_cache(self, on: bool, draft_keyed: bool) -> None:
        """Start the prefix cache empty (a draft was installed: the blocks registered so far hold another draft's K/V,
        or none), matching prefixes if ``on``, keyed for a draft if ``draft_keyed``."""
        self._free.extend(self.cache.clear())
        self.prefix_caching, self.draft_keyed = on, draft_keyed

    def truncate(self, seq: Sequence, num_positions: int) -> int:
        """Roll back: free the blocks past ``num_positions`` (rejected draft slots); returns how many."""
        keep = self.blocks_for(num_positions)
        extra = seq.block_table[keep:]
        del seq.block_table[keep:]
        self._release(seq, extra)
        return len(extra)

    def compaction(self, seq: Sequence, src_positions: list[int], start: int) -> list[tuple[int, int]]:
        """(from slot, to slot) moves that bring the KV of ``src_positions`` to positions ``start``, ``start`` + 1, ...
        (an accepted tree path, contiguous after the moves); positions already in place are left out."""
        bs = self.block_size

        def slot(pos: int) -> int:
            return seq.block_table[pos // bs] * bs + pos % bs

        return [(slot(s), slot(start + i)) for i, s in enumerate(src_positions) if s != start + i]

    def free(self, seq: Sequence) -> None:
        """Release every block of a finished or preempted sequence."""
        self._release(seq, seq.block_table)
        seq.block_table = []

    def _release(self, seq: Sequence, blocks: list[int]) -> None:
        for block in blocks:
            holders = self._holders.get(block)
            if holders is None or seq.seq_id not in holders:
                raise EaglerayError(f"block {block} released by sequence {seq.seq_id} which does not own it (engine bug)")
            holders.discard(seq.seq_id)
            if holders:
                continue  # a shared prefix block another sequence still reads
            del self._holders[block]
            if self.cache.registered(block):
                self.cache.park(block)
            else:
                self._free.append(block)
