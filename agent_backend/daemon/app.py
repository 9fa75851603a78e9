"""The daemon's ASGI app: versioned JSON routes around one :class:`Dispatcher`.

Routes (all under ``/v1`` but metrics, the OpenAPI document and MCP):

=======  =========================  ==================================================
GET      /v1/health/live            liveness; the only route without a token
GET      /v1/health/ready           readiness: the pool has a host up, not draining
GET      /v1/tools?format=openai    the tool list (openai, anthropic or mcp shape)
POST     /v1/call                   one call -> ToolResult
POST     /v1/batch                  independent calls, run concurrently -> results in order
POST     /v1/sessions               open a session -> {id, host, workspace}
POST     /v1/sessions/{id}/fork     {n} sessions starting as copies of it -> {sessions}
DELETE   /v1/sessions/{id}          close it
GET      /metrics                   Prometheus text exposition
GET      /openapi.json              this API's OpenAPI document
*        /mcp                       MCP streamable HTTP transport (sessions, JSON; docs/mcp.md)
=======  =========================  ==================================================

A call's outcome is a :class:`~agent_backend.dispatch.ToolResult` with 200,
whether the tool succeeded or not (a failed result is the model's business);
anything else is an :class:`~agent_backend.wire.ErrorBody` with a 4xx/5xx
(:mod:`agent_backend.daemon.errors`).

Middlewares (pure ASGI), outermost first: bearer auth, body limit,
per-token concurrency limit, idempotency, the two call routes
(:class:`~.calls.CallRoutes`, the call path ``/mcp`` shares); then FastAPI
for everything else. This module must never close the dispatcher or its
pool (the server runner owns them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal, NoReturn

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY, BearerAuth
from agent_backend.daemon.calls import CallPath, CallRoutes
from agent_backend.daemon.errors import install_exception_handlers
from agent_backend.daemon.idempotency import Idempotency, IdempotencyStore
from agent_backend.daemon.limits import BodyLimit, ConcurrencyLimit, InFlight
from agent_backend.daemon.mcp_http import JsonRpcRefusals, McpEndpoint, loopback_guard, mount
from agent_backend.daemon.mcp_sessions import McpSessions
from agent_backend.daemon.metrics import CONTENT_TYPE, Metrics
from agent_backend.daemon.sessions import SessionTable
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.dispatch import Dispatcher, ToolResult
from agent_backend.errors import InvalidRequest
from agent_backend.wire import (
    API_PREFIX,
    BatchRequest,
    BatchResponse,
    CallRequest,
    ErrorBody,
    ForkRequest,
    ForkResponse,
    Liveness,
    PoolReadiness,
    Readiness,
    SessionInfo,
    ToolsResponse,
)

__all__ = ["DaemonApp", "DaemonState", "create_app"]

_JSON = "application/json"
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        401: "No bearer token, or a wrong one.",
        409: "The Idempotency-Key was used for a different request.",
        413: "The body, or one call's arguments, is too large.",
        422: "The body is not JSON or does not match the schema.",
        429: "This token has too many calls in flight (each call of a batch counts), or too "
        "many sessions open; retry after Retry-After seconds.",
        503: "The daemon is shutting down, or a backend is unavailable.",
    }.items()
}
_SESSION_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    404: {"model": ErrorBody, "description": "No such session for this token."},
    410: {"model": ErrorBody, "description": "The session was closed (reaped when idle)."},
}


@dataclasses.dataclass
class DaemonState:
    """What the server runner tells the app: whether shutdown has begun."""

    draining: bool = False


def _principal(scope: Scope) -> str:
    return str(scope.get(PRINCIPAL_KEY, ""))


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type=_JSON)


class _Routes:
    """The FastAPI route handlers (all but the two call routes), bound to one dispatcher and
    its daemon's state."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        state: DaemonState,
        sessions: SessionTable,
    ) -> None:
        self.dispatcher = dispatcher
        self.state = state
        self.sessions = sessions

    async def open_session(self, scope: Scope) -> Response:
        session = await self.sessions.open(_principal(scope))
        host = session.host.name if session.host is not None else self.dispatcher.pool.kind
        # A pool without hosts (Ray) gives its sessions no workspace.
        info = SessionInfo(id=session.id, host=host, workspace=session.workspace or "")
        return _json(info, 201)

    async def fork_session(self, scope: Scope, session_id: str, body: ForkRequest) -> Response:
        forks = await self.sessions.fork(_principal(scope), session_id, body.n)
        infos = [
            SessionInfo(
                id=fork.id,
                host=fork.host.name if fork.host is not None else self.dispatcher.pool.kind,
                workspace=fork.workspace or "",
            )
            for fork in forks
        ]
        return _json(ForkResponse(sessions=infos), 201)

    async def close_session(self, scope: Scope, session_id: str) -> Response:
        await self.sessions.close(_principal(scope), session_id)
        return Response(status_code=204)

    async def tools(self, fmt: Literal["openai", "anthropic", "mcp"], *, strict: bool) -> Response:
        registry = self.dispatcher.registry
        if strict and fmt != "openai":
            raise InvalidRequest("strict=true is for format=openai (OpenAI's strict mode)")
        exported = (
            registry.to_openai(strict=strict)
            if fmt == "openai"
            else registry.to_anthropic()
            if fmt == "anthropic"
            else registry.to_mcp()
        )
        return _json(ToolsResponse(format=fmt, tools=exported))

    def readiness(self) -> Readiness:
        dispatcher = self.dispatcher
        pools = {}
        for name, backend in dispatcher.pools.items():
            up, total = backend.capacity()
            pools[name] = PoolReadiness(
                backend=backend.kind, up=up, total=total, guarantees=backend.guarantees()
            )
        down = [name for name, pool in pools.items() if pool.up == 0]
        units = {name: dispatcher.pools[name].capacity_unit for name in down}
        reason = None
        if self.state.draining:
            reason = "shutting down"
        elif dispatcher.is_closed():
            reason = "the dispatcher is closed"
        elif down:
            what = [f"no {pools[name].backend} {units[name]} is up" for name in down]
            reason = (
                what[0]
                if len(pools) == 1
                else "; ".join(
                    f"pool {name!r}: {text}" for name, text in zip(down, what, strict=True)
                )
            )
        default = pools[dispatcher.default]
        return Readiness(
            status="ready" if reason is None else "not ready",
            backend=default.backend,
            hosts_up=default.up,
            hosts=default.total,
            draining=self.state.draining,
            reason=reason,
            pools=pools,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class DaemonApp:
    """The ASGI app: pure-ASGI middlewares (auth, limits, idempotency, call routes) around FastAPI."""

    api: FastAPI
    """The FastAPI app: every route, the OpenAPI document, the exception handlers."""
    stack: ASGIApp
    state: DaemonState
    dispatcher: Dispatcher
    sessions: SessionTable
    idempotency: IdempotencyStore
    metrics: Metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stack(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        return self.api.openapi()


def _guarded(
    app: ASGIApp, settings: DaemonSettings, state: DaemonState, in_flight: InFlight
) -> ASGIApp:
    """``app`` behind the daemon's token check, body limit and per-token concurrency limit.

    ``/v1`` and ``/mcp`` share one ``in_flight``: the limit counts a token's calls on both.
    """
    return BearerAuth(
        BodyLimit(
            ConcurrencyLimit(app, in_flight=in_flight, draining=lambda: state.draining),
            max_bytes=settings.max_body_bytes,
        ),
        tokens=settings.tokens,
    )


def _mcp_app(
    path: CallPath,
    settings: DaemonSettings,
    *,
    sessions: SessionTable,
    state: DaemonState,
) -> tuple[ASGIApp, McpSessions]:
    """``/mcp`` (:mod:`agent_backend.daemon.mcp_http`) behind the same auth and limits as ``/v1``,
    its tool calls on the same call path."""
    from agent_backend.mcp import McpHandlers
    from agent_backend.tokens import is_loopback

    mcp_sessions = McpSessions(sessions)
    endpoint = McpEndpoint(
        McpHandlers(path.dispatcher, run=path.run),
        mcp_sessions,
        path=path,
        # DNS rebinding protection on loopback, as the mcp package does.
        guard=loopback_guard if is_loopback(settings.host) else None,
    )
    stack = JsonRpcRefusals(_guarded(endpoint, settings, state, path.in_flight))
    return stack, mcp_sessions


def create_app(
    dispatcher: Dispatcher,
    settings: DaemonSettings,
    *,
    state: DaemonState | None = None,
) -> DaemonApp:
    """The daemon's ASGI app for ``dispatcher`` (which the caller opens and closes)."""
    from agent_backend import __version__

    state = state if state is not None else DaemonState()
    sessions = SessionTable(
        dispatcher,
        max_per_token=settings.max_sessions_per_token,
        retry_after=settings.retry_after,
    )
    store = IdempotencyStore(
        ttl=settings.idempotency_ttl,
        max_entries=settings.idempotency_max_entries,
        max_bytes=settings.idempotency_max_bytes,
    )

    def extra_gauges() -> dict[str, float]:
        idem = store.statistics()
        return {
            "idempotency_running": float(idem.running),
            "idempotency_kept": float(idem.kept),
            "idempotency_kept_bytes": float(idem.kept_bytes),
            "idempotency_replays": float(idem.replays),
            "idempotency_conflicts": float(idem.conflicts),
            "requests_in_flight": float(in_flight.total()),
        }

    in_flight = InFlight(limit=settings.max_concurrent_per_token, retry_after=settings.retry_after)
    metrics = Metrics(dispatcher, extra=extra_gauges)
    path = CallPath(
        dispatcher,
        in_flight=in_flight,
        metrics=metrics,
        max_batch=settings.max_batch,
        max_argument_bytes=settings.max_argument_bytes,
    )
    routes = _Routes(dispatcher, state, sessions)
    mcp = _mcp_app(path, settings, sessions=sessions, state=state) if settings.mcp else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.draining = True
            await sessions.aclose()
            if mcp is not None:
                mcp[1].forget()

    app = FastAPI(
        title="agent-backend daemon",
        version=__version__,
        summary="Run AI agents' tool calls on a pool of hosts.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    install_exception_handlers(app)

    v1 = APIRouter(prefix=API_PREFIX)

    @v1.get("/health/live", response_model=Liveness, tags=["health"])
    async def live() -> Response:
        """Liveness: the process answers. Needs no token."""
        return Response(b'{"status":"ok"}', media_type=_JSON)

    @v1.get(
        "/health/ready",
        response_model=Readiness,
        tags=["health"],
        responses={**_ERRORS, 503: {"model": Readiness, "description": "Not ready."}},
    )
    async def ready() -> Response:
        """Readiness: the pool has a host up and the daemon is not shutting down."""
        readiness = routes.readiness()
        return _json(readiness, 200 if readiness.status == "ready" else 503)

    @v1.get("/tools", response_model=ToolsResponse, tags=["tools"], responses=_ERRORS)
    async def tools(
        format: Annotated[
            Literal["openai", "anthropic", "mcp"],
            Query(description="The provider shape of the tool list."),
        ] = "openai",
        strict: Annotated[
            bool,
            Query(
                description="format=openai only: each tool that has one in its strict-mode "
                "variant (every property required, optional ones nullable), with strict: true."
            ),
        ] = False,
    ) -> Response:
        """The tools this daemon runs, in OpenAI, Anthropic or MCP shape."""
        return await routes.tools(format, strict=strict)

    # Declared for the OpenAPI document (and FastAPI's 405 on other methods): CallRoutes
    # answers every POST to them in front of FastAPI, so these bodies never run.
    @v1.post("/call", response_model=ToolResult, tags=["calls"], responses=_SESSION_ERRORS)
    async def call(body: CallRequest) -> NoReturn:
        """Run one tool call. A failed call is a 200 result with ``ok: false``.

        Send ``Idempotency-Key`` to make retries safe: a retry returns the first result.
        """
        raise AssertionError("POST /v1/call is answered by CallRoutes")

    @v1.post("/batch", response_model=BatchResponse, tags=["calls"], responses=_SESSION_ERRORS)
    async def batch(body: BatchRequest) -> NoReturn:
        """Run independent calls concurrently; the results come back in call order."""
        raise AssertionError("POST /v1/batch is answered by CallRoutes")

    @v1.post(
        "/sessions",
        response_model=SessionInfo,
        status_code=201,
        tags=["sessions"],
        responses=_ERRORS,
    )
    async def open_session(request: Request) -> Response:
        """Open a session: a private workspace on one host that later calls can name."""
        return await routes.open_session(request.scope)

    @v1.post(
        "/sessions/{session_id}/fork",
        response_model=ForkResponse,
        status_code=201,
        tags=["sessions"],
        responses=_SESSION_ERRORS,
    )
    async def fork_session(request: Request, session_id: str, body: ForkRequest) -> Response:
        """Fork a session between its calls: ``n`` new sessions whose workspaces start as copies
        of its own (copy-on-write where the host can), each independent; close each."""
        return await routes.fork_session(request.scope, session_id, body)

    @v1.delete(
        "/sessions/{session_id}",
        status_code=204,
        response_class=Response,
        tags=["sessions"],
        responses=_SESSION_ERRORS,
    )
    async def close_session(request: Request, session_id: str) -> Response:
        """Close a session: its calls are ended, its workspace removed."""
        return await routes.close_session(request.scope, session_id)

    app.include_router(v1)

    @app.get(
        "/metrics",
        response_class=Response,
        tags=["health"],
        responses={200: {"content": {CONTENT_TYPE: {}}}, **_ERRORS},
    )
    async def prometheus() -> Response:
        """Prometheus metrics (text exposition format)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
            schema["security"] = [{"bearer": []}]
            schema["paths"][f"{API_PREFIX}/health/live"]["get"]["security"] = []
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # Pure ASGI, outermost first; the call routes never reach FastAPI (calls.py).
    stack = _guarded(
        Idempotency(
            CallRoutes(app, path=path, sessions=sessions),
            store=store,
            max_response_bytes=min(settings.idempotency_max_bytes, 16 << 20),
        ),
        settings,
        state,
        in_flight,
    )
    if mcp is not None:  # /mcp has its own stack, beside FastAPI's (mcp_http.py)
        stack = mount(stack, mcp[0])
    return DaemonApp(
        api=app,
        stack=stack,
        state=state,
        dispatcher=dispatcher,
        sessions=sessions,
        idempotency=store,
        metrics=metrics,
    )
