"""The adaptive policy's cost tables (:mod:`~eagleray.serve.engine.policy`): per batch-size bucket, the latest step
costs (medians of the last ``RECENT``), the kept decision and the run's sums for reports; and ``at_k``, a cost per k
read between the measured ones."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

RECENT = 9  # a cost is the median of this many latest steps


def at_k(table: dict[int, float], k: int, at_zero: float | None, between: str = "line") -> float:
    """A cost measured per k, at ``k``: measured; between two measured k, on the line joining them (``between``
    "line") or the cheaper of the two ("min": an optimistic guess, so that the k gets tried and measured); below
    every measured k, on the line from ``at_zero`` (the cost at k = 0; None: the smallest measured k's); above
    every measured k, the largest's."""
    if k in table:
        return table[k]
    lower = [j for j in table if j < k]
    upper = [j for j in table if j > k]
    if not upper:
        return table[max(lower)]
    hi = min(upper)
    if lower and between == "min":
        return min(table[max(lower)], table[hi])
    lo, at_lo = (max(lower), table[max(lower)]) if lower else (0, at_zero if at_zero is not None else table[hi])
    return at_lo + (table[hi] - at_lo) * (k - lo) / (hi - lo)


def bucket(batch: int) -> int:
    """Batch-size bucket of the cost tables: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class Costs:
    """Medians (seconds per step) of one batch-size bucket's latest steps."""

    verify_by_k: dict[int, float] = field(default_factory=dict)  # target forward + verification, per draft length k
    draft_by_k: dict[int, float] = field(default_factory=dict)  # the whole drafting of k tokens (or of the tree)
    plain_steps: int = 0
    spec_steps: int = 0
    recent: dict[tuple, deque] = field(default_factory=dict)  # the latest seconds of each cost above
    plain_recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # the latest plain steps' seconds
    plain_median: float | None = None  # their median, as of the last read of ``plain``
    plain_stale: bool = False  # a plain step came since
    decision: tuple[int, float] | None = None  # the last (k, predicted speedup) of best(), kept while k = 0
    decision_age: int = 0  # choices since
    probe_ratio: float | None = None  # a probe's cost in plain steps (the probe interval's scale), kept with decision
    quiet_due: float = 0.0  # with a kept plain decision: the probe is due once the policy's since_probe reaches it
    since_plain: int = 0  # speculative choices since the last plain step (PLAIN_REFRESH)
    chosen: dict[int, int] = field(default_factory=dict)  # decode steps chosen at each k (0: plain), for reports
    wall: dict[int, list] = field(default_factory=dict)  # k -> [steps, sequences, tokens, seconds]: the run's sums
    predicted: list = field(default_factory=lambda: [0, 0.0])  # [speculative decisions, sum of their predictions]

    @property
    def plain(self) -> float | None:
        """t_plain: the median of the latest ``RECENT`` plain steps (None before the first), computed when read: a
        plain step's observation only queues its time (a median every step was a fifth of the policy's host time
        a plain step, which a speculative engine's plain steps pay and a plain engine's do not)."""
        if self.plain_stale:
            self.plain_median, self.plain_stale = statistics.median(self.plain_recent), False
        return self.plain_median

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A plain step of ``batch`` sequences took ``seconds``."""
        self.plain_recent.append(seconds)
        self.plain_stale = True
        self.plain_steps += 1
        self.since_plain = 0
        add_wall(self, 0, batch, batch, seconds)

    def update(self, key: tuple, seconds: float) -> float:
        """Record a step's ``seconds`` for the cost ``key`` -> the median of its latest ``RECENT``."""
        window = self.recent.setdefault(key, deque(maxlen=RECENT))
        window.append(seconds)
        return statistics.median(window)


def add_wall(c: Costs, k: int, seqs: int, tokens: int, seconds: float) -> None:
    """The run's sums of the steps at k: steps, sequences, tokens emitted, wall seconds (the report's measured side)."""
    w = c.wall.get(k)
    if w is None:
        w = c.wall[k] = [0, 0, 0, 0.0]
    w[0] += 1
    w[1] += seqs
    w[2] += tokens
    w[3] += seconds
