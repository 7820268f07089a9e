"""The acceptance watchdog: :class:`AcceptanceWatchdog` averages τ = accepted + 1 over the last ``window``
verifications; when the mean stays below ``min_tau`` (an untrained or mis-wired draft gives exactly 1.0) it logs a
warning once, sets a flag exported as ``spec_decode_watchdog_fired`` and calls the action callback with "warn",
"disable" or "rollback"."""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from eagleray.platform.config.schemas import PolicyConfig

logger = logging.getLogger(__name__)


class AcceptanceWatchdog:
    def __init__(self, config: PolicyConfig, on_fire: Callable[[str, float], None] | None = None):
        self.window = config.watchdog_window
        self.min_tau = config.watchdog_min_tau
        self.action = config.on_low_acceptance
        self.on_fire = on_fire
        self._taus: deque[int] = deque(maxlen=self.window)
        self.fired = False

    @property
    def mean_tau(self) -> float:
        return sum(self._taus) / len(self._taus) if self._taus else 0.0

    def observe(self, num_accepted: int) -> bool:
        """Record one verification; returns True when the watchdog fires (once)."""
        self._taus.append(num_accepted + 1)
        if self.fired or len(self._taus) < self.window or self.mean_tau >= self.min_tau:
            return False
        self.fired = True
        logger.warning(
            "speculative acceptance watchdog: mean acceptance length τ=%.3f over the last %d verifications "
            "is below %.3f; the draft is untrained, mis-wired (EAGLE vs EAGLE3?) or stale. action=%s",
            self.mean_tau,
            self.window,
            self.min_tau,
            self.action,
        )
        if self.on_fire is not None:
            self.on_fire(self.action, self.mean_tau)
        return True

    def reset(self) -> None:
        self._taus.clear()
        self.fired = False
