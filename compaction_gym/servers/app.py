"""The FastAPI app: the session API (docs/server.md) over an :class:`~compaction_gym.engine.Engine`.

Routes: ``POST /compact_generate``, ``POST /inject_generate``, ``POST /compact_session/create``, ``POST
/compact_session/step``, ``POST /compact_session/step_batch``, ``DELETE
/compact_session/{session_id}``, ``GET /health``, ``GET /metrics``, plus the OpenAI-compatible
``GET /v1/models`` and ``POST /v1/chat/completions`` (:mod:`compaction_gym.servers.openai_api`).

All engine work runs on one worker thread (:class:`~compaction_gym.servers.worker.EngineWorker`);
the event loop only parses, validates and waits. Errors map to statuses through
:mod:`compaction_gym.servers.errors`; no request can take the server down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from compaction_gym.engine.config import MAX_STOP_IDS
from compaction_gym.errors import CompactionGymError
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.errors import ClientDisconnected, error_body, status_of
from compaction_gym.servers.fast_path import FastRoute, fast_routes, serve_fast
from compaction_gym.servers.schemas import (
    CompactGenerateRequest,
    DeleteResponse,
    GenerateResponse,
    HealthResponse,
    InjectGenerateRequest,
    SessionCreateRequest,
    SessionStepBatchRequest,
    SessionStepRequest,
    StepBatchResponse,
    response_json,
    to_response,
)
from compaction_gym.servers.state import ServerState, unless_disconnected

logger = logging.getLogger(__name__)
T = TypeVar("T")
# the routes served by the fast path when valid (docs/server.md, "Performance")
FAST_PATHS = (
    "/compact_generate",
    "/inject_generate",
    "/compact_session/create",
    "/compact_session/step",
    "/compact_session/step_batch",
)


def create_app(engine: Any, args: ServerArgs | None = None) -> FastAPI:
    """Build the FastAPI app serving ``engine``.

    Args:
        engine: a :class:`compaction_gym.engine.Engine` (or anything with its interface). The app
            owns it from now on: all calls go through its worker thread.
        args: server settings; ``args.model`` and the other loading fields are ignored here.

    Returns:
        A FastAPI app; its lifespan starts and stops the engine worker.

    Example:
        >>> engine = Engine.from_pretrained("path/to/model", max_slots=16)  # doctest: +SKIP
        >>> uvicorn.run(create_app(engine, ServerArgs(batch_window_ms=5)), port=8000)  # doctest: +SKIP
    """
    args = args or ServerArgs()
    state = ServerState(engine, args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            state.worker.stop()

    app = FastAPI(title="compaction-gym", summary="Compacted KV-cache sessions over HTTP", lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app, state)

    @app.post("/compact_generate", response_model=GenerateResponse)
    async def compact_generate(body: CompactGenerateRequest, request: Request) -> Response:
        """One prompt, compacted mid-generation; no session is kept."""
        state.check_ids("prompt_ids", body.prompt_ids)
        state.check_ids("stop_token_ids", body.stop_token_ids, limit=MAX_STOP_IDS)
        config, sampling = body.compaction_config(), body.sampling()
        work = state.worker.create(body.prompt_ids, config, sampling, ephemeral=True)
        result, text, info = await unless_disconnected(request, work)
        return _json(to_response(result, text, info))

    @app.post("/inject_generate", response_model=GenerateResponse)
    async def inject_generate(body: InjectGenerateRequest, request: Request) -> Response:
        """One prompt, no compaction, the budget message fed every ``inject_budget_every`` sampled
        tokens (mask 0, log-prob 0); no session is kept."""
        state.check_ids("prompt_ids", body.prompt_ids)
        state.check_ids("stop_token_ids", body.stop_token_ids, limit=MAX_STOP_IDS)
        config, sampling = body.compaction_config(), body.sampling()
        work = state.worker.create(body.prompt_ids, config, sampling, ephemeral=True)
        result, text, info = await unless_disconnected(request, work)
        return _json(to_response(result, text, info))

    @app.post("/compact_session/create", response_model=GenerateResponse)
    async def session_create(body: SessionCreateRequest, request: Request) -> Response:
        """Prefill ``prompt_ids`` into a new session and generate its first response."""
        state.check_ids("prompt_ids", body.prompt_ids)
        state.check_ids("stop_token_ids", body.stop_token_ids, limit=MAX_STOP_IDS)
        config, sampling = body.compaction_config(), body.sampling()
        work = state.worker.create(
            body.prompt_ids, config, sampling, session_id=body.session_id, score_input=body.score_input
        )
        result, text, info = await unless_disconnected(request, work)
        return _json(to_response(result, text, info))

    @app.post("/compact_session/step", response_model=GenerateResponse)
    async def session_step(body: SessionStepRequest, request: Request) -> Response:
        """Feed ``new_token_ids`` into a session, then generate (batched with concurrent steps)."""
        _check_step(state, body, "")
        work = state.worker.step(
            body.session_id,
            body.new_token_ids,
            body.sampling_overrides(),
            response_complete=body.response_complete,
            score_input=body.score_input,
        )
        result, text, info = await unless_disconnected(request, work)
        return _json(to_response(result, text, info))

    @app.post("/compact_session/step_batch", response_model=StepBatchResponse)
    async def session_step_batch(body: SessionStepBatchRequest, request: Request) -> Response:
        """Several steps and creates in one request; each result is a response or an error body, in order."""
        calls = []  # everything is validated before any work is submitted
        for i, item in enumerate(body.requests):
            if isinstance(item, SessionCreateRequest):
                state.check_ids(f"requests.{i}.prompt_ids", item.prompt_ids)
                state.check_ids(f"requests.{i}.stop_token_ids", item.stop_token_ids, limit=MAX_STOP_IDS)
                args = (item.prompt_ids, item.compaction_config(), item.sampling())
                kwargs = {"session_id": item.session_id, "score_input": item.score_input}
                calls.append((state.worker.create, args, kwargs))
            else:
                _check_step(state, item, f"requests.{i}.")
                args = (item.session_id, item.new_token_ids, item.sampling_overrides())
                kwargs = {"response_complete": item.response_complete, "score_input": item.score_input}
                calls.append((state.worker.step, args, kwargs))
        works = [fn(*args, **kwargs) for fn, args, kwargs in calls]
        outcomes = await unless_disconnected(request, asyncio.gather(*works, return_exceptions=True))
        results: list[dict[str, Any]] = []
        for out in outcomes:
            if isinstance(out, BaseException):
                status = status_of(out)
                results.append(error_body(status, str(out), type_=type(out).__name__))
            else:
                results.append(to_response(*out))
        return _json({"results": results})

    @app.delete("/compact_session/{session_id}", response_model=DeleteResponse)
    async def session_delete(session_id: str) -> dict[str, str]:
        """Close a session and free its slot."""
        await state.worker.close(session_id)
        return {"deleted": session_id}

    @app.get("/health", response_model=HealthResponse, responses={503: {"description": "engine worker down"}})
    async def health() -> Any:
        """Liveness plus slot usage (read from metrics; never waits for the engine)."""
        if not state.worker.alive:
            return JSONResponse(error_body(503, "the engine worker is not running", type_="ServerError"), 503)
        free = int(state.metrics.slots_free.value())
        return {
            "status": "ok",
            "model": state.model_name,
            "sessions": state.max_slots - free,
            "max_slots": state.max_slots,
            "free_slots": free,
            "capacity": state.capacity,
            "vocab_size": state.vocab_size,
            "eos_token_ids": state.eos_token_ids,
            "queue_depth": state.worker.queue_depth,
            "running_requests": state.worker.running_requests,
            "uptime_s": time.time() - state.started,
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        """Prometheus text format: sessions, batch sizes, tokens, compaction events, latencies."""
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    from compaction_gym.servers.openai_api import router as openai_router

    app.include_router(openai_router)
    fast = fast_routes(app, FAST_PATHS) if args.fast_routes else {}
    app.add_middleware(_ServerMiddleware, state=state, fast=fast, handlers=app.exception_handlers)
    return app


def _json(body: dict[str, Any]) -> Response:
    """A 200 whose body is serialised once here; the route's ``response_model`` documents it
    (see :func:`~compaction_gym.servers.schemas.response_json`)."""
    return Response(response_json(body), media_type="application/json")


def _check_step(state: ServerState, body: SessionStepRequest, prefix: str) -> None:
    state.check_ids(prefix + "new_token_ids", body.new_token_ids)
    state.check_ids(prefix + "stop_token_ids", body.stop_token_ids, limit=MAX_STOP_IDS)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def respond(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
        headers = {"Retry-After": str(state.args.retry_after_s)} if status == 429 else None
        return JSONResponse(error_body(status, message, type_=type_, param=param), status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return respond(
                400, f"malformed JSON body: {errors[0].get('msg', '')}", "InvalidArgumentError", "body"
            )
        parts, params = [], []
        for e in errors:
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            field = ".".join(loc) or "body"
            params.append(field)
            parts.append(f"{field}: {e.get('msg', 'invalid')}")
        return respond(422, "; ".join(parts), "InvalidArgumentError", params[0] if params else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = respond(exc.status_code, str(exc.detail), "HTTPError")
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(CompactionGymError)
    async def on_library_error(request: Request, exc: CompactionGymError) -> Response:
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)
        status = status_of(exc)
        if status == 500:
            logger.error("internal error on %s: %r", request.url.path, exc)
        return respond(status, str(exc), type(exc).__name__, getattr(exc, "param", None))

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return respond(422, str(exc), "InvalidArgumentError")


class _BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a chunked body passes the limit (FastAPI re-raises HTTPException)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")


class _ServerMiddleware:
    """Pure ASGI middleware: body-size limit (413), per-route request count/latency metrics, and
    the fast path of the session routes (:mod:`compaction_gym.servers.fast_path`).

    Pure ASGI (not ``BaseHTTPMiddleware``) so that routes can still watch ``receive`` for the
    client's disconnect.
    """

    def __init__(
        self,
        app: Any,
        state: ServerState,
        fast: dict[tuple[str, str], FastRoute] | None = None,
        handlers: dict[Any, Any] | None = None,
    ) -> None:
        self.app, self.state = app, state
        self.fast, self.handlers = fast or {}, handlers or {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.args.max_request_bytes
        t0 = time.monotonic()
        status_box = {"status": 500, "started": False}
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await self._too_large(send, limit)
            self._observe(scope, 413, t0)
            return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status_box["status"], status_box["started"] = message["status"], True
            await send(message)

        try:
            fast = self.fast.get((scope.get("method"), scope.get("path")))
            if fast is None:
                await self.app(scope, limited_receive, tracking_send)
            else:
                await serve_fast(self.app, self.handlers, fast, scope, limited_receive, tracking_send)
        except Exception as exc:  # noqa: BLE001  (the last stop before the ASGI server)
            # Starlette answers a 500 and then re-raises, and the ASGI server drops the client's
            # keep-alive connection: answer here and keep it (docs/server.md, "Errors").
            if status_box["started"]:
                raise
            logger.exception("internal error on %s", scope.get("path"), exc_info=exc)
            await JSONResponse(
                error_body(500, f"{type(exc).__name__}: {exc}", type_=type(exc).__name__), 500
            )({"type": "http"}, _no_receive, tracking_send)
        finally:
            self._observe(scope, int(status_box["status"]), t0)

    async def _too_large(self, send: Any, limit: int) -> None:
        body = JSONResponse(
            error_body(413, f"request body exceeds {limit} bytes", type_="InvalidArgumentError"), 413
        )
        await body({"type": "http"}, _no_receive, send)

    def _observe(self, scope: dict[str, Any], status: int, t0: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        m = self.state.metrics
        m.requests.inc(route=route, method=scope.get("method", ""), status=str(status))
        m.request_latency.observe(time.monotonic() - t0, route=route)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
