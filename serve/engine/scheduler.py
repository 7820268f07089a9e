"""Continuous batching: each step is a prefill batch (new or preempted requests) or a decode batch.

Requests join the waiting queue at any time and leave when finished; between steps the
scheduler admits waiting requests while ``max_num_seqs``, the token budget and the free KV
blocks allow. With chunked prefill (``engine.chunked_prefill``) the running sequences take a token each in a prefill
step's forward (a token of the budget each), and the first prompt that does not fit the budget left fills it with its
first tokens and stays first in line, holding its blocks, for the rest (a *partial* prompt); the running sequences
take a decode step between two of its chunks. A decode step reserves ``lookahead`` cache positions per sequence (1 for plain
decoding, k+1 or the tree size for speculation); when the cache is short, the newest running
sequence is preempted (its blocks freed, recomputed later). A wave of waiting prompts whose tokens exceed
``engine.wave_prefill_tokens`` (CPU) joins one prompt a step, with no decode rows beside it, each answered as soon as its
own prompt is in; the running sequences take a decode step after the wave. At saturation (a queue beyond the free slots) free slots
may wait a few decode steps for company (``engine.join_wait_steps``): sequences that finish at different steps, as
speculation makes them, then join in one prefill step instead of one step each.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

import torch

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.block_manager import BlockManager
from eagleray.serve.engine.config import EngineConfig
from eagleray.serve.engine.sequence import Sequence, SequenceStatus
from eagleray.serve.engine.startup import chunked_prefill, join_wait_steps, wave_prefill_tokens

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What one engine step runs."""

    seqs: list[Sequence]
    is_prefill: bool
    chunk: int = 0  # > 0: the last sequence prefills only this many of its uncached prompt tokens (a partial prompt)
    decoding: int = 0  # a prefill step's first sequences that were running: a token each, in the prompts' forward

    @property
    def completing(self) -> list[Sequence]:
        """The sequences that get a token this step (all but a partial prompt)."""
        return self.seqs[:-1] if self.chunk else self.seqs

    @property
    def joining(self) -> list[Sequence]:
        """The sequences whose prompt this step completes (they join the running ones)."""
        return self.completing[self.decoding :]

    def least_behind(self, n: int) -> "ScheduledBatch":
        """A decode batch cut to the ``n`` sequences whose draft has the fewest positions to catch up on (the
        adaptive policy's measuring steps, :meth:`AdaptivePolicy.measuring_seqs`; the rest wait one step)."""
        if n >= len(self.seqs):
            return self
        behind = sorted(range(len(self.seqs)), key=lambda i: self.seqs[i].num_tokens - self.seqs[i].draft_cached)
        return ScheduledBatch([self.seqs[i] for i in sorted(behind[:n])], is_prefill=False)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        join_wait_steps: int = 0,
        chunked_prefill: bool = False,
        wave_tokens: int = 0,
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.yield_to_decode = False  # the last step prefilled a chunk: the running sequences decode next
        self.join_wait_steps = join_wait_steps  # engine.join_wait_steps: decode steps free slots may wait for company
        self.join_min = max(1, max_num_seqs // 8)  # free slots worth a prefill step of their own at saturation
        self.held_steps = 0  # decode steps the free slots have waited so far
        self.wave_tokens = wave_tokens  # engine.wave_prefill_tokens (0: off)
        self.wave_left = 0  # prompts of a wave too large for one step still to join, one a step (0: no such wave)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @classmethod
    def for_engine(cls, block_manager: BlockManager, config: EngineConfig, device: torch.device) -> Scheduler:
        """The engine's scheduler, ``engine.join_wait_steps``, ``chunked_prefill`` and ``wave_prefill_tokens`` resolved
        for ``device`` (:mod:`startup`)."""
        wait, chunked, wave = (
            join_wait_steps(config, device),
            chunked_prefill(config, device),
            wave_prefill_tokens(config, device),
        )
        return cls(block_manager, config.max_num_seqs, config.max_num_batched_tokens, wait, chunked, wave)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int) -> ScheduledBatch | None:
        """Prefill first (admission, unless joins wait for company, or a chunk was prefilled last step and sequences
        are running), otherwise decode every running sequence."""
        yielded, self.yield_to_decode = self.yield_to_decode and bool(self.running), False
        batch = None if yielded or self._hold_joins() else self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode(lookahead) or (self._schedule_prefill() if yielded else None)

    def _hold_joins(self) -> bool:
        """Whether the free slots wait one more decode step before admitting: only at saturation (more requests
        waiting than slots free, some running), while fewer than ``join_min`` slots are free, for at most
        ``join_wait_steps`` steps. Sequences that finish at different steps (speculation) would otherwise each
        bring a prefill step of one join, which on a GPU costs about what a step of several does."""
        free = self.max_num_seqs - len(self.running)
        saturated = bool(self.running) and 0 < free < min(self.join_min, len(self.waiting))
        if not saturated or self.held_steps >= self.join_wait_steps:
            self.held_steps = 0
            return False
        self.held_steps += 1
        return True

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting:
            self.wave_left = 0  # a wave's member left the queue (aborted): the wave is over
            return None
        if len(self.running) >= self.max_num_seqs:
            return None  # nothing to admit (every decode step at saturation asks)
        if not self.wave_left:
            self.wave_left = self._large_wave()
        one = self.wave_left > 0  # a large wave: one prompt this step, no decode rows
        seqs: list[Sequence] = []
        decoding = [] if one else self._decoding_rows()
        tokens, chunk = len(decoding), 0
        while self.waiting and len(self.running) + len(seqs) < self.max_num_seqs and not (one and seqs):
            seq = self.waiting[0]
            fresh = not seq.block_table  # a partial prompt holds its blocks and its cached count
            if fresh:
                self.blocks.match_prefix(seq)
            n, room = seq.num_tokens - seq.num_cached, self.max_num_batched_tokens - tokens  # tokens to compute, budget left
            split = self.chunked_prefill and n > room > 0
            over = (seqs or decoding) and n > room and not split  # the first prompt of a step goes whole, even past it
            if over or (fresh and not self.blocks.can_ensure(seq, seq.num_tokens)):
                if fresh:
                    self.blocks.unmatch(seq)
                break
            if fresh:
                self.blocks.ensure(seq, seq.num_tokens)  # the whole prompt's blocks: its later chunks never wait for any
                self.blocks.admitted(seq)
            seqs.append(seq)
            if split:  # its first `room` tokens now; it stays first in line for the rest
                chunk = room
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            tokens += n
        if not seqs:
            return None
        batch = ScheduledBatch(decoding + seqs, is_prefill=True, chunk=chunk, decoding=len(decoding))
        self.running.extend(batch.joining)
        if one and batch.joining:
            self.wave_left -= 1
        self.yield_to_decode = bool(chunk) or (one and not self.wave_left)  # after a large wave, a decode step
        return batch

    def _large_wave(self) -> int:
        """The prompts the free slots admit now, if their uncached tokens exceed ``wave_tokens`` (they then join one
        a step: on a CPU a prompt's prefill costs its tokens alone or batched, and batched, every prompt of the wave
        waits for all) -> how many; else 0 (they prefill together, within the budget)."""
        if not self.wave_tokens:
            return 0
        free = self.max_num_seqs - len(self.running)
        wave = list(itertools.islice(self.waiting, free))
        return len(wave) if len(wave) > 1 and sum(s.num_tokens - s.num_cached for s in wave) > self.wave_tokens else 0

    def _decoding_rows(self) -> list[Sequence]:
        """With chunked prefill, the running sequences, a token of the budget each, to decode in a prefill step's
        forward (vLLM's mixed batches: on a CPU a decode row beside hundreds of prompt rows costs about nothing, where
        a step of its own costs a decode step and stalls while prompts prefill), their next positions' slots taken
        before any prompt's blocks; none if the cache lacks a slot for any of them."""
        if not self.chunked_prefill or not self._ensure_all(1):
            return []
        return list(self.running)

    def _release_partial(self) -> bool:
        """Free the blocks of a partial prompt (it starts again when admitted) -> whether there was one."""
        for seq in self.waiting:
            if seq.block_table:
                self.blocks.free(seq)
                seq.reset_for_recompute()
                return True
        return False

    def _schedule_decode(self, lookahead: int) -> ScheduledBatch | None:
        if self._ensure_all(lookahead):
            return ScheduledBatch(list(self.running), is_prefill=False) if self.running else None
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room
            need = seq.num_tokens - 1 + lookahead
            if not self.blocks.can_ensure(seq, need):
                self._release_partial()  # a prompt not yet running gives its blocks back first
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

    def _ensure_all(self, lookahead: int) -> bool:
        """Every running sequence's slots for ``lookahead`` more positions, if the cache has them all -> whether it
        did (else nothing is taken, and the sequences are scheduled one by one, preempting from the back)."""
        growing = []  # (sequence, positions, blocks it lacks)
        for seq in self.running:
            need = seq.num_tokens - 1 + lookahead
            more = self.blocks.blocks_for(need) - len(seq.block_table)
            if more > 0:
                growing.append((seq, need, more))
        if sum(more for _, _, more in growing) > self.blocks.num_free:
            return False
        for seq, need, _ in growing:
            self.blocks.ensure(seq, need)
        return True

    def preempt_all(self) -> None:
        """Send every running sequence back to be recomputed, a partial prompt too (a draft swap: no draft state
        crosses it)."""
        self._release_partial()
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
