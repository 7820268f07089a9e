"""The ingress deployment: OpenAI-compatible FastAPI routes in front of the engine deployment.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with ``stream: true``),
GET /v1/models, GET /health, and the admin routes GET/POST /admin/draft, POST /admin/rollback.
Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``. No error
body carries internals (tracebacks, Ray task errors, file paths, pids, ANSI codes): an unexpected
failure is logged here with its request id and answered with that id; a lost engine replica is a
retryable 503 ``engine_unavailable``. ``GET /health`` answers within :data:`HEALTH_WAIT_S` under
any load: a fresh engine status when the engine answers in time, else the last one with its age
(the engine handle queues behind generation calls), or ``restarting`` when the replica is gone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleray.platform.config.load import StrictModel, parse_config
from eagleray.serve.engine_client import EngineClient, HandleClient, LocalClient
from eagleray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from eagleray.serve.request_body import parse_body
from eagleray.serve.responses import SSE_DONE, Delta, ResponseBuilder, sse
from eagleray.serve.serving_config import ServingConfig

logger = logging.getLogger(__name__)
HEALTH_WAIT_S = 0.25  # how long one engine status call may hold GET /health before it answers from the last one
app = FastAPI(title="eagleray", description="OpenAI-compatible EAGLE-3 speculative decoding on Ray Serve")


class SwapRequest(StrictModel):
    source: str = Field(
        min_length=1, description="Draft to serve: 'models:/<name>@<alias>', 'models:/<name>/<version>' or a directory."
    )


def check_auth(request: Request, api_key: str | None, *, admin: bool = False) -> None:
    """Bearer-token check; admin routes need a configured key even when the API is open."""
    if api_key is None:
        if admin:
            raise APIError(
                403,
                "admin routes are disabled: this deployment has no api_key; set serving.api_key",
                type="permission_error",
                code="admin_disabled",
            )
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <api_key>'",
            type="authentication_error",
            code="invalid_api_key",
        )


def sampling_payload(req: ChatCompletionRequest | CompletionRequest, kind: str) -> dict[str, Any]:
    """What crosses the handle to :meth:`EngineServer.generate`."""
    max_tokens, limit_field = req.limit()
    if kind == "chat":
        prompt: Any = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        prompt_field = "messages"
    else:
        prompt, prompt_field = req.prompt, "prompt"
    params = req.sampling()
    return {
        "kind": kind,
        "store": req.store,
        "prompt": prompt,
        "prompt_field": prompt_field,
        "max_tokens": max_tokens,
        "limit_field": limit_field,
        "params": params,
    }


class ErrorCounter:
    """``eagleray_request_errors_total{status}``: every error answer of this ingress (HTTP status or SSE error event)."""

    def __init__(self, model_name: str):
        from ray.serve import metrics as serve_metrics

        self.metric = serve_metrics.Counter(
            "eagleray_request_errors_total",
            description="Requests answered with an error, by HTTP status.",
            tag_keys=("model_name", "status"),
        )
        self.metric.set_default_tags({"model_name": model_name})
        self.counts: dict[str, int] = {}

    def record(self, status: int) -> None:
        self.metric.inc(tags={"status": str(status)})
        self.counts[f"errors_{status}"] = self.counts.get(f"errors_{status}", 0) + 1


_errors: ErrorCounter | None = None  # set by OpenAIIngress (one ingress per replica process)
_probe: "HealthProbe | None" = None  # likewise: a lost engine seen by any request shows on /health


def _answer(err: APIError) -> JSONResponse:
    if _errors is not None:
        _errors.record(err.status)
    return JSONResponse(err.body(), status_code=err.status)


_ENGINE_GONE: tuple[type[BaseException], ...] = ()


class StreamCut(RuntimeError):
    """The engine's stream ended before its finished delta: the engine side went away mid-request.

    Ray raises for a replica it knows is dead; a stream that simply ends short must not pass for a whole answer
    either (the client gets a retryable ``engine_unavailable``).
    """


def _engine_gone() -> tuple[type[BaseException], ...]:
    """Ray's errors for a replica that died or is restarting (the request may be retried)."""
    global _ENGINE_GONE
    if not _ENGINE_GONE:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        _ENGINE_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)
    return _ENGINE_GONE


def engine_failure(err: BaseException, request_id: str) -> APIError:
    """An exception from the engine handle (or anything unexpected) as a clean error; the details go to the log."""
    if isinstance(err, APIError):
        return err
    gone = (*_engine_gone(), StreamCut)
    if isinstance(err, gone) or isinstance(getattr(err, "cause", None), gone):
        logger.warning("request %s: the engine replica is unavailable (%s); answered 503", request_id, type(err).__name__)
        if _probe is not None:
            _probe.gone = type(err).__name__  # until the engine answers a status call again
        return APIError(
            503,
            f"the engine is restarting or overloaded; retry the request in a few seconds (request id {request_id})",
            type="server_error",
            code="engine_unavailable",
        )
    logger.error("request %s failed", request_id, exc_info=err)
    return APIError(
        500,
        f"internal error; the server log has the details under request id {request_id}",
        type="server_error",
        code="internal_error",
    )


@app.exception_handler(APIError)
async def _api_error(_: Request, err: APIError) -> JSONResponse:
    return _answer(err)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
    msg = f"{request.method} {request.url.path}: {err.detail}"
    return _answer(APIError(err.status_code, msg, code=code))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {"loc": ()}
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    return _answer(APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param, code="invalid_value"))


@app.exception_handler(Exception)
async def _unexpected(request: Request, err: Exception) -> JSONResponse:
    return _answer(engine_failure(err, f"req-{uuid.uuid4().hex[:16]}"))


async def engine_deltas(gen: AsyncIterator[dict[str, Any]]) -> AsyncIterator[Delta]:
    """The engine's deltas after its head item: an error item raises its APIError, and a stream that
    ends before a finished delta raises :class:`StreamCut` (never a silently cut answer)."""
    finished = False
    async for item in gen:
        if item["kind"] == "error":
            raise APIError.from_dict(item)
        d = Delta.from_dict({k: v for k, v in item.items() if k != "kind"})
        finished = d.finished
        yield d
    if not finished:
        raise StreamCut("the engine stream ended before its last token")


class HealthProbe:
    """The engine's status for GET /health without ever waiting more than ``wait_s`` for the engine.

    One status call is in flight at a time, and it may hold /health for ``wait_s`` in all: a /health
    that arrives while the call is in flight waits only for what is left of that window, then answers
    with the last status and its age. (Under saturation the call queues behind generation calls on the
    engine handle for seconds; waiting ``wait_s`` again on every /health would add up under a load
    balancer's polling.) A replica that died (or is being restarted) reads as ``restarting``.
    """

    def __init__(self, engine: Any, wait_s: float = HEALTH_WAIT_S):
        self.engine, self.wait_s = engine, wait_s
        self.last: dict[str, Any] | None = None
        self.last_at = 0.0
        self.gone: str | None = None  # why the engine is unavailable, while it is
        self._call: asyncio.Task | None = None
        self._call_at = 0.0  # when the call in flight started

    async def _fetch(self) -> None:
        try:
            status = await self.engine.health()
        except _engine_gone() as err:
            logger.warning("health: the engine replica is unavailable (%s)", type(err).__name__)
            self.gone = type(err).__name__
            return
        self.last, self.last_at, self.gone = status, time.monotonic(), None

    async def status(self) -> tuple[int, dict[str, Any]]:
        if self._call is None or self._call.done():
            self._call = asyncio.get_running_loop().create_task(self._fetch())
            self._call_at = time.monotonic()
        left = self._call_at + self.wait_s - time.monotonic()
        if left > 0:
            try:
                await asyncio.wait_for(asyncio.shield(self._call), left)
            except asyncio.TimeoutError:
                pass  # the call stays in flight; its answer serves the next /health
        if self.gone is not None:
            return 503, {
                "status": "restarting",
                "detail": "the engine replica is unavailable; Ray Serve restarts it",
                "status_age_s": None,
            }
        if self.last is None:
            return 503, {"status": "starting", "detail": "the engine has not answered yet", "status_age_s": None}
        age = time.monotonic() - self.last_at
        body = {**self.last, "status_age_s": round(age, 3)}
        return (200 if self.last["status"] == "ok" else 503), body


class OpenAIIngress:
    """Ray Serve ingress class (wrapped with ``serve.deployment`` + ``serve.ingress(app)`` in app.py)."""

    def __init__(self, engine: Any, serving: dict[str, Any]):
        """``engine``: the engine deployment's handle, or an :class:`EngineClient` (the engine in this replica)."""
        global _errors, _probe
        self.engine: EngineClient = engine if isinstance(engine, (LocalClient, HandleClient)) else HandleClient(engine)
        self.cfg = parse_config(ServingConfig, serving, prefix="serving")
        _errors = ErrorCounter(self.cfg.model_name)
        self.probe = _probe = HealthProbe(self.engine)

    # ---------------------------------------------------------------- helpers
    async def _completion(self, request: Request, kind: str) -> Any:
        check_auth(request, self.cfg.api_key)
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_body(await request.body(), model)
        if req.model != self.cfg.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if req.store and self.cfg.capture is None:
            raise APIError(
                400,
                "store: true asks this server to keep the completion, but capture is off here; "
                "send store: false or leave it out (or the operator sets serving.capture)",
                param="store",
                code="invalid_value",
            )
        builder = ResponseBuilder(kind, req.model)
        payload = {**sampling_payload(req, kind), "request_id": builder.id}
        gen = self.engine.generate(payload)
        try:
            head = await gen.__anext__()
        except Exception as err:  # noqa: BLE001 - answered clean (503/500); logged with its traceback and request id
            raise engine_failure(err, builder.id) from None
        if head["kind"] == "error":
            raise APIError.from_dict(head)
        if req.stream:
            return StreamingResponse(
                self._sse(gen, builder, req.include_usage()),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            async for d in engine_deltas(gen):
                builder.add(d)
        except Exception as err:  # noqa: BLE001 - answered clean (503/500); logged with its traceback and request id
            raise engine_failure(err, builder.id) from None
        return JSONResponse(builder.final())

    async def _sse(self, gen: Any, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
        first, finished = True, False
        try:
            async for d in engine_deltas(gen):
                builder.add(d)
                yield sse(builder.chunk(d, first=first))
                first, finished = False, d.finished
            if include_usage:
                yield sse(builder.usage_chunk())
        except Exception as err:  # noqa: BLE001 - headers are sent: reported in-band, clean; details in the log
            api = engine_failure(err, builder.id)
            if _errors is not None:
                _errors.record(api.status)
            yield sse(api.body())
        finally:
            if not finished:
                gen.cancel()
        yield SSE_DONE

    # ---------------------------------------------------------------- routes
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._completion(request, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._completion(request, "completion")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key)
        info = await self.engine.info()
        return {
            "object": "list",
            "data": [
                {
                    "id": info["model"],
                    "object": "model",
                    "created": 0,
                    "owned_by": "eagleray",
                    "max_model_len": info["max_model_len"],
                    "draft_version": info["draft_version"],
                }
            ],
        }

    @app.get("/health")
    async def health(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key)
        code, status = await self.probe.status()
        status = {k: v for k, v in status.items() if k not in ("draft_path", "history", "target")}  # paths: /admin/draft
        if "metrics" in status:
            status["metrics"] = {**status["metrics"], **(_errors.counts if _errors else {})}
        return JSONResponse(status, status_code=code)

    @app.get("/admin/draft")
    async def draft_status(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        status = await self.engine.health()
        return {
            k: status[k] for k in ("draft_version", "draft_path", "draft_source", "aux_layer_ids", "watchdog_state", "history")
        }

    @app.post("/admin/draft")
    async def swap_draft(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        req = parse_body(await request.body(), SwapRequest)
        rec = await self.engine.swap(req.source)
        if rec["outcome"] not in ("swapped", "unchanged"):
            raise APIError(409, rec["message"], param="source", code=rec["outcome"])
        return rec

    @app.post("/admin/rollback")
    async def rollback(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        rec = await self.engine.rollback()
        if rec["outcome"] != "rolled_back":
            raise APIError(409, rec["message"], code=rec["outcome"])
        return rec
