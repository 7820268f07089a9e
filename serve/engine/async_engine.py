"""AsyncEngine: the asyncio step loop around :class:`LLMEngine` (used directly by the Ray Serve deployment).

    engine = AsyncEngine.build(lambda: LLMEngine.from_config(cfg))   # built in the thread that steps it
    async for out in engine.add_request(messages, SamplingParams(max_tokens=64)):
        print(out.delta_text, end="")
    await engine.between_steps(lambda: engine.engine.swap_draft(new_draft))   # hot-swap

One background task runs ``engine.step()`` in a single worker thread while requests are unfinished
(the event loop keeps serving HTTP); each request has an asyncio queue that receives its step
outputs. Every engine call (add, abort, step, draft swap) happens in that one thread under one
asyncio lock, so :meth:`AsyncEngine.between_steps` runs a function strictly between two steps.

On CPU that thread should be the only one in the process that runs torch work: libgomp keeps one
OpenMP thread team per thread that opened a parallel region, and once the process has more team
threads than cores it stops spinning between regions and wakes its threads through the kernel for
every one. Built in another thread, the engine left a Serve replica with two teams, and prefills and
small ops paid those wake-ups (a 149-token prefill 413-1,137 ms against 363-410 ms built in the stepping
thread, alternating A/B; BENCHMARKS.md). :meth:`AsyncEngine.build` builds the engine in its stepping
thread and :meth:`AsyncEngine.in_engine_thread` runs other torch work (a draft being loaded) there.

A step that raises fails only the request that made it fail when that one can be told apart; the
loop survives any single request. A request is *proven* once a step that ran it succeeded (it got
an output). When a step raises:

* one unproven request in the engine: it is the one the step could not run; it alone fails
  (its stream raises :class:`RequestFailed`), the others continue with the next step;
* several unproven requests: they leave the engine (nothing was streamed to them yet) and are
  re-admitted one at a time (new requests queue behind them) until the culprit is alone;
* none: a proven request failed later and cannot be told apart; every request in the engine fails.

Every failure is logged with its traceback and the request id, and counted (``step_errors``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from eagleray.platform.errors import EaglerayError
from eagleray.serve.engine.engine import LLMEngine, Prompt
from eagleray.serve.engine.outputs import RequestOutput
from eagleray.serve.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailed(EaglerayError):
    """The engine could not run this request (its step raised ``cause``; the traceback is in the log)."""

    def __init__(self, request_id: str, cause: BaseException, alone: bool):
        self.request_id, self.cause, self.alone = request_id, cause, alone
        who = "this request" if alone else "the batch this request was in"
        super().__init__(f"request {request_id}: an engine step failed on {who} ({type(cause).__name__})")


def _engine_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagleray-engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None):
        """``executor``: the one-thread executor the engine was built in (:meth:`build`), else a new one."""
        self.engine = engine
        self._executor = executor or _engine_executor()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_abort: list[str] = []
        self._unproven: dict[str, tuple[Prompt, SamplingParams]] = {}  # in the engine, no successful step yet
        self._probation: collections.deque[tuple[str, Prompt, SamplingParams]] = collections.deque()  # waiting to re-enter
        self._task: asyncio.Task | None = None
        self.step_errors = 0  # steps that raised
        self.requests_failed = 0  # requests failed by a step that raised
        self.last_error: str | None = None  # the exception type of the last failed step (details in the log)
        self.steps = 0
        self.built_in_thread: int | None = None  # the engine thread's id when :meth:`build` made the engine

    @classmethod
    def build(cls, make: Callable[[], LLMEngine]) -> AsyncEngine:
        """``make()`` run in the thread that will step the engine (blocking), wrapped: see the module's note."""
        executor = _engine_executor()

        def made_here() -> tuple[LLMEngine, int]:
            return make(), threading.get_ident()

        try:
            engine, thread = executor.submit(made_here).result()
        except BaseException:
            executor.shutdown(wait=False, cancel_futures=True)
            raise
        out = cls(engine, executor)
        out.built_in_thread = thread
        return out

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
    def died(self) -> bool:
        """The loop was started and has stopped (crashed or cancelled); ``ensure_started`` restarts it."""
        return self._task is not None and self._task.done()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def in_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine thread, queued behind the step in progress (not under the step lock:
        the loop may step before and after it; engine calls go through :meth:`between_steps`)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def between_steps(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine thread while no step is running; returns its result (or raises)."""
        async with self._lock:
            return await self.in_engine_thread(fn, *args)

    # ----------------------------------------------------------------- step loop
    async def _run(self) -> None:
        while True:
            if self._to_abort:
                ids, self._to_abort = set(self._to_abort), []
                self._probation = collections.deque(e for e in self._probation if e[0] not in ids)
                for i in ids:
                    self._unproven.pop(i, None)
                await self.between_steps(lambda ids=ids: [self.engine.abort(i) for i in ids])
            if self._probation and not self._unproven:
                await self._admit_next()
                continue
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                try:
                    outputs = await self.in_engine_thread(self.engine.step)
                except Exception as err:  # noqa: BLE001 - not swallowed: logged, counted, sent to the failed requests
                    await self._step_failed(err)
                    continue
            self.steps += 1
            for out in outputs:
                self._unproven.pop(out.request_id, None)
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    async def _admit_next(self) -> None:
        """Re-admit the oldest request on probation (alone among the unproven)."""
        async with self._lock:
            rid, prompt, params = self._probation.popleft()
            queue = self._queues.get(rid)
            if queue is None:
                return
            try:
                await self.in_engine_thread(self.engine.add_request, prompt, params, rid)
            except Exception as err:  # noqa: BLE001 - the caller's stream raises it (as add_request would have)
                queue.put_nowait(err)
                return
            self._unproven[rid] = (prompt, params)

    async def _step_failed(self, err: Exception) -> None:
        """A step raised (called under the lock): fail the request responsible if it can be told apart."""
        self.step_errors += 1
        self.last_error = type(err).__name__
        suspects = list(self._unproven)
        if len(suspects) == 1:
            logger.error(
                "engine step failed; request %s is the only one not yet through a successful step: it alone "
                "fails, %d other(s) continue",
                suspects[0],
                len(self._queues) - 1,
                exc_info=err,
            )
            await self._fail(suspects, err, alone=True)
        elif suspects:
            logger.warning(
                "engine step failed (%s) with %d new requests in it; re-admitting them one at a time to find "
                "the one it cannot run",
                type(err).__name__,
                len(suspects),
            )
            await self.in_engine_thread(lambda: [self.engine.abort(i) for i in suspects])
            self._probation.extendleft((rid, *self._unproven.pop(rid)) for rid in reversed(suspects))
        else:
            ids = [rid for rid in self._queues if rid not in {e[0] for e in self._probation}]
            logger.error(
                "engine step failed on requests that had run before; failing the %d request(s) in the engine: %s",
                len(ids),
                ids,
                exc_info=err,
            )
            await self._fail(ids, err, alone=False)

    async def _fail(self, ids: list[str], err: Exception, *, alone: bool) -> None:
        await self.in_engine_thread(lambda: [self.engine.abort(i) for i in ids])
        for rid in ids:
            self._unproven.pop(rid, None)
            queue = self._queues.get(rid)
            if queue is not None:
                self.requests_failed += 1
                queue.put_nowait(RequestFailed(rid, err, alone))

    # ----------------------------------------------------------------- requests
    async def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs (one per step that advanced it) until it finishes."""
        async for out in self._outputs(prompt, params, request_id, batched=False):
            yield out

    async def stream_batched(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[list[RequestOutput]]:
        """Like :meth:`add_request`, but each yield is every output that arrived since the last one (>= 1): a
        consumer slower than the engine (a Serve handle on a busy machine) gets one item for several steps."""
        async for outs in self._outputs(prompt, params, request_id, batched=True):
            yield outs

    async def _outputs(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, *, batched: bool
    ) -> AsyncIterator[Any]:
        self.ensure_started()
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        async with self._lock:
            if rid in self._queues:
                raise EaglerayError(f"request_id {rid!r} is already in use\n    fix: pass a unique request_id")
            self._queues[rid] = queue
            if self._probation:  # finding a request a step could not run: new ones wait their turn
                self._probation.append((rid, prompt, params or SamplingParams()))
            else:
                try:
                    await self.in_engine_thread(self.engine.add_request, prompt, params or SamplingParams(), rid)
                except BaseException:
                    self._queues.pop(rid, None)
                    raise
                self._unproven[rid] = (prompt, params or SamplingParams())
        self._wake.set()
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while batched and not queue.empty():  # steps that ran while the consumer was busy: one yield
                    items.append(queue.get_nowait())
                outs = []
                for item in items:
                    if isinstance(item, Exception):
                        if outs:
                            yield outs
                        raise item
                    outs.append(item)
                finished = outs[-1].finished
                yield outs if batched else outs[0]
        finally:
            self._queues.pop(rid, None)
            if not finished:  # client went away or the caller stopped early
                self._to_abort.append(rid)
                self._wake.set()

    stream = add_request

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> RequestOutput:
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
