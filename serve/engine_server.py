"""The engine deployment: owns the target and the draft, drives the step loop, hot-swaps drafts.

Its methods are called through a Ray Serve handle by the ingress (``generate`` streams plain
dicts: one ``start`` or ``error`` item, then ``delta`` items). ``reconfigure(user_config)`` is
Ray Serve's lightweight update: ``{"draft": "models:/name@alias" | "/path", "alias_poll_seconds": 30}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from pydantic import Field

from eagleray.platform import capture_store
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.load import StrictModel, parse_config
from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import pick_device
from eagleray.platform.registry import ResolvedDraft, registry_version, resolve_draft
from eagleray.serve.capture import CaptureClient
from eagleray.serve.engine import AsyncEngine, LLMEngine, RequestFailed, SamplingParams, TPLaunch
from eagleray.serve.hotswap import AliasFollower, DraftManager
from eagleray.serve.prometheus import ServeMetrics
from eagleray.serve.protocol import APIError
from eagleray.serve.responses import Delta
from eagleray.serve.schedule import run_every
from eagleray.serve.serving_config import ServingConfig

logger = logging.getLogger(__name__)


class EngineUserConfig(StrictModel):
    draft: str | None = Field(
        None, description="Draft to serve: 'models:/<name>@<alias>', 'models:/<name>/<version>' or a directory."
    )
    alias_poll_seconds: float | None = Field(
        None, gt=0, description="Poll a models:/ alias this often and hot-swap when it moves."
    )


def initial_draft(cfg: ServingConfig, spec: TargetSpec) -> ResolvedDraft | None:
    """The start-up draft: 'random' is written for the target; anything else is resolved."""
    if cfg.draft is None:
        return None
    return resolve_draft(cfg.draft.source, spec, tracking_uri=cfg.mlflow.tracking_uri)


def replica_cpu_threads(cfg: ServingConfig) -> int | None:
    """Set and return the CPU engine's threads (None on GPU): ``cpu_threads``, else every core this process may
    run on. Ray starts a replica reserving num_cpus=1 with OMP_NUM_THREADS=1, which would leave the CPU
    engine's kernels and prefill on one core of the machine."""
    if pick_device(cfg.target.device).type != "cpu":
        return None
    n = cfg.cpu_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


def replica_tp_launch(tensor_parallel_size: int) -> TPLaunch | None:
    """TP ranks of a replica are Ray actors in the replica's placement group (bundle r for rank r)."""
    if tensor_parallel_size == 1:
        return None
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is None:
        raise EaglerayError(
            f"target.tensor_parallel_size={tensor_parallel_size} but the engine replica is not in a placement group\n"
            f"    fix: deploy with eagleray.serve.app.build (it reserves one bundle per rank)"
        )
    return TPLaunch("ray", pg)


class EngineServer:
    """Ray Serve deployment class (wrapped with ``serve.deployment`` in :mod:`eagleray.serve.app`)."""

    def __init__(self, serving: dict[str, Any]):
        self.cfg = parse_config(ServingConfig, serving, prefix="serving")
        self.spec = TargetSpec.from_dir(resolve_target(self.cfg.target.model, self.cfg.target.dtype))
        self.cpu_threads = replica_cpu_threads(self.cfg)
        tp_launch = replica_tp_launch(self.cfg.target.tensor_parallel_size)
        first: ResolvedDraft | None = None

        def start() -> LLMEngine:  # every torch step of the start-up in the engine's thread (AsyncEngine's note)
            nonlocal first
            first = initial_draft(self.cfg, self.spec)
            draft_cfg = self.cfg.draft.model_copy(update={"source": str(first.path)}) if first else None
            target_cfg = self.cfg.target.model_copy(update={"model": str(self.spec.path)})
            return LLMEngine.from_config(self.cfg.engine_config(target=target_cfg, draft=draft_cfg), tp_launch=tp_launch)

        self.loop = AsyncEngine.build(start)
        self.engine = self.loop.engine
        self.metrics = ServeMetrics(self.cfg.model_name)
        self.drafts = DraftManager(self.engine, self.loop, self.spec, self.cfg, self.metrics, first)
        self.metrics.set_watchdog("ok")
        self.capture: CaptureClient | None = None
        if self.cfg.capture is not None:
            self.engine.enable_capture()
            meta = {
                "target_fingerprint": self.spec.fingerprint,
                "tokenizer_fingerprint": self.spec.tokenizer_fingerprint,
                "hidden_size": self.spec.hidden_size,
            }
            self.capture = CaptureClient(self.cfg.capture, meta, self.metrics)
        self._poller: asyncio.Task | None = None
        self.alias_follower: AliasFollower | None = None  # the poller's state (/health: alias)
        self._adapt_watch: asyncio.Task | None = None
        self._schedule: asyncio.Task | None = None
        logger.info(
            "engine ready: target %s, draft %s, max_model_len %d, cpu threads %s",
            self.spec.path,
            self.drafts.version,
            self.engine.max_model_len,
            self.cpu_threads,
        )

    # ------------------------------------------------------------------ requests
    def _prompt_ids(self, payload: dict[str, Any]) -> list[int]:
        prompt, field = payload["prompt"], payload["prompt_field"]
        tok = self.engine.tokenizer
        if payload["kind"] == "chat":
            if not getattr(tok, "chat_template", None):
                raise APIError(
                    400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
                )
            return list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        if isinstance(prompt, str):
            return list(tok(prompt, add_special_tokens=True)["input_ids"])
        self._check_token_ids(prompt, field)
        return [int(t) for t in prompt]

    def _check_token_ids(self, ids: list[int], field: str) -> None:
        vocab = self.spec.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise APIError(400, f"{field}: token ids {bad[:5]} are outside [0, {vocab})", param=field, code="invalid_value")

    def prepare(self, payload: dict[str, Any]) -> tuple[list[int], SamplingParams]:
        """Tokenize and check the request against the context; raises :class:`APIError` (4xx)."""
        ids = self._prompt_ids(payload)
        ctx, field = self.engine.max_model_len, payload["prompt_field"]
        if not ids:
            raise APIError(400, f"{field}: the prompt has no tokens", param=field, code="invalid_value")
        if len(ids) >= ctx:
            raise APIError(
                400,
                f"{field}: the prompt has {len(ids)} tokens; this model's context is {ctx} tokens "
                f"(at least one must be left to generate)",
                param=field,
                code="context_length_exceeded",
            )
        max_tokens, limit_field = payload["max_tokens"], payload["limit_field"]
        if max_tokens is not None and len(ids) + max_tokens > ctx:
            raise APIError(
                400,
                f"{limit_field}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the context of "
                f"{ctx} tokens; ask for at most {ctx - len(ids)}",
                param=limit_field,
                code="context_length_exceeded",
            )
        self._check_token_ids(payload["params"].get("stop_token_ids", []), "stop_token_ids")
        capture = self.capture is not None and self.capture.wants(payload.get("store"))
        params = SamplingParams(**payload["params"], max_tokens=max_tokens or ctx - len(ids), capture_states=capture)
        return ids, params

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request: {'kind': 'error'|'start', ...} then {'kind': 'delta', ...} per step."""
        rid = payload.get("request_id")
        try:
            ids, params = self.prepare(payload)
        except APIError as err:
            yield {"kind": "error", **err.to_dict()}
            return
        self._watch_adapt()
        yield {"kind": "start", "prompt_tokens": len(ids)}
        try:
            async with contextlib.aclosing(self.loop.stream_batched(ids, params, rid)) as stream:  # closed: aborted
                async for outs in self._every(stream):
                    yield self._delta_item(ids, outs)
        except RequestFailed as err:  # logged with its traceback by the step loop; the other requests continue
            which = "it" if err.alone else "the batch it was in"
            yield {
                "kind": "error",
                **APIError(
                    500,
                    f"the engine could not run this request: a step failed on {which} "
                    f"({type(err.cause).__name__}); the server log has the details under "
                    f"request id {rid}",
                    type="server_error",
                    code="engine_error",
                ).to_dict(),
            }

    async def _every(self, stream: AsyncIterator[list[Any]]) -> AsyncIterator[list[Any]]:
        """The outputs in lists of at least ``stream_interval`` new tokens; the first and the last at once."""
        pending: list[Any] = []
        sent = 0
        async for outs in stream:  # the steps since the last item
            pending.extend(outs)
            made = len(outs[-1].token_ids)
            if outs[-1].finished or sent == 0 or made - sent >= self.cfg.stream_interval:
                yield pending
                pending, sent = [], made

    def _delta_item(self, ids: list[int], outs: list[Any]) -> dict[str, Any]:
        """One stream item for the outputs of the steps since the last; a finished request is counted (and captured)."""
        out = outs[-1]
        text = out.delta_text if len(outs) == 1 else "".join(o.delta_text for o in outs)
        d = Delta(text, len(out.token_ids), len(ids), out.finished, out.finish_reason, self.drafts.version, out.spec)
        self.metrics.record_tokens(sum(len(o.delta_token_ids) for o in outs))
        if out.finished:
            if out.hidden is not None:
                self.capture.submit(out.request_id, ids, out, self.drafts.version)  # never waits
            self.metrics.record_request(len(out.token_ids), out.spec)
            self.metrics.set_watchdog(self.drafts.watchdog_state())
            self.metrics.set_draft(self.drafts.version)
        return {"kind": "delta", **d.to_dict()}

    # ------------------------------------------------------------------ status
    async def info(self) -> dict[str, Any]:
        return {
            "model": self.cfg.model_name,
            "max_model_len": self.engine.max_model_len,
            "target": str(self.spec.path),
            "draft_version": self.drafts.version,
            "tensor_parallel": self.engine.tensor_parallel,
        }

    def _watch_adapt(self) -> None:
        """With capture on: follow the adaptation loop's last decision (its file under capture.path) into /metrics."""
        if self.capture is not None and self._adapt_watch is None:
            self._adapt_watch = asyncio.get_running_loop().create_task(self._adapt_status_loop())
            sched = self.cfg.adapt_schedule
            if sched is not None:
                log = Path(self.cfg.capture.path) / sched.log
                self._schedule = asyncio.get_running_loop().create_task(
                    run_every(sched.command, sched.every_s, log, self.metrics, drop_env=self.cfg.replica_env())
                )

    async def _adapt_status_loop(self, every: float = 5.0) -> None:
        seen = None
        while True:
            status = await asyncio.to_thread(capture_store.read_adapt_status, self.cfg.capture.path)
            if status is not None and status != seen:
                seen = status
                self.metrics.set_adapt(status)
            await asyncio.sleep(every)

    async def capture_flush(self) -> dict[str, Any]:
        """Write the captured requests buffered now as a shard (the adaptation loop's --flush, tests)."""
        if self.capture is None:
            raise EaglerayError("capture is off on this deployment\n    fix: set serving.capture")
        return await self.capture.flush()

    async def health(self) -> dict[str, Any]:
        self.loop.ensure_started()
        self._watch_adapt()
        return {
            "status": "ok" if self.loop.alive else "unhealthy",
            "model": self.cfg.model_name,
            "in_flight": self.loop.num_in_flight,
            "steps": self.loop.steps,
            "step_errors": self.loop.step_errors,
            "requests_failed": self.loop.requests_failed,
            "last_error": self.loop.last_error,
            **self.drafts.status(),
            "alias": self.alias_follower.status() if self.alias_follower is not None else None,
            "metrics": self.metrics.to_dict(),
            "engine": self.engine.metrics.snapshot(),
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: the step loop must be alive once started."""
        if self.loop.died:
            raise RuntimeError(f"engine step loop died: {self.loop.last_error}")

    def __del__(self) -> None:
        """Ray Serve calls this when the replica shuts down."""
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the step loop and any TP worker ranks; ask the capture writer to write its buffer (idempotent)."""
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
        capture = getattr(self, "capture", None)
        if capture is not None:
            capture.close()

    # ------------------------------------------------------------------ drafts
    async def swap(self, source: str) -> dict[str, Any]:
        self.loop.ensure_started()
        return (await self.drafts.swap(source)).to_dict()

    async def rollback(self) -> dict[str, Any]:
        self.loop.ensure_started()
        return (await self.drafts.rollback()).to_dict()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Ray Serve user_config update: swap to ``draft`` (refusals are logged and counted, not raised)."""
        ucfg = parse_config(EngineUserConfig, user_config or {}, prefix="user_config")
        self.loop.ensure_started()
        if ucfg.draft is not None:
            await self.drafts.swap(ucfg.draft)
        if self._poller is not None:
            self._poller.cancel()
            self._poller = self.alias_follower = None
        if ucfg.alias_poll_seconds is not None and ucfg.draft and "@" in ucfg.draft:
            self._poller = asyncio.get_running_loop().create_task(self._poll(ucfg.draft, ucfg.alias_poll_seconds))

    async def _poll(self, uri: str, every: float) -> None:
        """Hot-swap when the alias moves; a refused version is not retried until the alias moves again
        (:class:`AliasFollower` is the rule)."""
        name = uri.split(":/", 1)[1].split("@", 1)[0]
        follow = self.alias_follower = AliasFollower(uri, self.drafts.version)
        while True:
            await asyncio.sleep(every)
            try:
                version = f"{name}/{await asyncio.to_thread(registry_version, uri, self.cfg.mlflow.tracking_uri)}"
            except Exception as err:  # noqa: BLE001 - registry unreachable: logged and counted, poll again
                logger.warning("alias poll of %s failed: %s", uri, err)
                self.metrics.record_swap("poll_error")
                continue
            if not follow.wants(version, self.drafts.version):
                continue
            logger.info("alias %s moved to %s; hot-swapping", uri, version)
            found = None
            try:
                found = (await self.drafts.swap(uri)).version  # refusals are recorded by swap
            except Exception:  # noqa: BLE001 - anything else must not end the poller: logged with traceback, counted
                logger.exception("alias poll of %s: swap to %s failed", uri, version)
                self.metrics.record_swap("failed_load")
            follow.tried(version, found)
