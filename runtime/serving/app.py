"""`dspark serve`: an OpenAI-compatible HTTP server over an AsyncEngine (FastAPI + uvicorn).

    POST /v1/chat/completions, POST /v1/completions   (stream or not; an API key when one is set)
    GET  /v1/models, GET /health, GET /metrics         (Prometheus text)

Bodies are read and checked here: at most `max_body_bytes` (413), strict types (400; pydantic's
errors, not FastAPI's 422), the served model only (404), n = 1. A request leaves the server when
its client disconnects: the engine aborts it and frees its slot for the next step."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..async_engine import AsyncEngine, EngineError, StreamOutput, collect
from ..core import EngineFullError
from ..errors import InputError
from ..request import SamplingParams
from .metrics import Metrics
from .protocol import FINISH, Api, ChatRequest, CompletionRequest, SamplingBody, dspark_stats, error_body, usage

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1


class APIError(Exception):
    """A request the server answers with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = (
            status, message, param, code, type_, headers)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


class _ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def to_api_error(e: Exception, engine_alive: bool) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param)
    if isinstance(e, InputError):
        return APIError(400, str(e))
    if isinstance(e, EngineFullError):
        return APIError(429, str(e), code="queue_full", type_="rate_limit_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineError):
        return APIError(500 if engine_alive else 503, str(e), type_="server_error")
    log.error("request failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", type_="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 past `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body has {declared} bytes, more than the limit of {limit}", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the body has more than the limit of {limit} bytes", code="body_too_large")
    return bytes(body)


async def unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or _ClientGone (with `work` cancelled) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        gone.cancel()
        return task.result()
    task.cancel()
    await asyncio.wait({task})
    raise _ClientGone()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(engine: AsyncEngine, model: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's routes over `engine`, serving it under the name `model`. With `api_key`, the /v1
    routes need `Authorization: Bearer <api_key>`; /health and /metrics never do."""
    app = FastAPI(title="dspark", openapi_url=None, docs_url=None, redoc_url=None)
    metrics = app.state.metrics = Metrics(engine)
    started = int(time.time())

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def check(body: SamplingBody) -> None:
        if body.model != model:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model!r}", "model",
                           "model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, f"n is {body.n}: only n = 1 is supported", "n")

    def sampling(body: SamplingBody, prompt_tokens: int) -> SamplingParams:
        """OpenAI's defaults: temperature 1, a random seed, max_tokens up to the context."""
        max_new = body.max_new_tokens if body.max_new_tokens is not None else max(1, engine.room(prompt_tokens))
        temperature = 1.0 if body.temperature is None else body.temperature
        seed = secrets.randbits(63) if body.seed is None else body.seed
        return SamplingParams(temperature, max_new, seed, tuple(body.stops), engine.engine.manifest.stop_token_ids)

    async def complete(request: Request, api: Api) -> Response:
        arrival = time.perf_counter()
        try:
            check_key(request)
            raw = await read_body(request, max_body_bytes)
            body = (ChatRequest if api.chat else CompletionRequest).model_validate_json(raw)
            check(body)
            if api.chat:
                ids = engine.engine.encode([m.to_template() for m in body.messages])
            else:
                ids = engine.engine.encode(body.prompt, chat=False)
            params = sampling(body, len(ids))
            rid = api.id_prefix + uuid.uuid4().hex
            outputs = metrics.timed(engine.generate(ids, params, rid), arrival)
            if body.stream:  # errors before any output are still an HTTP status
                first = await unless_disconnected(request, anext(outputs))
            else:
                result = await unless_disconnected(request, collect(outputs))
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            error = to_api_error(e, engine.alive)
            if not isinstance(e, (EngineFullError, EngineError)):  # those the engine counts
                metrics.refused["error" if error.status >= 500 else "invalid"] += 1
            return error.response()
        created = int(time.time())
        if body.stream:
            events = stream(api, rid, created, first, outputs, body.include_usage, bool(body.return_token_ids))
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose))
        choice = api.choice(result.text, FINISH.get(result.finish_reason, result.finish_reason), stream=False)
        n = len(result.token_ids)
        ext = dspark_stats(result.stats, result.prompt_tokens, n)
        if body.return_token_ids:
            ext["token_ids"] = result.token_ids
        extra = {"usage": usage(result.prompt_tokens, n, result.stats), "dspark": ext}
        return JSONResponse(api.body(rid, created, model, [choice], extra, chunk=False))

    async def stream(api: Api, rid: str, created: int, out: StreamOutput, outputs: AsyncIterator[StreamOutput],
                     include_usage: bool, token_ids: bool) -> AsyncIterator[str]:
        """The SSE events of one request, from its first output on; a client that leaves cancels the
        stream (or closes it, after the response), and with it the request."""
        extra = {"usage": None} if include_usage else {}
        first = True
        try:
            while True:
                final = out.finish_reason is not None
                if out.text or first or final or (token_ids and out.token_ids):
                    choice = api.choice(out.text, FINISH.get(out.finish_reason, out.finish_reason), True, first)
                    ext = dspark_stats(out.stats, out.prompt_tokens, out.completion_tokens) if final else {}
                    if token_ids:
                        ext["token_ids"] = out.token_ids
                    yield sse(api.body(rid, created, model, [choice], {**extra, **({"dspark": ext} if ext else {})},
                                       chunk=True))
                    first = False
                if final:
                    break
                out = await anext(outputs)
            if include_usage:
                yield sse(api.body(rid, created, model, [], {"usage": usage(out.prompt_tokens, out.completion_tokens,
                                                                            out.stats)}, chunk=True))
        except EngineError as e:
            yield sse(error_body(str(e), "server_error"))
        finally:
            await outputs.aclose()
        yield sse("[DONE]")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return APIError(503, "the engine is not running", type_="server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            check_key(request)
        except APIError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": started,
                                                         "owned_by": "dspark"}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, Api(chat=True))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, Api(chat=False))

    return app


def serve(engine: AsyncEngine, model: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "info") -> None:
    """Run the server until interrupted, then shut the engine down."""
    try:
        uvicorn.run(create_app(engine, model, api_key, max_body_bytes), host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()
