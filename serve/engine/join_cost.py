"""t_join's rate: the draft's catch-up over the prompts of joined sequences, in seconds per token emitted.

The adaptive policy (:mod:`~eagleray.serve.engine.policy`) charges a speculative step the draft's prefill of the
sequences that join meanwhile. That cost is paid once a sequence, when the first speculative step after its prefill
catches the draft up on its prompt, while the sequence's tokens come over its whole life, so the rate is the product of
two measurements that do not depend on when the policy speculates:

    per token = (catch-up seconds / prompt positions caught up)  x  (prompt positions joined / tokens emitted)

the first over the last ``CATCH_UPS`` catch-ups of joined prompts, the second over the lives of the last ``LIVES``
finished sequences (the prompt positions the draft had not seen at its prefill - a prefix-cache match starts it caught
up as far - and the tokens it emitted); before any has finished, over the positions joined and the tokens emitted so
far (an overestimate while the first sequences are young). Sequences that join and leave while the policy decodes
plain count too: speculating would have paid their catch-up.

Measured as catch-up seconds over the tokens emitted since the 32 speculative steps before instead, the first
speculative steps after four 512-token prompts joined on the CPU charged their whole catch-up (155 ms quiet, 0.6 s
beside another job) to their own few tokens: 40 ms a token where the sequences' lives made it 0.7 ms, and at 4
sequences the policy decoded plain for the rest of the run (7 speculative steps of 500: no later speculative step
came to dilute the window), its four requests finishing together and their successors' prompts prefilling together
(TTFT 0.54x vLLM's).

    cost = JoinCost()
    cost.joined(positions, tokens)      # a prefill step: prompt positions the draft has not seen, its first tokens
    cost.emitted(tokens)                # a decode step's tokens
    cost.finished(positions, tokens)    # a sequence finished: its prompt positions joined, the tokens it emitted
    cost.caught_up(seconds, positions)  # a catch-up that covered ``positions`` prompt positions in ``seconds``
    cost.per_token                      # seconds a token emitted
"""

from __future__ import annotations

from collections import deque

LIVES = 64  # positions per token: over this many finished sequences' lives
CATCH_UPS = 32  # seconds per position: over this many catch-ups of joined prompts


class _Pairs:
    """The last ``size`` pairs of numbers added, and the sums of their first and second numbers."""

    def __init__(self, size: int):
        self.size = size
        self.pairs: deque = deque()
        self.first = 0.0
        self.second = 0.0

    def add(self, first: float, second: float) -> None:
        self.pairs.append((first, second))
        self.first += first
        self.second += second
        if len(self.pairs) > self.size:
            old_first, old_second = self.pairs.popleft()
            self.first -= old_first
            self.second -= old_second


class JoinCost:
    def __init__(self):
        self._lives = _Pairs(LIVES)  # (prompt positions joined, tokens emitted) of finished sequences
        self._catch_ups = _Pairs(CATCH_UPS)  # (seconds, prompt positions) of catch-ups of joined prompts
        self._joined = 0  # prompt positions joined and tokens emitted since the start (before any sequence finished)
        self._emitted = 0

    def joined(self, positions: int, tokens: int) -> None:
        """A prefill step: its sequences' prompt positions the draft has not seen, and the tokens it emitted."""
        self._joined += positions
        self._emitted += tokens

    def emitted(self, tokens: int) -> None:
        """A decode step emitted ``tokens``."""
        self._emitted += tokens

    def finished(self, positions: int, tokens: int) -> None:
        """A sequence finished: the prompt positions it joined with and the tokens it emitted in its life."""
        self._lives.add(positions, tokens)

    def caught_up(self, seconds: float, positions: int) -> None:
        """The draft caught up on ``positions`` prompt positions of joined sequences in ``seconds``."""
        if positions > 0:
            self._catch_ups.add(seconds, positions)

    @property
    def seconds_per_position(self) -> float:
        return self._catch_ups.first / self._catch_ups.second if self._catch_ups.second else 0.0

    @property
    def positions_per_token(self) -> float:
        if self._lives.second:
            return self._lives.first / self._lives.second
        return self._joined / self._emitted if self._emitted else 0.0

    @property
    def per_token(self) -> float:
        """The draft's catch-up over joined prompts, seconds per token emitted (0 until a catch-up is measured)."""
        return self.seconds_per_position * self.positions_per_token
