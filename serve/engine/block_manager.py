"""Paged KV block allocation: a free list of block ids, per-sequence block tables, rollback.

Target and draft caches share the block ids (same number of blocks, same block size): position
i of a sequence lives in block ``block_table[i // block_size]`` of both caches.
"""

from __future__ import annotations

from collections import deque

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.sequence import Sequence


class BlockManager:
    """Hands out KV blocks; ``ensure`` grows a table, ``truncate`` rolls back, ``free`` releases."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise EaglerayError(f"engine.num_kv_blocks={num_blocks} and engine.block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}  # block id -> seq_id

    @property
    def num_free(self) -> int:
        return len(self._free)

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
            block = self._free.popleft()
            self._owner[block] = seq.seq_id
            seq.block_table.append(block)

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
            if self._owner.pop(block, None) != seq.seq_id:
                raise EaglerayError(f"block {block} released by sequence {seq.seq_id} which does not own it (engine bug)")
            self._free.append(block)
