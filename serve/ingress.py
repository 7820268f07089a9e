"""The ingress deployment: OpenAI-compatible FastAPI routes in front of the engine deployment.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with ``stream: true``),
GET /v1/models, GET /health, and the admin routes GET/POST /admin/draft, POST /admin/rollback.
Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagleray.platform.config import StrictModel, parse_config
from eagleray.platform.schemas import ServingConfig
from eagleray.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from eagleray.serve.responses import SSE_DONE, Delta, ResponseBuilder, sse

logger = logging.getLogger(__name__)
app = FastAPI(title="eagleray", description="OpenAI-compatible EAGLE-3 speculative decoding on Ray Serve")


class SwapRequest(StrictModel):
    source: str = Field(min_length=1, description="Draft to serve: 'models:/<name>@<alias>', 'models:/<name>/<version>' or a directory.")


def check_auth(request: Request, api_key: str | None, *, admin: bool = False) -> None:
    """Bearer-token check; admin routes need a configured key even when the API is open."""
    if api_key is None:
        if admin:
            raise APIError(403, "admin routes are disabled: this deployment has no api_key; set serving.api_key",
                           type="permission_error", code="admin_disabled")
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <api_key>'",
                       type="authentication_error", code="invalid_api_key")


def sampling_payload(req: ChatCompletionRequest | CompletionRequest, kind: str) -> dict[str, Any]:
    """What crosses the handle to :meth:`EngineServer.generate`."""
    max_tokens, limit_field = req.limit()
    if kind == "chat":
        prompt: Any = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        prompt_field = "messages"
    else:
        prompt, prompt_field = req.prompt, "prompt"
    params = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stop": req.stop_list(),
              "seed": req.seed, "ignore_eos": req.ignore_eos}
    return {"kind": kind, "prompt": prompt, "prompt_field": prompt_field, "max_tokens": max_tokens,
            "limit_field": limit_field, "params": params}


@app.exception_handler(APIError)
async def _api_error(_: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
    msg = f"{request.method} {request.url.path}: {err.detail}"
    return JSONResponse(APIError(err.status_code, msg, code=code).body(), status_code=err.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": str(err)}
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    return JSONResponse(APIError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value").body(), 400)


@app.exception_handler(Exception)
async def _unexpected(request: Request, err: Exception) -> JSONResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=err)
    body = APIError(500, f"internal error: {type(err).__name__}: {err}"[:2000], type="server_error", code="internal_error").body()
    return JSONResponse(body, status_code=500)


class OpenAIIngress:
    """Ray Serve ingress class (wrapped with ``serve.deployment`` + ``serve.ingress(app)`` in app.py)."""

    def __init__(self, engine: Any, serving: dict[str, Any]):
        self.engine = engine
        self.cfg = parse_config(ServingConfig, serving, prefix="serving")

    # ---------------------------------------------------------------- helpers
    async def _completion(self, request: Request, kind: str) -> Any:
        check_auth(request, self.cfg.api_key)
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_body(await request.body(), model)
        if req.model != self.cfg.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")
        gen = self.engine.options(stream=True).generate.remote(sampling_payload(req, kind))
        head = await gen.__anext__()
        if head["kind"] == "error":
            raise APIError.from_dict(head)
        builder = ResponseBuilder(kind, req.model)
        if req.stream:
            return StreamingResponse(self._sse(gen, builder, req.include_usage()), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for item in gen:
            builder.add(Delta.from_dict({k: v for k, v in item.items() if k != "kind"}))
        return JSONResponse(builder.final())

    async def _sse(self, gen: Any, builder: ResponseBuilder, include_usage: bool) -> AsyncIterator[str]:
        first, finished = True, False
        try:
            async for item in gen:
                d = Delta.from_dict({k: v for k, v in item.items() if k != "kind"})
                builder.add(d)
                yield sse(builder.chunk(d, first=first))
                first, finished = False, d.finished
            if include_usage:
                yield sse(builder.usage_chunk())
        except Exception as err:  # noqa: BLE001 - headers are sent: report in-band, logged with traceback
            logger.exception("stream %s failed", builder.id)
            yield sse(APIError(500, f"generation failed: {type(err).__name__}: {err}", type="server_error",
                               code="engine_error").body())
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
        info = await self.engine.info.remote()
        return {"object": "list", "data": [{"id": info["model"], "object": "model", "created": 0, "owned_by": "eagleray",
                                            "max_model_len": info["max_model_len"], "draft_version": info["draft_version"]}]}

    @app.get("/health")
    async def health(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key)
        status = await self.engine.health.remote()
        return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)

    @app.get("/admin/draft")
    async def draft_status(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        status = await self.engine.health.remote()
        return {k: status[k] for k in ("draft_version", "draft_path", "draft_source", "watchdog_state", "history")}

    @app.post("/admin/draft")
    async def swap_draft(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        req = parse_body(await request.body(), SwapRequest)
        rec = await self.engine.swap.remote(req.source)
        if rec["outcome"] not in ("swapped", "unchanged"):
            raise APIError(409, rec["message"], param="source", code=rec["outcome"])
        return rec

    @app.post("/admin/rollback")
    async def rollback(self, request: Request) -> Any:
        check_auth(request, self.cfg.api_key, admin=True)
        rec = await self.engine.rollback.remote()
        if rec["outcome"] != "rolled_back":
            raise APIError(409, rec["message"], code=rec["outcome"])
        return rec
