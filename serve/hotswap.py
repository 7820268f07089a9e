"""Draft hot-swap: load beside the serving draft, guard, smoke-verify, switch between engine steps.

    swap(source):
        resolve source -> local dir + version label         (models:/name@alias or a directory)
        compatibility guard (platform.guard)                -> refused_guard, old draft keeps serving
        load the candidate beside the old one (own thread)  -> failed_load
        between two steps: smoke verification                -> refused_smoke
            (a few greedy tokens: speculative output == plain output, same target weights)
        between the same two steps: engine.swap_draft        -> swapped

In-flight requests are not failed: the engine preempts running sequences and recomputes them
with the new draft (greedy output is unchanged; sampled output keeps the target distribution).
Every outcome is logged and counted in ``eagleray_draft_swaps_total{outcome=...}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from eagleray.platform.checkpoints.guard import check_compatibility
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError, Problem
from eagleray.platform.models.eagle3 import Eagle3Draft
from eagleray.platform.registry import ResolvedDraft, resolve_draft
from eagleray.serve.engine import AsyncEngine, LLMEngine, load_draft
from eagleray.serve.prometheus import ServeMetrics
from eagleray.serve.serving_config import ServingConfig
from eagleray.serve.smoke import smoke_verify

logger = logging.getLogger(__name__)


class SwapRefused(EaglerayError):
    """A candidate draft was not switched in; ``outcome`` says at which stage."""

    def __init__(self, outcome: str, message: str, problems: list[Problem] | None = None):
        self.outcome = outcome
        self.problems = list(problems or [])
        super().__init__(message)


@dataclass
class LoadedDraft:
    draft: Eagle3Draft
    resolved: ResolvedDraft
    aux_layer_ids: list[int]

    @property
    def version(self) -> str:
        return self.resolved.version


@dataclass
class SwapRecord:
    source: str
    outcome: str
    version: str | None
    message: str
    seconds: float
    at: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "outcome": self.outcome,
            "version": self.version,
            "message": self.message,
            "seconds": round(self.seconds, 3),
            "at": self.at,
        }


class AliasFollower:
    """The alias poller's rule, apart from the polling: swap when the alias points at a version other than the
    serving one, once per position of the alias.

    A version the poller has handled (served, swapped to, refused, failed) is not tried again while the alias
    stays on it: a refusal is not retried every poll, and a rollback (the watchdog's or the admin route's) or an
    admin swap is not undone by the poller. Once the alias is seen on another version, that one is handled next.

    ``DraftManager.swap`` resolves the alias again, so the alias can move between the poll and the swap: what
    counts as handled is the version the swap found (its record's ``version``), not the one the poll saw. A swap
    that found the serving version (``unchanged``) did nothing for the version the poll saw; taking that one as
    handled would leave the poller deaf to it for good once the alias came back to it (a promotion never served).
    """

    def __init__(self, uri: str, serving: str | None) -> None:
        self.uri = uri
        self.handled = serving  # the alias version the poller is done with, while the alias stays on it
        self.seen: str | None = None  # the version the last poll found the alias on
        self.seen_at: float | None = None

    def wants(self, alias_version: str, serving: str | None) -> bool:
        """Whether to swap now that the alias points at ``alias_version`` and ``serving`` is served."""
        self.seen, self.seen_at = alias_version, time.time()
        if alias_version == serving:
            self.handled = alias_version
            return False
        return alias_version != self.handled

    def tried(self, alias_version: str, found: str | None) -> None:
        """The swap started for ``alias_version`` ended; ``found``: the version it resolved (its record's; None
        when unknown: refused before loading, or the swap raised)."""
        self.handled = found or alias_version

    def status(self) -> dict:
        """For /health: ``version`` is where the last poll found the alias. The poller swaps before it polls
        again, so ``version`` equal to the serving draft means the replica has caught up with the alias."""
        return {"uri": self.uri, "version": self.seen, "polled_at": self.seen_at}


class DraftManager:
    """Owns the mapping draft -> version and performs swaps and rollbacks on a running engine."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: AsyncEngine,
        spec: TargetSpec,
        cfg: ServingConfig,
        metrics: ServeMetrics,
        initial: ResolvedDraft | None,
    ):
        self.engine, self.loop, self.spec, self.cfg, self.metrics = engine, loop, spec, cfg, metrics
        self._versions: dict[int, tuple[ResolvedDraft, list[int]]] = {}  # id(draft) -> (version, aux ids)
        self.history: list[SwapRecord] = []
        self._swap_lock = asyncio.Lock()
        if initial is not None and engine.current_draft is not None:
            self._versions[id(engine.current_draft)] = (initial, engine.aux_layer_ids)
        metrics.set_draft(self.version)

    @property
    def current(self) -> ResolvedDraft | None:
        draft = self.engine.current_draft
        if draft is None:
            return None
        entry = self._versions.get(id(draft))
        return entry[0] if entry else None

    @property
    def version(self) -> str | None:
        cur = self.current
        return cur.version if cur else None

    def resolve(self, source: str) -> ResolvedDraft:
        try:
            return resolve_draft(source, self.spec, tracking_uri=self.cfg.mlflow.tracking_uri)
        except EaglerayError as err:
            raise SwapRefused("failed_load", f"cannot resolve draft source {source!r}: {err}") from err

    def prepare(self, resolved: ResolvedDraft) -> LoadedDraft:
        """Guard and load a candidate beside the serving draft (blocking; run through :meth:`_off_the_loop`)."""
        algorithm = self.cfg.draft.algorithm if self.cfg.draft else None
        report = check_compatibility(self.spec, resolved.path, algorithm=algorithm, max_model_len=self.engine.max_model_len)
        if not report.ok:
            lines = "; ".join(f"{p.field}: {p.message}" for p in report.problems)
            raise SwapRefused(
                "refused_guard",
                f"draft {resolved.version} ({resolved.path}) refused by the compatibility guard: {lines}",
                report.problems,
            )
        try:
            draft = load_draft(
                resolved.path, self.engine.target_model, self.engine.device
            )  # rank 0 only under tensor parallelism
        except EaglerayError as err:
            raise SwapRefused("failed_load", f"draft {resolved.version} could not be loaded: {err}") from err
        return LoadedDraft(draft, resolved, list(report.facts["aux_layer_ids"]))

    async def _off_the_loop(self, fn, *args):
        """A CPU engine's torch work runs in its own thread (one OpenMP team: see
        :mod:`eagleray.serve.engine.async_engine`), between steps; on a GPU a side thread loads the draft while the
        engine keeps stepping (a large draft takes seconds to read)."""
        if self.engine.device.type == "cpu":
            return await self.loop.in_engine_thread(fn, *args)
        return await asyncio.to_thread(fn, *args)

    def _smoke_and_switch(self, cand: LoadedDraft) -> None:
        """Engine thread, between steps: smoke-verify with the candidate's aux layers, then switch."""
        old_aux = self.engine.aux_layer_ids
        self.engine.set_aux_layers(cand.aux_layer_ids)
        try:
            smoke_verify(self.engine, cand.draft)
        except BaseException:
            self.engine.set_aux_layers(old_aux)
            raise
        self._versions[id(cand.draft)] = (cand.resolved, cand.aux_layer_ids)
        self.engine.swap_draft(cand.draft)

    async def swap(self, source: str) -> SwapRecord:
        """Swap to ``source``; refusals are recorded (and returned), never raised to the caller."""
        async with self._swap_lock:
            t0 = time.perf_counter()
            if self.engine.current_draft is None:
                return self._record(
                    source,
                    "refused_config",
                    None,
                    "this deployment serves without a draft (draft: null); start it with a draft to enable hot-swap",
                    t0,
                )
            try:
                resolved = await asyncio.to_thread(self.resolve, source)
                cur = self.current
                if cur is not None and resolved.path.resolve() == cur.path.resolve() and resolved.version == cur.version:
                    return self._record(source, "unchanged", resolved.version, "already serving this draft", t0)
                cand = await self._off_the_loop(self.prepare, resolved)
            except SwapRefused as err:
                return self._record(source, err.outcome, None, str(err), t0)
            try:
                await self.loop.between_steps(self._smoke_and_switch, cand)
            except EaglerayError as err:
                return self._record(source, "refused_smoke", cand.version, str(err), t0)
            return self._record(source, "swapped", cand.version, f"now serving {cand.version}", t0)

    async def rollback(self) -> SwapRecord:
        """Switch back to the previous draft (admin route; the watchdog does the same by itself)."""
        async with self._swap_lock:
            t0 = time.perf_counter()
            prev = self.engine.previous_draft
            if prev is None:
                return self._record("rollback", "refused_rollback", None, "there is no previous draft to roll back to", t0)
            await self.loop.between_steps(self._rollback_to, prev)
            return self._record("rollback", "rolled_back", self.version, f"now serving {self.version}", t0)

    def _rollback_to(self, prev: Eagle3Draft) -> None:
        entry = self._versions.get(id(prev))
        if entry is None:
            raise EaglerayError("the previous draft has no recorded version (engine bug: it was installed outside DraftManager)")
        self.engine.swap_draft(prev, entry[1])

    def _record(self, source: str, outcome: str, version: str | None, message: str, t0: float) -> SwapRecord:
        rec = SwapRecord(source, outcome, version, message, time.perf_counter() - t0)
        self.history.append(rec)
        del self.history[:-50]
        self.metrics.record_swap(outcome)
        self.metrics.set_draft(self.version)
        log = logger.info if outcome in ("swapped", "unchanged", "rolled_back") else logger.warning
        log("draft swap %s: %s (%s)", outcome, source, message)
        return rec

    def watchdog_state(self) -> str:
        m = self.engine.metrics
        if not m.watchdog_fired:
            return "ok"
        return "speculation_disabled" if not m.speculation_enabled else "fired"

    def status(self) -> dict:
        cur = self.current
        return {
            "draft_version": self.version,
            "draft_path": str(cur.path) if cur else None,
            "aux_layer_ids": self.engine.aux_layer_ids,  # the target layers captured now
            "draft_source": cur.source if cur else None,
            "watchdog_state": self.watchdog_state(),
            "history": [r.to_dict() for r in self.history[-10:]],
        }
