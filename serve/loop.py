"""The async step loop around the synchronous :class:`~eagleray.serve.engine.engine.LLMEngine`.

One background task runs ``engine.step()`` in a single worker thread while requests are
unfinished; each request has an asyncio queue that receives its step outputs. Every engine call
(add, abort, step, draft swap) happens in that one thread under one asyncio lock, so
:meth:`EngineLoop.between_steps` runs a function strictly between two steps (hot-swap).

A step that raises fails the requests it was running (their streams raise the error), is logged
with its traceback and counted; the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from eagleray.serve.engine.engine import LLMEngine
from eagleray.serve.engine.outputs import RequestOutput
from eagleray.serve.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagleray-engine")
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_abort: list[str] = []
        self._task: asyncio.Task | None = None
        self.step_errors = 0
        self.last_error: str | None = None
        self.steps = 0

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            if self._task is not None and self._task.exception() is not None:
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
        """Run ``fn(*args)`` in the engine thread with no step in progress."""
        async with self._lock:
            return await self._call(fn, *args)

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

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (one per step it advanced) until it finishes."""
        self.ensure_started()
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            self._queues[rid] = queue
            try:
                await self._call(self.engine.add_request, list(prompt_token_ids), params, rid)
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

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestOutput:
        """Run one request to completion; returns its final output."""
        last = None
        async for out in self.stream(prompt_token_ids, params):
            last = out
        return last

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
