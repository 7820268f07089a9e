"""AsyncEngine: an asyncio step loop around :class:`LLMEngine` for the Ray Serve deployment.

    engine = AsyncEngine(LLMEngine.from_config(cfg))
    async for out in engine.add_request(messages, SamplingParams(max_tokens=64)):
        print(out.delta_text, end="")

Requests are queued in the event loop and handed to the engine between steps; each step runs in a
worker thread (so the loop keeps serving HTTP) and its outputs are routed to per-request queues
in acceptance order. The loop runs only while there is work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from eagleray.serve.engine.engine import LLMEngine, Prompt
from eagleray.serve.engine.outputs import RequestOutput
from eagleray.serve.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple[Prompt, SamplingParams, str | None, asyncio.Future]] = []
        self._aborts: list[str] = []
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.errors = 0  # steps that raised (each is re-raised to the affected requests)

    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs (one per step that advanced it) until it finishes."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, params or SamplingParams(), request_id, fut))
        self._ensure_loop()
        rid = await fut  # raises the add_request error (bad prompt, duplicate id) here
        queue = self._queues[rid]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._queues.pop(rid, None) is not None and rid in self.engine._seqs:
                self._aborts.append(rid)  # the consumer went away before the end: stop generating

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> RequestOutput:
        """The final output of one request."""
        last = None
        async for out in self.add_request(prompt, params, request_id):
            last = out
        return last

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _admit(self) -> None:
        pending, self._pending = self._pending, []
        for prompt, params, rid, fut in pending:
            try:
                rid = self.engine.add_request(prompt, params, rid)
            except Exception as err:  # noqa: BLE001 - handed to the caller, who re-raises it
                fut.set_exception(err)
                continue
            self._queues[rid] = asyncio.Queue()
            fut.set_result(rid)
        for rid in self._aborts:
            self.engine.abort(rid)
        self._aborts.clear()

    async def _run(self) -> None:
        while True:
            self._admit()
            if not self.engine.has_unfinished():
                self._wake.clear()
                if self._pending:
                    continue
                return
            try:
                outputs = await asyncio.to_thread(self.engine.step)
            except Exception as err:  # noqa: BLE001 - every waiting request gets the error, then the loop stops
                self.errors += 1
                logger.exception("engine step failed; failing %d in-flight requests", len(self._queues))
                for rid, q in list(self._queues.items()):
                    q.put_nowait(err)
                    self.engine.abort(rid)
                return
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
