"""Request/sequence state: tokens, KV bookkeeping, stop checks and per-request spec statistics."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

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


@dataclass(eq=False)  # identity: a request is itself (list membership, removal)
class Sequence:
    """One request being generated.

    KV invariant between steps: the target (and, once caught up, the draft) cache holds positions
    0..num_tokens-2; the last token is the next forward's input. ``pending_aux`` holds the target's
    aux hidden states of the positions the draft has not consumed yet, as a list of [n_i, A] chunks
    (joined once, at the draft's catch-up, so steps without speculation never copy them).
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
    pending_aux: list[torch.Tensor] = field(default_factory=list)  # [n_i, A] chunks: positions draft_cached..num_cached-1
    finish_reason: str | None = None
    stop_text_index: int | None = None  # where a stop string cuts the text
    generator: torch.Generator | None = None  # plain sampling draws (T > 0)
    seed: int = 0  # base seed of verification draws
    step: int = 0  # engine steps taken (varies the verification seed)
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    captured: list[torch.Tensor] | None = None  # capture_states: every aux row chunk [n_i, A + H], positions 0..num_cached-1

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
        self.draft_cached = 0
        self.pending_aux = []
        if self.captured is not None:
            self.captured = []  # the recompute captures every position again
        self.status = SequenceStatus.WAITING

    def append_aux(self, aux: torch.Tensor | None, extra: int = 0) -> None:
        """Queue aux states [n, A] of newly committed positions for the draft.

        ``extra``: trailing columns that are not the draft's (the target's final normed state [n, H] while
        the engine captures); a captured sequence keeps the whole rows, the draft gets the first A columns."""
        if aux is None:
            return
        if self.captured is not None:
            self.captured.append(aux.clone())  # a view would keep the whole step's tensor alive
        self.pending_aux.append(aux[:, : aux.shape[-1] - extra] if extra else aux)

    def take_aux(self) -> torch.Tensor:
        """All queued aux states [n, A], in position order; the queue is emptied."""
        chunks, self.pending_aux = self.pending_aux, []
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)

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
