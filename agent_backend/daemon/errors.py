"""Errors over the wire: every failure becomes a JSON :class:`~agent_backend.wire.ErrorBody`.

One table says which HTTP status each error of the tree gets. Client mistakes
are 4xx and nothing else: a body that does not parse or match is 422, an
unknown route 404, a closed session 410; a token or a session at its limit
(calls in flight, sessions open) is 429 with ``Retry-After``, since waiting
clears it. Infrastructure failures are 5xx:
a backend that cannot be reached is 503, one that lost a call 502, one that
did not come back in time 504. A bug is a 500 whose body says nothing of
the daemon's internals (the traceback goes to the log).

The same body is written by the FastAPI exception handlers (errors raised in
routes), by the call routes in front of FastAPI (:mod:`.calls`) and by the
pure ASGI middlewares (refusals before a route runs); :func:`answer_for`
decides, for all of them, what an exception is answered with and logs it.
This module must never put a traceback, a token or a whole request into a body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Send

from agent_backend.errors import (
    AgentBackendError,
    BackendError,
    BackendUnavailable,
    ConfigError,
    DaemonError,
    InvalidRequest,
    MethodNotAllowed,
    ModelFacingError,
    NotFound,
    PoolBusy,
    PoolClosed,
    RateLimited,
    ResourceUnavailable,
    SchemaError,
    ToolFailed,
    ToolTimeout,
    TooManySessions,
    clip,
)
from agent_backend.wire import ErrorBody, error_to_wire

__all__ = [
    "answer_for",
    "body_validation_error",
    "error_body",
    "error_headers",
    "error_response",
    "install_exception_handlers",
    "send_error",
    "status_for",
    "validation_error",
]

logger = logging.getLogger("agent_backend.daemon")

# Most validation issues reported for one request (the rest are counted).
_MAX_ISSUES = 20

# Most specific first: the first class in the tuple that matches wins.
_STATUS: Sequence[tuple[type[AgentBackendError], int]] = (
    (ModelFacingError, 422),
    (PoolClosed, 410),
    (PoolBusy, 429),
    (ToolTimeout, 504),
    (BackendUnavailable, 503),
    (ResourceUnavailable, 503),
    (BackendError, 502),
    (ToolFailed, 502),
    (ConfigError, 500),
    (SchemaError, 500),
)


def status_for(exc: AgentBackendError) -> int:
    """The HTTP status that ``exc`` is answered with."""
    if isinstance(exc, DaemonError):
        return exc.status
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(exc: AgentBackendError) -> bytes:
    return ErrorBody(error=error_to_wire(exc)).model_dump_json().encode()


# The refusals that clear by waiting: each carries the seconds to wait, sent as Retry-After.
_RETRY_AFTER = (RateLimited, TooManySessions, PoolBusy)


def error_headers(exc: AgentBackendError) -> dict[str, str]:
    """The headers ``exc``'s answer carries: ``Retry-After`` (whole seconds), ``WWW-Authenticate``."""
    headers: dict[str, str] = {}
    if isinstance(exc, _RETRY_AFTER):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if status_for(exc) == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(exc: AgentBackendError) -> Response:
    return Response(
        error_body(exc),
        status_code=status_for(exc),
        media_type="application/json",
        headers=error_headers(exc),
    )


async def send_error(send: Send, exc: AgentBackendError) -> None:
    """Answer a raw ASGI request with ``exc``'s error body (for middlewares)."""
    body = error_body(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(exc).items()]
    await send({"type": "http.response.start", "status": status_for(exc), "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _issues(errors: Iterable[Any]) -> list[dict[str, Any]]:
    issues: list[dict[str, Any]] = []
    for error in errors:
        if not isinstance(error, dict):
            continue
        location = [
            part if isinstance(part, (int, str)) else str(part) for part in error.get("loc", ())
        ]
        # The input itself is left out: it may be large, and the client has it.
        issues.append({"loc": location, "msg": clip(str(error.get("msg", "")), 300)})
    return issues


def validation_error(errors: Sequence[Any]) -> InvalidRequest:
    issues = _issues(errors)
    shown = issues[:_MAX_ISSUES]
    first = shown[0] if shown else {"loc": [], "msg": "invalid request"}
    where = ".".join(str(part) for part in first["loc"]) or "body"
    more = f" (and {len(issues) - 1} more)" if len(issues) > 1 else ""
    return InvalidRequest(f"{where}: {first['msg']}{more}", issues=shown)


def body_validation_error(exc: pydantic.ValidationError) -> InvalidRequest:
    """The 422 for a body that does not parse or match its model, located as FastAPI's are."""
    errors = exc.errors(include_url=False, include_input=False)
    return validation_error(
        [{"loc": ["body", *error["loc"]], "msg": error["msg"]} for error in errors]
    )


def answer_for(exc: Exception, *, method: str, path: str) -> AgentBackendError:
    """What a route that raised ``exc`` answers: the error itself (logged when it is a 5xx),
    or, for a bug, a 500 that says nothing of the daemon's internals (the traceback is logged)."""
    if isinstance(exc, AgentBackendError):
        if status_for(exc) >= 500:
            logger.warning("%s %s: %s: %s", method, path, type(exc).__name__, exc)
        return exc
    logger.error("%s %s failed", method, path, exc_info=exc)
    return AgentBackendError("internal error in the daemon; see its log")


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def install_exception_handlers(app: FastAPI) -> None:
    """Make every error a route raises an :class:`ErrorBody` with the right status."""

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc.errors()))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error: DaemonError
        if exc.status_code == 404:
            error = NotFound(f"no route {clip(request.url.path, 200)}")
        elif exc.status_code == 400 and request.method in _BODY_METHODS:
            # FastAPI's answer to a body json cannot even decode (not UTF-8): a 422 like any
            # other body that is not JSON, as the OpenAPI document says.
            error = validation_error([{"loc": ["body"], "msg": "not UTF-8 JSON"}])
        elif exc.status_code == 405:
            error = MethodNotAllowed(
                f"{request.method} is not allowed on {clip(request.url.path, 200)}"
            )
        else:
            error = DaemonError(clip(str(exc.detail), 500), status=exc.status_code)
        return error_response(error)

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(answer_for(exc, method=request.method, path=request.url.path))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(AgentBackendError, on_error)
    app.add_exception_handler(Exception, on_error)
