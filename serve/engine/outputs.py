"""What the engine hands back: per-request outputs (final or streamed deltas) and stop-string checks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagleray.serve.engine.sequence import Sequence


@dataclass
class CapturedHidden:
    """The target's hidden states of a finished request that asked for them (``capture_states``).

    Row t belongs to token t of ``prompt + output`` for t < T = the positions the target ran (every
    token but the last): ``aux`` [T, n_aux*H] the aux layers' inputs in ascending id order (what the
    draft read), ``final`` [T, H] the state after the target's final norm (its logits are lm_head(final)).
    """

    aux: torch.Tensor  # [T, n_aux*H]
    final: torch.Tensor  # [T, H]
    aux_layer_ids: list[int]

    @classmethod
    def of(cls, rows: torch.Tensor, width: int, aux_layer_ids: list[int]) -> "CapturedHidden":
        """A finished captured sequence's rows [T, A + H] (:meth:`Sequence.take_captured`), split into the draft's aux
        and the target's final state (the last ``width`` columns)."""
        return cls(rows[:, :-width], rows[:, -width:], list(aux_layer_ids))


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
    hidden: CapturedHidden | None = None  # final output of a request with capture_states only


class Detokenizer:
    """Incremental text with stop-string detection.

    A step decodes one window: the tokens from an *anchor* (a few tokens back) to the end, and emits
    what that window's text gained since the last step, so a step costs about one short decode
    instead of decoding the whole output again. Every ``REANCHOR`` tokens the anchor moves up (one
    more decode). Text of an incomplete UTF-8 sequence (a trailing U+FFFD) is held back until it
    completes or the request finishes.
    """

    REANCHOR = 16  # tokens in a window before the anchor moves up
    CONTEXT = 4  # tokens of the old window kept before the new anchor (merges across token boundaries)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._state: dict[int, _DetokState] = {}

    def update(self, seq: Sequence) -> tuple[str, str]:
        """Returns (full_text, delta_text); finishes ``seq`` with reason 'stop' at a stop string."""
        return self.update_many([seq])[0]

    def update_many(self, seqs: list[Sequence]) -> list[tuple[str, str]]:
        """:meth:`update` for every sequence of a step, their windows decoded in one call of the tokenizer's
        backend (a short decode costs ~9 us of Python and Rust overhead a call, ~2 us in a batch: at 128 sequences
        a step on the H200 spent more time building outputs than running the model)."""
        if self.tokenizer is None:
            return [("", "")] * len(seqs)
        states = [self._state.setdefault(seq.seq_id, _DetokState()) for seq in seqs]
        olds = [st.text for st in states]
        live = [i for i, st in enumerate(states) if not st.stopped]
        windows = self._decode_many([seqs[i].output_token_ids[states[i].anchor :] for i in live])
        moved = []
        for i, window in zip(live, windows):
            seq, st = seqs[i], states[i]
            ids = seq.output_token_ids
            if len(window) > len(st.seen) and (not window.endswith("\ufffd") or seq.finish_reason):
                st.text, st.seen = st.text + window[len(st.seen) :], window
                if len(ids) - st.anchor > self.REANCHOR:
                    st.anchor = len(ids) - self.CONTEXT
                    moved.append(i)
        for i, seen in zip(moved, self._decode_many([seqs[i].output_token_ids[states[i].anchor :] for i in moved])):
            states[i].seen = seen
        decoded = set(live)
        return [
            self._stops(seq, st, old) if i in decoded else (old, "") for i, (seq, st, old) in enumerate(zip(seqs, states, olds))
        ]

    def _stops(self, seq: Sequence, st: _DetokState, old: str) -> tuple[str, str]:
        """(text, delta) of a sequence whose window was decoded; finishes it with reason 'stop' at a stop string."""
        text = st.text
        if seq.params.stop and seq.stop_text_index is None:
            longest = max(len(s) for s in seq.params.stop)
            start = max(0, len(old) - longest)
            hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
            if hits:
                seq.stop_text_index = min(hits)
                seq.finish_reason = "stop"
        if seq.stop_text_index is not None:
            text = st.text = text[: seq.stop_text_index]
            st.stopped = True
        delta = text[len(old) :] if text.startswith(old) else text
        return text, delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _decode_many(self, windows: list[list[int]]) -> list[str]:
        """Each window's text: one batch call of a fast tokenizer's Rust backend (the same decode, without the
        clean-up of tokenization spaces it does not ask for), else one ``decode`` a window."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if hasattr(backend, "decode_batch") and not getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return backend.decode_batch(windows, skip_special_tokens=True)
        return [self._decode(w) for w in windows]

    def forget(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)


class _DetokState:
    """Emitted text, the window anchor and the window text already emitted, of one sequence."""

    __slots__ = ("text", "anchor", "seen", "stopped")

    def __init__(self):
        self.text, self.anchor, self.seen, self.stopped = "", 0, "", False


def make_output(seq: Sequence, delta: list[int], text: str, delta_text: str) -> RequestOutput:
    now = time.perf_counter()
    elapsed = now - seq.arrival
    n = len(seq.output_token_ids)
    metrics = {
        "ttft_s": None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
        "elapsed_s": elapsed,
        "tokens_per_s": n / elapsed if elapsed > 0 else 0.0,
    }
    return RequestOutput(
        seq.request_id,
        seq.prompt_token_ids,  # never changed after the request arrives: shared, not copied every step
        list(seq.output_token_ids),
        text,
        list(delta),
        delta_text,
        seq.finished or seq.finish_reason is not None,
        seq.finish_reason,
        seq.spec.to_dict(),
        metrics,
    )
