"""What a speculative step works with and hands back: the step's clock, the context (runners, verifier, the
last step's drafting and catch-up times for the adaptive policy, the chain step graphs), a sequence's result, and
the per-row sampling parameters."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eagleray.platform.models.spec_graphs import ChainStepGraphs
from eagleray.serve.engine.model_runner import DraftRunner, TargetRunner
from eagleray.serve.engine.profile import StepProfiler
from eagleray.serve.engine.sequence import AuxRows, Sequence
from eagleray.serve.engine.startup import CpuThreads
from eagleray.serve.engine.verifier import Verifier


class StepClock:
    """Marks in the step's stream: CUDA events on CUDA (read after the step's one synchronisation, so GPU
    time lands in the phase that queued it), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class SpecContext:
    target: TargetRunner
    draft: DraftRunner
    verifier: Verifier
    prof: StepProfiler
    threads: CpuThreads  # the engine's: a wide forward's GEMMs get torch's threads (for_rows)
    aux_checked: bool = False
    draft_seconds: float = 0.0  # the last step's drafting (catch-up + chain or tree), for the adaptive policy
    lag_seconds: float = 0.0  # the last step's catch-up over plain steps' positions (kept out of drafting)
    join_seconds: float = 0.0  # the share of lag_seconds spent on prompt positions: the draft's prefill of new sequences
    join_positions: int = 0  # the prompt positions that catch-up covered (join_seconds' positions)
    lag_prompt: tuple[float, int] = (0.0, 0)  # of the rows of the last long catch-up, the prompt positions' share, count
    clock: StepClock | None = None
    lag_marks: tuple | None = None  # a catch-up over more than a step's positions (after plain steps), not drafting cost
    graphs: ChainStepGraphs | None = None  # CUDA rows: greedy chain steps as two graphs per (batch bucket, k)
    measured: bool = True  # False when the last step also captured a graph (its times are not the step's cost)

    def __post_init__(self):
        self.clock = self.clock or StepClock(self.target.device)

    def record_times(self, m0, m1, measured: bool = True) -> None:
        """Draft seconds (m0..m1, less a long catch-up) of the step just done; the engine takes the rest of the
        step as its verify cost."""
        lag = self.clock.seconds(*self.lag_marks) if self.lag_marks is not None else 0.0
        self.lag_marks, self.lag_seconds = None, lag
        share, self.join_positions = self.lag_prompt
        self.join_seconds, self.lag_prompt = lag * share, (0.0, 0)
        self.draft_seconds = max(self.clock.seconds(m0, m1) - lag, 0.0)
        self.measured = measured


@dataclass
class SeqResult:
    """Outcome of verification for one sequence."""

    tokens: list[int]  # accepted drafts + one recovered/bonus token
    aux: AuxRows | None  # [len(tokens), A] target aux states of the positions these tokens follow
    num_draft_tokens: int
    num_accepted: int
    src_positions: list[int] | None = None  # tree: cache positions of the accepted path (to compact)


@dataclass
class RowParams:
    temperature: torch.Tensor  # [B] f32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] f32
    seed: torch.Tensor  # [B] int64, varies per step

    @classmethod
    def of(cls, seqs: list[Sequence], device) -> "RowParams":
        seeds = [(s.seed * 1_000_003 + s.step * 7919 + len(s.output_token_ids)) % (1 << 62) for s in seqs]
        ints = torch.tensor([[s.params.top_k for s in seqs], seeds], dtype=torch.int64).to(device)  # [2, B]: one copy
        floats = torch.tensor([[s.params.temperature for s in seqs], [s.params.top_p for s in seqs]], dtype=torch.float32).to(
            device
        )  # [2, B]
        return cls(floats[0], ints[0], floats[1], ints[1])
