"""AsyncEngine: the asyncio step loop around :class:`LLMEngine` (used directly by the Ray Serve deployment).

    engine = AsyncEngine(LLMEngine.from_config(cfg))
    async for out in engine.add_request(messages, SamplingParams(max_tokens=64)):
        print(out.delta_text, end="")
    await engine.between_steps(lambda: engine.engine.swap_draft(new_draft))   # hot-swap

One background task runs ``engine.step()`` in a single worker thread while requests are unfinished
(the event loop keeps serving HTTP); each request has an asyncio queue that receives its step
outputs. Every engine call (add, abort, step, draft swap) happens in that one thread under one
asyncio lock, so :meth:`AsyncEngine.between_steps` runs a function strictly between two steps.

A step that raises fails the requests it was running (their streams raise the error); it is logged
with its traceback and counted, and the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.engine import LLMEngine, Prompt
from eagleray.serve.engine.outputs import RequestOutput
from eagleray.serve.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagleray-engine")
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_abort: list[str] = []
        self._task: asyncio.Task | None = None
        self.step_errors = 0  # steps that raised (each is re-raised to the affected requests)
        self.last_error: str | None = None
        self.steps = 0

    # ----------------------------------------------------------------- loop state
    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
                logger.error("engine loop had died: %r; restarting it", self._task.exception())
            self._task = asyncio.get_running_loop().create_task(self._run(), name="eagleray-engine-loop")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def between_steps(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine thread while no step is running; returns its result (or raises)."""
        async with self._lock:
            return await self._call(fn, *args)

    # ----------------------------------------------------------------- step loop
    async def _run(self) -> None:
        while True:
            if self._to_abort:
                ids, self._to_abort = self._to_abort, []
                await self.between_steps(lambda: [self.engine.abort(i) for i in ids])
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                try:
                    outputs = await self._call(self.engine.step)
                except Exception as err:  # noqa: BLE001 - not swallowed: logged, counted, sent to every stream
                    await self._fail_all(err)
                    continue
            self.steps += 1
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    async def _fail_all(self, err: Exception) -> None:
        """A step raised: the requests in it cannot continue; each stream raises ``err``."""
        self.step_errors += 1
        self.last_error = f"{type(err).__name__}: {err}"
        logger.exception("engine step failed; failing %d in-flight request(s)", len(self._queues))
        ids = list(self._queues)
        await self._call(lambda: [self.engine.abort(i) for i in ids])
        for rid in ids:
            self._queues[rid].put_nowait(err)

    # ----------------------------------------------------------------- requests
    async def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (one per step that advanced it) until it finishes."""
        self.ensure_started()
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            if rid in self._queues:
                raise EaglerayError(f"request_id {rid!r} is already in use\n    fix: pass a unique request_id")
            self._queues[rid] = queue
            try:
                await self._call(self.engine.add_request, prompt, params or SamplingParams(), rid)
            except BaseException:
                self._queues.pop(rid, None)
                raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:  # client went away or the caller stopped early
                self._to_abort.append(rid)
                self._wake.set()

    stream = add_request  # the deployment's name for it

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """Run one request to completion; returns its final output."""
        last = None
        async for out in self.add_request(prompt, params, request_id):
            last = out
        return last

    def shutdown(self) -> None:
        """Stop the loop and the engine thread, then the engine's tensor-parallel workers."""
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.engine.close()
