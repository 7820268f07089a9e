"""Request/sequence state: tokens, KV bookkeeping, stop checks and per-request spec statistics."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from eagleray.serve.engine.sampling import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative statistics of one request (or of the engine, see metrics.py)."""

    num_drafts: int = 0  # verification steps that carried drafts
    num_draft_tokens: int = 0  # draft tokens proposed (tree: nodes verified)
    num_accepted_tokens: int = 0  # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [k] accepted count at draft position i

    def record(self, num_draft_tokens: int, num_accepted: int, max_pos: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < max_pos:
            self.accepted_per_pos.extend([0] * (max_pos - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """τ = mean(accepted + 1) over verification steps (1.0 = nothing ever accepted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }


class AuxRows(NamedTuple):
    """Rows ``start .. start+count-1`` of one step's aux tensor ``src`` [R, W], held by reference: a step hands each
    sequence its rows without a tensor view apiece (a view costs microseconds of host time, a batch of 128 of them
    a tenth of a small model's step); :func:`gather_aux` joins them, once, when the draft reads them."""

    src: torch.Tensor  # [R, W]: the step's aux rows (W = A, or A + H while the engine captures)
    start: int
    count: int

    @classmethod
    def of(cls, rows: torch.Tensor) -> "AuxRows":
        """All of ``rows`` [n, W]."""
        return cls(rows, 0, rows.shape[0])

    @classmethod
    def split(cls, aux: torch.Tensor, sizes: list[int]) -> list["AuxRows"]:
        """``aux`` [sum(sizes), W] as consecutive ranges of ``sizes`` rows."""
        parts, start = [], 0
        for n in sizes:
            parts.append(cls(aux, start, n))
            start += n
        return parts

    def head(self, n: int) -> "AuxRows":
        """The first ``n`` rows."""
        return AuxRows(self.src, self.start, min(n, self.count))

    def last(self) -> "AuxRows":
        """The last row."""
        return AuxRows(self.src, self.start + self.count - 1, 1)

    def tensor(self) -> torch.Tensor:
        """The rows as a tensor [count, W] (a view of ``src``)."""
        return self.src[self.start : self.start + self.count]


class PendingAux:
    """A sequence's queued aux rows (:class:`AuxRows` ranges, in position order) as three parallel lists of the
    step tensors and of ints. Queuing a range adds no object that Python's garbage collector tracks: an AuxRows kept
    per sequence and step (a tuple that holds a tensor) was one, and a speculative engine's plain steps, which queue
    rows until the next speculative step, left one a sequence a step (the H200, SmolLM2 at 64 sequences, random
    draft, no speculative step: ~300 young collections a run against 3 without a draft, and one full collection of
    273 ms, 13% of that run; with these lists 13 young collections and no full one)."""

    __slots__ = ("srcs", "starts", "counts")

    def __init__(self) -> None:
        self.srcs: list[torch.Tensor] = []
        self.starts: list[int] = []
        self.counts: list[int] = []

    def append(self, src: torch.Tensor, start: int, count: int) -> None:
        """Queue rows ``start .. start+count-1`` of ``src`` (an :class:`AuxRows`' fields)."""
        self.srcs.append(src)
        self.starts.append(start)
        self.counts.append(count)

    def clear(self) -> None:
        self.srcs.clear()
        self.starts.clear()
        self.counts.clear()

    def last(self) -> AuxRows:
        """The last queued row."""
        return AuxRows(self.srcs[-1], self.starts[-1] + self.counts[-1] - 1, 1)

    def __iter__(self):
        return map(AuxRows, self.srcs, self.starts, self.counts)

    def __len__(self) -> int:
        return len(self.srcs)


def queue_step_rows(seqs: list["Sequence"], aux: torch.Tensor) -> None:
    """A plain decode step's aux rows [B, W] (row b: ``seqs[b]``'s one committed position) queued for the draft
    (:meth:`Sequence.queue_aux`, no :class:`AuxRows` a sequence: an AuxRows apiece, its ``head`` and ``append_aux``
    in the commit took 61 µs a step at 64 sequences on the dev CPU, now ~20, both with the step's SeqResults). A
    host cost a plain engine does not pay: the speculative engine's plain steps were 3-6% dearer than the plain
    engine's on the H100 at 8-64 sequences (BENCHMARKS.md, 2026-12-07)."""
    for b, s in enumerate(seqs):
        s.queue_aux(aux, b, 1)


def gather_aux(seqs: list["Sequence"], extra: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Every queued aux row of ``seqs``, sequence by sequence in position order, as one tensor [T, W - extra]
    (``extra``: trailing columns that are not the draft's, the target's final state while the engine captures),
    and each sequence's row count; the queues are emptied. One join of the distinct step tensors and one index
    select, however many steps queued the rows."""
    srcs: list[torch.Tensor] = []
    offsets: dict[int, int] = {}  # id(src) -> its first row in the joined pool (srcs keeps each alive)
    index: list[int] = []
    counts: list[int] = []
    total = 0
    for s in seqs:
        n = 0
        for r in s.pending_aux:
            off = offsets.get(id(r.src))
            if off is None:
                off = offsets[id(r.src)] = total
                srcs.append(r.src)
                total += r.src.shape[0]
            index.extend(range(off + r.start, off + r.start + r.count))
            n += r.count
        counts.append(n)
        s.pending_aux.clear()
    pool = srcs[0] if len(srcs) == 1 else torch.cat(srcs, dim=0)  # [R_total, W]
    if extra:
        pool = pool[:, : pool.shape[1] - extra]  # [R_total, A]
    if index == list(range(total)):
        return pool, counts  # one step's rows, all of them, in order: no copy
    return pool.index_select(0, torch.tensor(index, dtype=torch.int64).to(pool.device)), counts  # [T, A]


@dataclass(eq=False)  # identity: a request is itself (list membership, removal)
class Sequence:
    """One request being generated.

    KV invariant between steps: the target (and, once caught up, the draft) cache holds positions
    0..num_tokens-2; the last token is the next forward's input. ``pending_aux`` holds the target's
    aux hidden states of the positions the draft has not consumed yet, as references to the rows of the steps
    that computed them (joined once, at the draft's catch-up, by :func:`gather_aux`, so steps without
    speculation never copy them).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # target KV positions written and valid
    draft_cached: int = 0  # draft KV positions written with target hidden states
    joined_positions: int = 0  # prompt positions the draft had not seen at its prefill (the policy's t_join)
    pending_aux: PendingAux = field(default_factory=PendingAux)  # positions draft_cached..num_cached-1, in order
    finish_reason: str | None = None
    stop_text_index: int | None = None  # where a stop string cuts the text
    generator: torch.Generator | None = None  # a CPU generator: one uniform per sampled token (sampling.draw)
    seed: int = 0  # base seed of verification draws
    step: int = 0  # engine steps taken (varies the verification seed)
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its tokens' full blocks (prefix_cache)
    blocks_registered: int = 0  # leading blocks of block_table offered to the prefix cache
    # capture_states: every aux row chunk [n_i, A + H], positions 0..num_cached-1 (a cached prefix's from the prefix cache)
    captured: list[torch.Tensor] | None = None

    def __post_init__(self):
        if self.params.capture_states:
            self.captured = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tail(self, n: int) -> list[int]:
        """The last ``n`` >= 1 tokens (without joining prompt and output when the output holds them)."""
        out = self.output_token_ids
        return out[-n:] if n <= len(out) else self.tokens[-n:]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preemption: forget the KV cache; the next prefill recomputes prompt + output."""
        self.block_table = []
        self.num_cached = 0
        self.blocks_registered = 0
        self.draft_cached = 0
        self.pending_aux.clear()
        if self.captured is not None:
            self.captured = []  # the recompute captures every position again
        self.status = SequenceStatus.WAITING

    def append_aux(self, aux: AuxRows | None) -> None:
        """Queue the aux rows of newly committed positions for the draft (their first A columns are the draft's;
        while the engine captures, the target's final normed state [H] follows). A captured sequence also keeps
        a copy of the whole rows."""
        if aux is not None:
            self.queue_aux(aux.src, aux.start, aux.count)

    def queue_aux(self, src: torch.Tensor, start: int, count: int) -> None:
        """Queue rows ``start .. start+count-1`` of a step's aux rows ``src`` [R, W] (see :meth:`append_aux`)."""
        if self.captured is not None:
            self.captured.append(src[start : start + count].clone())  # a view would keep the whole step's tensor alive
        self.pending_aux.append(src, start, count)

    def take_captured(self) -> torch.Tensor:
        """A finished captured sequence's rows [T, A + H] of positions 0..T-1 (its ``captured`` chunks joined; the
        list is gone after)."""
        rows = torch.cat(self.captured)  # never empty: the prefill committed the prompt's rows
        self.captured = None
        return rows

    def append_tokens(self, tokens: list[int], eos_id: int | None) -> list[int]:
        """Add accepted tokens up to the first stop condition; returns the tokens actually kept."""
        kept: list[int] = []
        p = self.params
        for tok in tokens:
            self.output_token_ids.append(int(tok))
            kept.append(int(tok))
            if (not p.ignore_eos and eos_id is not None and tok == eos_id) or tok in p.stop_token_ids:
                self.finish_reason = "stop"
                break
            if len(self.output_token_ids) >= p.max_tokens:
                self.finish_reason = "length"
                break
        return kept
