"""Serving metrics through Ray Serve's Prometheus export, with vLLM's speculative-decoding names.

Ray forbids ``:`` in metric names, prefixes every exported name with ``ray_`` and its Prometheus
exporter ends counters with ``_total``, so vLLM's ``vllm:spec_decode_num_drafts`` is scraped as
``ray_spec_decode_num_drafts_total`` (likewise ``ray_spec_decode_num_draft_tokens_total``,
``ray_spec_decode_num_accepted_tokens_total``, ``ray_spec_decode_num_accepted_tokens_per_pos_total``
with label ``position``). eagleray's own series are scraped as ``ray_eagleray_*`` (counters already
named ``*_total`` keep one suffix). Every series also carries Ray Serve's ``application``,
``deployment`` and ``replica`` labels and ``model_name``. Every value is also kept in
:attr:`ServeMetrics.snapshot` so the engine deployment can report it (``GET /health``).
tests/integration/test_serve_registry_metrics.py scrapes them from Ray's metrics export port.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from ray.serve import metrics as serve_metrics

WATCHDOG_STATES = {"ok": 0, "warming_up": 0, "fired": 1, "speculation_disabled": 2, "rolled_back": 3}


class ServeMetrics:
    """Counters and gauges of one engine replica (label ``model_name``)."""

    def __init__(self, model_name: str, window_s: float = 30.0):
        tags = {"model_name": model_name}
        keys = ("model_name",)

        def counter(name: str, desc: str, extra: tuple[str, ...] = ()):
            metric = serve_metrics.Counter(name, description=desc, tag_keys=keys + extra)
            metric.set_default_tags(dict(tags))  # Ray adds its serve tags to the dict it is given
            return metric

        def gauge(name: str, desc: str, extra: tuple[str, ...] = ()):
            metric = serve_metrics.Gauge(name, description=desc, tag_keys=keys + extra)
            metric.set_default_tags(dict(tags))  # Ray adds its serve tags to the dict it is given
            return metric

        self.num_drafts = counter("spec_decode_num_drafts", "Verification steps that carried draft tokens (vLLM name).")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed (vLLM name).")
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted (vLLM name).")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (vLLM name).", ("position",))
        self.tau = gauge("eagleray_mean_acceptance_length", "tau = 1 + accepted/drafts over the recent window (mean acceptance length).")
        self.tokens_per_s = gauge("eagleray_generation_tokens_per_second", "Generated tokens per second over the recent window.")
        self.draft_info = gauge("eagleray_draft_info", "1 for the draft version being served.", ("draft_version",))
        self.watchdog = gauge("eagleray_watchdog_state", "Acceptance watchdog: 0 ok, 1 fired, 2 speculation off, 3 rolled back.")
        self.swaps = counter("eagleray_draft_swaps_total", "Draft hot-swap attempts by outcome.", ("outcome",))
        self.errors = counter("eagleray_request_errors_total", "Requests answered with an error, by HTTP status.", ("status",))
        self.requests = counter("eagleray_requests_total", "Requests finished.")
        self.snapshot: dict[str, Any] = collections.defaultdict(float)
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int, int, int]] = collections.deque()  # (t, tokens, drafts, accepted)
        self._draft_version: str | None = None

    def record_request(self, num_output_tokens: int, spec: dict[str, Any]) -> None:
        """Count a finished request: its tokens and its speculative statistics."""
        drafts, proposed = int(spec.get("num_drafts", 0)), int(spec.get("num_draft_tokens", 0))
        accepted = int(spec.get("num_accepted_tokens", 0))
        self.requests.inc()
        self.snapshot["requests"] += 1
        for name, metric, value in (("spec_decode_num_drafts", self.num_drafts, drafts),
                                    ("spec_decode_num_draft_tokens", self.num_draft_tokens, proposed),
                                    ("spec_decode_num_accepted_tokens", self.num_accepted, accepted)):
            if value:
                metric.inc(value)
                self.snapshot[name] += value
        for pos, n in enumerate(spec.get("accepted_per_pos", [])):
            if n:
                self.accepted_per_pos.inc(n, tags={"position": str(pos)})
        now = time.monotonic()
        self._recent.append((now, num_output_tokens, drafts, accepted))
        self._refresh(now)

    def _refresh(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self._window_s:
            self._recent.popleft()
        tokens = sum(r[1] for r in self._recent)
        drafts = sum(r[2] for r in self._recent)
        accepted = sum(r[3] for r in self._recent)
        span = max(now - self._recent[0][0], 1.0) if self._recent else self._window_s
        tau = 1.0 + accepted / drafts if drafts else 0.0
        self.tau.set(tau)
        self.tokens_per_s.set(tokens / span)
        self.snapshot["tau"] = tau
        self.snapshot["tokens_per_s"] = tokens / span

    def set_draft(self, version: str | None) -> None:
        if self._draft_version is not None:
            self.draft_info.set(0, tags={"draft_version": self._draft_version})
        self._draft_version = version
        self.draft_info.set(1, tags={"draft_version": version or "none"})
        self.snapshot["draft_version"] = version

    def set_watchdog(self, state: str) -> None:
        if state not in WATCHDOG_STATES:
            raise ValueError(f"unknown watchdog state {state!r}; known: {sorted(WATCHDOG_STATES)}")
        self.watchdog.set(WATCHDOG_STATES[state])
        self.snapshot["watchdog_state"] = state

    def record_swap(self, outcome: str) -> None:
        """outcome: 'swapped', 'refused_guard', 'refused_smoke', 'failed_load', 'rolled_back', 'unchanged'."""
        self.swaps.inc(tags={"outcome": outcome})
        self.snapshot[f"swaps_{outcome}"] += 1

    def record_error(self, status: int) -> None:
        self.errors.inc(tags={"status": str(status)})
        self.snapshot[f"errors_{status}"] += 1

    def to_dict(self) -> dict[str, Any]:
        return dict(self.snapshot)
