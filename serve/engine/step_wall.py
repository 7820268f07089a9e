"""The adaptive policy's clock: a decode step costs the wall time from its start to the next step's start.

A benchmark (and a user) reads tokens per wall second; the engine's own clock marks inside a step miss what
happens between two steps (the caller's loop, output delivery, admission) and the part of a step after its outputs
(the policy's and the metrics' accounting). So a decode step's observation waits for the next step to start
(:meth:`StepWall.begin`) and the policy is told the whole interval: for a plain step ``t_plain``, for a speculative
step the interval less its drafting and its catch-up after plain steps (``lag``: the price of having switched, see
:mod:`~eagleray.serve.engine.policy`). A prefill step ends the decode step before it, and is not a decode cost.
When the engine runs out of work (:meth:`StepWall.idle`) the pending step is told its own time inside the engine:
waiting for requests is no step's cost.

    wall = StepWall()                      # the engine owns one (``clock``: injected in tests)
    started = wall.begin()                 # a step starts: the previous decode step is observed
    wall.defer(started, whole, observe, *args)   # after a decode step: observe(*args, seconds) at the next begin()
    wall.idle()                            # no work: observe the pending step with its ``whole`` seconds
    wall.drop()                            # a draft swapped in: the pending step is no one's cost
"""

from __future__ import annotations

import time
from typing import Callable


class StepWall:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._pending: tuple | None = None  # (start, whole, observe, args) of the last decode step
        self.intervals = 0  # decode steps observed on the interval (not ``whole``: tests, reports)

    def begin(self) -> float:
        """A step starts now -> its start; the pending decode step is observed with the interval up to now."""
        now = self.clock()
        if self._pending is not None:
            start, whole, observe, args = self._pending
            self._pending = None
            self.intervals += 1
            observe(*args, max(now - start, whole))
        return now

    def defer(self, start: float, whole: float, observe: Callable, *args) -> None:
        """A decode step that started at ``start`` and took ``whole`` seconds inside the engine: ``observe(*args,
        seconds)`` once the next step starts (or with ``whole`` at :meth:`idle`)."""
        self._pending = (start, whole, observe, args)

    def drop(self) -> None:
        """Forget the pending step unobserved: a draft swapped in after it (the swap's load time is in its interval,
        and its cost was the previous draft's, which the policy has just forgotten)."""
        self._pending = None

    def idle(self) -> bool:
        """The engine has no work: the pending step is observed with its time inside the engine (no idle time)
        -> False (no work)."""
        if self._pending is not None:
            _, whole, observe, args = self._pending
            self._pending = None
            observe(*args, whole)
        return False
