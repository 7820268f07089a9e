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

    def __init__(self, model_name: str, window_s: float = 30.0, gauge_interval_s: float = 1.0):
        """``window_s``: the span of the token rate and tau; ``gauge_interval_s``: the rate and tau gauges are set at
        most this often while tokens stream (and at every finished request), not once per streamed event."""
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
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position (vLLM name).", ("position",)
        )
        self.tau = gauge(
            "eagleray_mean_acceptance_length", "tau = 1 + accepted/drafts over the recent window (mean acceptance length)."
        )
        self.tokens_per_s = gauge(
            "eagleray_generation_tokens_per_second",
            "Generated tokens per second over the recent window (counted as they are streamed).",
        )
        self.draft_info = gauge("eagleray_draft_info", "1 for the draft version being served.", ("draft_version",))
        self.watchdog = gauge("eagleray_watchdog_state", "Acceptance watchdog: 0 ok, 1 fired, 2 speculation off, 3 rolled back.")
        self.swaps = counter("eagleray_draft_swaps_total", "Draft hot-swap attempts by outcome.", ("outcome",))
        self.requests = counter("eagleray_requests_total", "Requests finished.")
        self.captured = counter("eagleray_capture_requests_total", "Finished requests captured as training rows.")
        self.capture_bytes = counter(
            "eagleray_capture_bytes_total", "Bytes of captured rows (bf16 hidden states + token ids) handed to the writer."
        )
        self.capture_dropped = counter(
            "eagleray_capture_dropped_total",
            "Captures dropped (the request itself was served), by reason: buffer_full, writer_failed, too_short, inconsistent.",
            ("reason",),
        )
        self.adapt_tau = gauge(
            "eagleray_adapt_tau",
            "The last adaptation decision's measured tau, by domain (traffic: held-out captured requests, control: the fixed set) and draft (champion = before, candidate = after).",
            ("domain", "draft"),
        )
        self.adapt_promoted = gauge("eagleray_adapt_promoted", "1 when the last adaptation decision moved the alias, else 0.")
        self.adapt_runs = counter(
            "eagleray_adapt_runs_total",
            "Scheduled adaptation runs (serving.adapt_schedule) by outcome: ok, failed, not_started.",
            ("outcome",),
        )
        self.adapt_time = gauge(
            "eagleray_adapt_last_timestamp_seconds", "When the last adaptation decision was taken (unix time)."
        )
        self.snapshot: dict[str, Any] = collections.defaultdict(float)
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int, int, int]] = collections.deque()  # (t, tokens, drafts, accepted)
        self._sums = [0, 0, 0]  # tokens, drafts, accepted over _recent (kept as entries come and go, never summed)
        self._gauge_interval_s = gauge_interval_s
        self._gauges_at = float("-inf")  # when the rate and tau gauges were last set
        self.gauge_sets = 0  # times they were set (tests: at most one per gauge_interval_s while streaming)
        self._clock = time.monotonic
        self._draft_version: str | None = None

    def record_tokens(self, n: int) -> None:
        """Tokens generated by one step of one request, counted when they are streamed (the windowed rate). Called
        for every streamed event in the engine's replica, whose threads the engine's step waits for on a small CPU
        machine (BENCHMARKS.md): constant work, not a pass over the window's entries nor two Ray gauge records."""
        if n:
            self._add(self._clock(), n, 0, 0, force=False)

    def record_request(self, num_output_tokens: int, spec: dict[str, Any]) -> None:
        """Count a finished request: its speculative statistics (its tokens were counted by :meth:`record_tokens`)."""
        drafts, proposed = int(spec.get("num_drafts", 0)), int(spec.get("num_draft_tokens", 0))
        accepted = int(spec.get("num_accepted_tokens", 0))
        self.requests.inc()
        self.snapshot["requests"] += 1
        for name, metric, value in (
            ("spec_decode_num_drafts", self.num_drafts, drafts),
            ("spec_decode_num_draft_tokens", self.num_draft_tokens, proposed),
            ("spec_decode_num_accepted_tokens", self.num_accepted, accepted),
        ):
            if value:
                metric.inc(value)
                self.snapshot[name] += value
        for pos, n in enumerate(spec.get("accepted_per_pos", [])):
            if n:
                self.accepted_per_pos.inc(n, tags={"position": str(pos)})
        self._add(self._clock(), 0, drafts, accepted, force=True)

    def _add(self, now: float, tokens: int, drafts: int, accepted: int, *, force: bool) -> None:
        self._recent.append((now, tokens, drafts, accepted))
        sums = self._sums
        sums[0], sums[1], sums[2] = sums[0] + tokens, sums[1] + drafts, sums[2] + accepted
        self._expire(now)
        tokens, drafts, accepted = sums
        span = max(now - self._recent[0][0], 1.0) if self._recent else self._window_s
        tau = 1.0 + accepted / drafts if drafts else 0.0
        self.snapshot["tau"] = tau
        self.snapshot["tokens_per_s"] = tokens / span
        if force or now - self._gauges_at >= self._gauge_interval_s:
            self._gauges_at = now
            self.gauge_sets += 1
            self.tau.set(tau)
            self.tokens_per_s.set(tokens / span)

    def _expire(self, now: float) -> None:
        """Drop the entries older than the window from the deque and from the sums."""
        sums = self._sums
        while self._recent and now - self._recent[0][0] > self._window_s:
            _, tokens, drafts, accepted = self._recent.popleft()
            sums[0], sums[1], sums[2] = sums[0] - tokens, sums[1] - drafts, sums[2] - accepted

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

    def record_capture(self, nbytes: int) -> None:
        self.captured.inc()
        self.capture_bytes.inc(nbytes)
        self.snapshot["capture_requests"] += 1
        self.snapshot["capture_bytes"] += nbytes

    def record_capture_drop(self, reason: str) -> None:
        self.capture_dropped.inc(tags={"reason": reason})
        self.snapshot[f"capture_dropped_{reason}"] += 1
        self.snapshot["capture_dropped"] += 1

    def record_adapt_run(self, outcome: str) -> None:
        self.adapt_runs.inc(tags={"outcome": outcome})
        self.snapshot[f"adapt_runs_{outcome}"] += 1

    def set_adapt(self, status: dict[str, Any]) -> None:
        """The adaptation loop's last decision (platform/capture_store.read_adapt_status)."""
        for domain in ("traffic", "control"):
            for draft, key in (("champion", "before"), ("candidate", "after")):
                tau = (status.get("tau") or {}).get(domain, {}).get(key)
                if tau is not None:
                    self.adapt_tau.set(float(tau), tags={"domain": domain, "draft": draft})
                    self.snapshot[f"adapt_tau_{domain}_{key}"] = float(tau)
        self.adapt_promoted.set(1.0 if status.get("promoted") else 0.0)
        self.adapt_time.set(float(status.get("at", 0.0)))
        self.snapshot["adapt_promoted"] = bool(status.get("promoted"))
        self.snapshot["adapt_at"] = float(status.get("at", 0.0))

    def to_dict(self) -> dict[str, Any]:
        now = self._clock()  # an idle replica's token rate decays to 0 instead of keeping its last value
        self._expire(now)
        tokens = self._sums[0]
        span = max(now - self._recent[0][0], 1.0) if tokens else 0.0
        self.snapshot["tokens_per_s"] = tokens / span if tokens else 0.0
        self.snapshot["window_tokens"], self.snapshot["window_s"] = tokens, span  # the rate's two terms
        return dict(self.snapshot)
