"""What the engine hands back: per-request outputs (final or streamed deltas) and stop-string checks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagleray.serve.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """A request's state after a step: the delta since the previous output and the totals."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    text: str  # all generated text so far (cut at a stop string)
    delta_token_ids: list[int]  # tokens accepted in this step
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    spec: dict = field(default_factory=dict)  # per-request speculative statistics (SpecStats.to_dict)
    metrics: dict = field(default_factory=dict)  # ttft_s, elapsed_s, tokens_per_s


class Detokenizer:
    """Incremental text with stop-string detection (decodes the output so far; fine at these sizes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def update(self, seq: Sequence) -> tuple[str, str]:
        """Returns (full_text, delta_text); finishes ``seq`` with reason 'stop' at a stop string."""
        if self.tokenizer is None:
            return "", ""
        old = self._text.get(seq.seq_id, "")
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if seq.params.stop and seq.stop_text_index is None:
            longest = max(len(s) for s in seq.params.stop)
            start = max(0, len(old) - longest)
            hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
            if hits:
                seq.stop_text_index = min(hits)
                seq.finish_reason = "stop"
        if seq.stop_text_index is not None:
            text = text[:seq.stop_text_index]
        # Text of an incomplete UTF-8 sequence ends in U+FFFD; hold it back until it completes.
        stable = text if seq.finish_reason else text.rstrip("\ufffd")
        delta = stable[len(old):] if stable.startswith(old) else stable
        self._text[seq.seq_id] = stable
        return stable, delta

    def forget(self, seq: Sequence) -> None:
        self._text.pop(seq.seq_id, None)


def make_output(seq: Sequence, delta: list[int], text: str, delta_text: str) -> RequestOutput:
    now = time.perf_counter()
    elapsed = now - seq.arrival
    n = len(seq.output_token_ids)
    metrics = {"ttft_s": None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
               "elapsed_s": elapsed, "tokens_per_s": n / elapsed if elapsed > 0 else 0.0}
    return RequestOutput(seq.request_id, list(seq.prompt_token_ids), list(seq.output_token_ids), text, list(delta),
                         delta_text, seq.finished or seq.finish_reason is not None, seq.finish_reason,
                         seq.spec.to_dict(), metrics)
