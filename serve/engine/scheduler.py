"""Continuous batching: each step is a prefill batch (new or preempted requests) or a decode batch.

Requests join the waiting queue at any time and leave when finished; between steps the
scheduler admits waiting requests while ``max_num_seqs``, the token budget and the free KV
blocks allow. A decode step reserves ``lookahead`` cache positions per sequence (1 for plain
decoding, k+1 or the tree size for speculation); when the cache is short, the newest running
sequence is preempted (its blocks freed, recomputed later).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What one engine step runs."""

    seqs: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int) -> ScheduledBatch | None:
        """Prefill first (admission), otherwise decode every running sequence."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode(lookahead)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens
            if seqs and tokens + n > self.max_num_batched_tokens:
                break
            if not self.blocks.can_ensure(seq, n):
                break
            self.blocks.ensure(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
            tokens += n
        if not seqs:
            return None
        self.running.extend(seqs)
        return ScheduledBatch(seqs, is_prefill=True)

    def _schedule_decode(self, lookahead: int) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room
            need = seq.num_tokens - 1 + lookahead
            while not self.blocks.can_ensure(seq, need) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if not self.blocks.can_ensure(seq, need):
                if len(self.running) == 1:
                    raise EaglerayError(
                        f"KV cache too small: sequence {seq.seq_id} alone needs {self.blocks.blocks_for(need)} "
                        f"blocks of {self.blocks.block_size} tokens, the cache has {self.blocks.num_blocks}\n"
                        f"    fix: raise engine.num_kv_blocks or lower max_tokens"
                    )
                self._preempt(seq)
                continue
            self.blocks.ensure(seq, need)
            scheduled.append(seq)
        return ScheduledBatch(scheduled, is_prefill=False) if scheduled else None

    def preempt_all(self) -> None:
        """Send every running sequence back to be recomputed (a draft swap: no draft state crosses it)."""
        for seq in list(self.running):
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.info("preempted sequence %s (KV cache full); it will be recomputed", seq.seq_id)

    def finish(self, seq: Sequence) -> None:
        """A finished request leaves: its blocks return to the pool."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq)
