"""Engine-wide speculative and throughput metrics, exported under vLLM's names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagleray.serve.engine.prefix_cache import PrefixStats
from eagleray.serve.engine.sequence import SpecStats

VLLM_NAMES = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)


@dataclass
class StepTimes:
    """Decode throughput by step kind (prefill excluded). ``seconds``: the model's work (from staging to the tokens on
    the host); ``whole_seconds``: whole steps, scheduling and the outputs' host work included (what a step of this
    kind costs the engine: at 64 sequences on the H200 the host work after a plain step took as long as the step)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    whole_seconds: float = 0.0

    def add(self, tokens: int, seconds: float, whole_seconds: float | None = None) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.whole_seconds += seconds if whole_seconds is None else whole_seconds

    @property
    def whole_step_ms(self) -> float:
        return 1e3 * self.whole_seconds / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EngineMetrics:
    spec: SpecStats = field(default_factory=SpecStats)
    plain: StepTimes = field(default_factory=StepTimes)  # plain decode steps
    speculative: StepTimes = field(default_factory=StepTimes)  # speculative decode steps
    prefill: StepTimes = field(default_factory=StepTimes)
    num_requests_finished: int = 0
    num_preemptions: int = 0
    prefix: PrefixStats = field(default_factory=PrefixStats)  # the block manager's (LLMEngine shares it)
    watchdog_fired: bool = False
    speculation_enabled: bool = True
    current_k: int = 0
    started: float = field(default_factory=time.perf_counter)

    def record_verification(self, num_draft_tokens: int, num_accepted: int, max_pos: int) -> None:
        self.spec.record(num_draft_tokens, num_accepted, max_pos)

    @property
    def generation_tokens(self) -> int:
        return self.plain.tokens + self.speculative.tokens + self.prefill.tokens

    def snapshot(self) -> dict:
        """A flat dict of counters/gauges (vLLM names for the speculative counters)."""
        busy = self.plain.seconds + self.speculative.seconds + self.prefill.seconds
        return {
            "spec_decode_num_drafts": self.spec.num_drafts,
            "spec_decode_num_draft_tokens": self.spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec.accepted_per_pos),
            "spec_decode_mean_acceptance_length": self.spec.mean_acceptance_length,
            "spec_decode_watchdog_fired": int(self.watchdog_fired),
            "spec_decode_enabled": int(self.speculation_enabled),
            "spec_decode_current_k": self.current_k,
            "generation_tokens": self.generation_tokens,
            "tokens_per_s": self.generation_tokens / busy if busy > 0 else 0.0,
            "plain_decode_tokens_per_s": self.plain.tokens_per_s,
            "spec_decode_tokens_per_s": self.speculative.tokens_per_s,
            "plain_decode_steps": self.plain.steps,
            "plain_decode_step_ms": round(self.plain.whole_step_ms, 3),
            "spec_decode_steps": self.speculative.steps,
            "spec_decode_step_ms": round(self.speculative.whole_step_ms, 3),
            "prefill_steps": self.prefill.steps,
            "prefill_step_ms": round(self.prefill.whole_step_ms, 3),
            "busy_seconds": round(self.plain.whole_seconds + self.speculative.whole_seconds + self.prefill.whole_seconds, 3),
            "num_requests_finished": self.num_requests_finished,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix.queries,
            "prefix_cache_hits": self.prefix.hits,
        }
