"""The one path a tool call takes through the daemon, whichever route carried it.

``POST /v1/call``, ``POST /v1/batch`` and ``/mcp``'s ``tools/call`` (one,
or a JSON-RPC batch of them) read their own wire format, then hand their
calls to one :class:`CallPath`, in this order:

1. :meth:`CallPath.check_batch`: a batch of more than ``max_batch`` is 422;
2. :meth:`CallPath.check_arguments`: arguments over ``max_argument_bytes``
   are 413 (looked at only when the whole body is larger);
3. :meth:`CallPath.slots`: one of the token's in-flight slots per call, all
   taken before any runs, or none (429, or 422 for more than could ever
   fit); the request's own slot is :class:`~.limits.ConcurrencyLimit`'s;
4. :meth:`CallPath.run` / :meth:`CallPath.run_many`: the dispatcher, in the
   caller's session, its outcome counted in the metrics.

Each step raises an :class:`~agent_backend.errors.AgentBackendError`, which
each route writes in its own wire: ``/v1`` an ``ErrorBody`` with the status
of :func:`~.errors.status_for` (:class:`CallRoutes`), ``/mcp`` a JSON-RPC
error or an ``isError`` result (:mod:`.mcp_http`).

:class:`CallRoutes` answers the two ``/v1`` call routes in front of FastAPI
(pure ASGI: the body validated by the wire models in one pass, no
per-request dependency solving; through FastAPI a trivial call cost the
daemon 1.7x the CPU). FastAPI declares them for the OpenAPI document (and
its 405 on other methods) and never runs them. This module must never start a call before
its slots are held.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import orjson
import pydantic
from starlette.types import ASGIApp, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY
from agent_backend.daemon.errors import answer_for, body_validation_error, send_error
from agent_backend.daemon.limits import BODY_KEY, InFlight, check_batch_size
from agent_backend.daemon.metrics import Metrics
from agent_backend.daemon.sessions import SessionTable
from agent_backend.dispatch import Dispatcher, Session, ToolResult
from agent_backend.errors import AgentBackendError, RequestTooLarge
from agent_backend.tools import ToolCall
from agent_backend.wire import API_PREFIX, BatchRequest, BatchResponse, CallRequest, WireCall

__all__ = ["CallPath", "CallRoutes", "argument_size"]


def argument_size(arguments: Any) -> int:
    """The bytes of ``arguments`` as JSON (a string: its own UTF-8 bytes)."""
    if isinstance(arguments, str):
        return len(arguments.encode())
    try:
        return len(orjson.dumps(arguments))
    except TypeError:  # integers past 64 bits: the standard library writes them
        return len(json.dumps(arguments))


class CallPath:
    """The limits and the dispatcher that every route's tool calls go through."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        in_flight: InFlight,
        metrics: Metrics,
        max_batch: int,
        max_argument_bytes: int,
    ) -> None:
        self.dispatcher = dispatcher
        self.in_flight = in_flight
        """Each token's call slots, shared by every route (and the metrics)."""
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_argument_bytes = max_argument_bytes

    def __repr__(self) -> str:
        return (
            f"<CallPath max_batch={self.max_batch} max_argument_bytes={self.max_argument_bytes} "
            f"{self.in_flight!r}>"
        )

    def check_batch(self, size: int, *, unit: str = "calls") -> None:
        """422 for a batch of more than ``max_batch`` items (calls, or JSON-RPC messages)."""
        check_batch_size(size, self.max_batch, unit=unit)

    def check_arguments(self, body_bytes: int, calls: Iterable[tuple[str, Any]]) -> None:
        """413 when a call's arguments are larger than ``max_argument_bytes``.

        ``calls`` yields ``(what the message calls it, its arguments)``, and is read only
        when the whole body (``body_bytes``) is larger than the limit.
        """
        limit = self.max_argument_bytes
        if body_bytes <= limit:
            return  # every call's arguments are smaller than the whole body
        for label, arguments in calls:
            if arguments is not None and argument_size(arguments) > limit:
                raise RequestTooLarge(
                    f"the arguments of {label} are larger than {limit} bytes; send less at once",
                    limit=limit,
                    what="arguments",
                )

    @contextlib.contextmanager
    def slots(self, principal: str, calls: int, *, what: str = "a batch") -> Iterator[None]:
        """A slot of ``principal``'s concurrency per call for the block, all or none (see
        :meth:`~.limits.InFlight.take`); the request's own slot counts as the first."""
        with self.in_flight.hold(principal, calls, what=what):
            yield

    async def run(
        self,
        call: ToolCall,
        session: Session | None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's limit, as Dispatcher.call's
    ) -> ToolResult:
        """One call through the dispatcher; its result or its error counted in the metrics."""
        started = time.perf_counter()
        try:
            result = await self.dispatcher.call(call, timeout=timeout, session=session)
        except AgentBackendError as exc:
            self.metrics.observe_error(call.name, exc, time.perf_counter() - started)
            raise
        self.metrics.observe(result)
        return result

    async def run_many(
        self,
        calls: Sequence[ToolCall],
        session: Session | None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, as Dispatcher's
    ) -> list[ToolResult]:
        """Independent calls, concurrently, through the dispatcher; results in call order."""
        started = time.perf_counter()
        try:
            results = await self.dispatcher.call_many(calls, timeout=timeout, session=session)
        except AgentBackendError as exc:
            name = calls[0].name if calls else ""
            self.metrics.observe_error(name, exc, time.perf_counter() - started)
            raise
        for result in results:
            self.metrics.observe(result)
        return results


def _tool_call(call: WireCall, index: int) -> ToolCall:
    return ToolCall(call.id or f"call_{index}", call.name, call.arguments, "mcp", call.error)


def _labelled(calls: Sequence[WireCall]) -> Iterator[tuple[str, Any]]:
    for index, call in enumerate(calls):
        yield f"call {index} ({call.name!r})", call.arguments


class CallRoutes:
    """ASGI: ``POST /v1/call`` and ``POST /v1/batch`` through the :class:`CallPath`; the rest
    to ``app`` (FastAPI). The body was read by :class:`~.limits.BodyLimit`."""

    def __init__(self, app: ASGIApp, *, path: CallPath, sessions: SessionTable) -> None:
        self.app = app
        self.path = path
        self.sessions = sessions
        self._routes = {f"{API_PREFIX}/call": self._call, f"{API_PREFIX}/batch": self._batch}

    def _session(self, principal: str, session_id: str | None) -> Session | None:
        return None if session_id is None else self.sessions.get(principal, session_id)

    async def _call(self, principal: str, body: bytes) -> bytes:
        request = CallRequest.model_validate_json(body)
        self.path.check_arguments(len(body), _labelled([request]))
        session = self._session(principal, request.session)
        # One call: the request's own slot (ConcurrencyLimit) is its slot.
        result = await self.path.run(_tool_call(request, 0), session, timeout=request.timeout)
        return result.__pydantic_serializer__.to_json(result)

    async def _batch(self, principal: str, body: bytes) -> bytes:
        request = BatchRequest.model_validate_json(body)
        self.path.check_batch(len(request.calls))
        self.path.check_arguments(len(body), _labelled(request.calls))
        session = self._session(principal, request.session)
        calls = [_tool_call(call, index) for index, call in enumerate(request.calls)]
        with self.path.slots(principal, len(calls)):
            results = await self.path.run_many(calls, session, timeout=request.timeout)
        return BatchResponse(results=results).model_dump_json().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._routes.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            payload = await route(str(scope.get(PRINCIPAL_KEY, "")), scope.get(BODY_KEY, b""))
        except pydantic.ValidationError as exc:
            await send_error(send, body_validation_error(exc))
            return
        except Exception as exc:
            await send_error(send, answer_for(exc, method="POST", path=scope["path"]))
            return
        headers = [(b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
