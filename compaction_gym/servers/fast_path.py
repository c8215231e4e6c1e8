"""The session routes' valid requests, served without FastAPI's per-request machinery.

The engine worker's thread shares the GIL with the event loop, so every millisecond of CPU the
loop spends on a request is a millisecond the worker cannot drive the engine (docs/server.md,
"Performance"). For a valid JSON request to a hot route (``POST /compact_session/step``, ...),
:func:`serve_fast` does what FastAPI would, minus its generic layers (routing, dependency
solving, exception and exit-stack middlewares): it reads the body, parses it as FastAPI does
(``json.loads``) and validates it with the route's body model as FastAPI does
(``validate_python(..., from_attributes=True)``), calls the route's own endpoint and sends its
response. Errors raised by the endpoint go through the app's own exception handlers. Anything
else (another content type, an empty or invalid body, a failed validation, a disconnect or the
size limit met while the body arrives) is handed to the FastAPI app with the body replayed (and
the error, if reading it raised one), so every error response is FastAPI's, byte for byte.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import Response

Endpoint = Callable[..., Awaitable[Response]]
ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class FastRoute:
    """A route served by :func:`serve_fast`: its body model, its endpoint ``(body, request)`` and
    the FastAPI route object (the middleware's metrics read ``scope["route"].path``)."""

    adapter: TypeAdapter
    endpoint: Endpoint
    route: Any


def fast_routes(app: Any, paths: Iterable[str]) -> dict[tuple[str, str], FastRoute]:
    """``("POST", path) -> FastRoute`` for each of ``paths``, a POST route of ``app`` whose endpoint
    takes ``(body, request)``. The endpoint and its body model come from the route itself (the
    model is ``body``'s annotation, resolved as FastAPI resolves it), so the fast path cannot
    validate with another model than FastAPI does."""
    routes = {
        getattr(r, "path", None): r for r in app.routes if "POST" in (getattr(r, "methods", None) or ())
    }
    out = {}
    for path in paths:
        route = routes[path]
        body = next(iter(inspect.signature(route.endpoint).parameters))
        model = typing.get_type_hints(route.endpoint)[body]
        out["POST", path] = FastRoute(TypeAdapter(model), route.endpoint, route)
    return out


def _is_json(scope: dict[str, Any]) -> bool:
    """The request says ``Content-Type: application/json`` (what FastAPI parses as JSON; any
    other type, ``+json`` ones included, takes FastAPI's own path)."""
    for name, value in scope.get("headers") or ():
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def serve_fast(
    app: ASGIApp,
    handlers: dict[Any, Callable[..., Awaitable[Response]]],
    fast: FastRoute,
    scope: dict[str, Any],
    receive: Any,
    send: Any,
) -> None:
    """Serve one request to ``fast``'s route; see the module docstring.

    ``app`` is the rest of the ASGI stack (FastAPI's router below the middleware that calls this),
    ``handlers`` the app's exception handlers (``app.exception_handlers``).
    """
    if not _is_json(scope):
        await app(scope, receive, send)
        return
    messages: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    while True:
        try:
            message = await receive()  # the middleware's receive: raises past the size limit
        except Exception as exc:  # FastAPI meets the same error at the same point of the body
            await app(scope, _replay(messages, receive, exc), send)
            return
        messages.append(message)
        if message["type"] != "http.request":  # disconnected while the body arrived
            await app(scope, _replay(messages, receive), send)
            return
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    try:
        model = fast.adapter.validate_python(json.loads(body), from_attributes=True) if body else None
    except (ValueError, ValidationError):  # json.JSONDecodeError is a ValueError
        model = None
    if model is None:  # FastAPI answers with its own 400/422
        await app(scope, _replay(messages, receive), send)
        return
    scope["route"] = fast.route
    request = Request(scope, receive)
    try:
        response = await fast.endpoint(model, request)
    except Exception as exc:
        handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
        if handler is None:
            raise
        response = await handler(request, exc)
    await response(scope, receive, send)


def _replay(
    messages: list[dict[str, Any]], receive: Any, error: Exception | None = None
) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A ``receive`` that returns ``messages`` again, then raises ``error`` once (if any), then reads on."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        nonlocal error
        if pending:
            return pending.pop(0)
        if error is not None:
            exc, error = error, None
            raise exc
        return await receive()

    return replayed
