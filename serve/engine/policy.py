"""Run-time policy: the acceptance watchdog and adaptive speculation.

- :class:`AcceptanceWatchdog` averages τ = accepted + 1 over the last ``window`` verifications; when
  the mean stays below ``min_tau`` (an untrained or mis-wired draft gives exactly 1.0) it logs a
  warning once, sets a flag exported as ``spec_decode_watchdog_fired`` and calls the action
  callback with "warn", "disable" or "rollback".
- :class:`AdaptivePolicy` picks each decode step's draft length k (0 = a plain step). It times
  occasional plain steps, lowers k (chain) or turns speculation off when speculative decoding
  delivers fewer tokens/s than plain decoding, probes speculation now and then while it is off,
  and turns it back on (or raises k) when it pays.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from eagleray.platform.schemas import PolicyConfig

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
        logger.warning("speculative acceptance watchdog: mean acceptance length τ=%.3f over the last %d verifications "
                       "is below %.3f; the draft is untrained, mis-wired (EAGLE vs EAGLE3?) or stale. action=%s",
                       self.mean_tau, self.window, self.min_tau, self.action)
        if self.on_fire is not None:
            self.on_fire(self.action, self.mean_tau)
        return True

    def reset(self) -> None:
        self._taus.clear()
        self.fired = False


class AdaptivePolicy:
    """Chooses k per decode step from measured tokens/s of plain and speculative steps."""

    def __init__(self, k_max: int, adaptive: bool = True, probe_interval: int = 32, margin: float = 0.05,
                 can_lower_k: bool = True, ema: float = 0.3):
        self.k_max = k_max
        self.k = k_max
        self.adaptive = adaptive
        self.probe_interval = probe_interval
        self.margin = margin
        self.can_lower_k = can_lower_k
        self.alpha = ema
        self.speculating = True
        self.disabled = False  # forced off (watchdog action): no probes
        self.rate: dict[int, float] = {}  # k -> EMA tokens/s (k = 0: plain)
        self._steps = 0

    def choose(self) -> int:
        """k for the next decode step; 0 means a plain step."""
        if self.disabled:
            return 0
        self._steps += 1
        probe = self.adaptive and self._steps % self.probe_interval == 0
        if self.speculating:
            if probe and (self._steps // self.probe_interval) % 2 == 1 and self.can_lower_k and self.k < self.k_max:
                return self.k + 1  # probe a longer draft
            return 0 if probe else self.k
        return self.k if probe else 0

    def observe(self, k: int, tokens: int, seconds: float) -> None:
        """Record a decode step's throughput and re-decide."""
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        old = self.rate.get(k)
        self.rate[k] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        if self.adaptive and not self.disabled:
            self._decide()

    def _decide(self) -> None:
        plain, spec = self.rate.get(0), self.rate.get(self.k)
        if plain is None or spec is None:
            return
        longer = self.rate.get(self.k + 1)
        if self.speculating and longer is not None and longer > spec * (1 + self.margin):
            self.k += 1
            logger.info("adaptive speculation: raising k to %d (%.1f tok/s)", self.k, longer)
        elif self.speculating and spec < plain * (1 - self.margin):
            if self.can_lower_k and self.k > 1:
                self.k -= 1
                logger.info("adaptive speculation: lowering k to %d (spec %.1f < plain %.1f tok/s)", self.k, spec, plain)
            else:
                self.speculating = False
                logger.warning("adaptive speculation: turning speculation off (spec %.1f < plain %.1f tok/s)", spec, plain)
        elif not self.speculating and spec > plain * (1 + self.margin):
            self.speculating = True
            logger.info("adaptive speculation: turning speculation back on (spec %.1f > plain %.1f tok/s)", spec, plain)

    def disable(self, reason: str) -> None:
        self.disabled = True
        self.speculating = False
        logger.warning("speculation disabled: %s", reason)

    def enable(self) -> None:
        self.disabled = False
        self.speculating = True
        self.k = self.k_max
        self.rate.clear()
