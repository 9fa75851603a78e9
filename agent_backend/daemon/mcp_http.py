"""``/mcp``: MCP's streamable HTTP transport, answered in the daemon's ASGI fast path.

Protocol versions 2024-11-05 to 2025-11-25 (the initialize-handshake era,
the one with sessions), every answer ``application/json``:

* ``POST`` carries one JSON-RPC message, or a batch at 2025-03-26 (the only
  version that has them). Requests get their response (a batch: the array
  of them), notifications and responses ``202``. ``initialize`` negotiates
  the version (the client's if served, else the latest) and opens an MCP
  session (``Mcp-Session-Id`` on the answer), which is one agent_backend
  session (:mod:`agent_backend.daemon.mcp_sessions`). Later requests send
  the id; one without is served in its token's stateless session. An
  ``MCP-Protocol-Version`` header must name the negotiated version (400
  otherwise); a 2026-07-28 request (``server/discover``) gets
  ``-32022 UNSUPPORTED_PROTOCOL_VERSION`` naming the served versions, so
  SDK clients fall back to the handshake.
* ``GET`` is 405: this server sends nothing unasked, so it offers no SSE stream.
* ``DELETE`` with the session id ends the session (workspace removed).

A ``tools/call`` is ended, its processes killed, when the client sends
``notifications/cancelled`` for it (the SDK clients do when their read
timeout fires) or disconnects. The methods themselves are
:class:`~agent_backend.mcp.McpHandlers`', the ones stdio runs.

``/mcp``'s tool calls take ``/v1``'s call path (:class:`~.calls.CallPath`),
limits counted together: a batch has at most ``max_batch`` messages, and
holds one of its token's ``max_concurrent_per_token`` slots per
``tools/call`` in it, all taken before any runs (429 with ``Retry-After``
when they are not free, nothing run). The daemon's refusals before this
endpoint (bearer token, body size, per-token concurrency, shutdown) keep
their status but answer, on ``/mcp``, with a JSON-RPC error body whose
message the MCP clients show (:class:`JsonRpcRefusals`); so do this
endpoint's own (Host/Origin, an argument over ``max_argument_bytes``, a
batch over its limits, an unknown session).
This module must never run a call for a token that does not own its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Final

import anyio
import mcp_types as types
import orjson
import pydantic
from mcp_types.version import LATEST_MODERN_VERSION
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY
from agent_backend.daemon.calls import CallPath
from agent_backend.daemon.errors import error_headers, status_for
from agent_backend.daemon.limits import BODY_KEY
from agent_backend.daemon.mcp_sessions import McpSession, McpSessions
from agent_backend.errors import AgentBackendError, DaemonError, InvalidRequest, clip
from agent_backend.mcp import SERVED_VERSIONS, JsonRpcError, McpHandlers
from agent_backend.wire import error_to_wire

__all__ = [
    "MCP_PATH",
    "JsonRpcRefusals",
    "McpEndpoint",
    "loopback_guard",
    "mount",
]

logger = logging.getLogger("agent_backend.daemon")

MCP_PATH: Final = "/mcp"
#: The version of a request without a session and without ``MCP-Protocol-Version`` (the spec's).
_DEFAULT_VERSION: Final = "2025-03-26"
_BATCH_VERSIONS: Final = frozenset({"2025-03-26"})

# A body larger than this is counted before it is parsed whole (:func:`_array_longer_than`).
_COUNT_FIRST_BYTES: Final = 64 << 10
_DECODER: Final = json.JSONDecoder()
_SPACE: Final = re.compile(r"[ \t\n\r]*")

_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_LOOPBACK_NAMES: Final = ("127.0.0.1", "localhost", "[::1]")


class _Refusal(Exception):
    """An HTTP-level answer: ``status`` with a JSON-RPC error body (no request id)."""

    def __init__(
        self,
        status: int,
        error: JsonRpcError,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(error.message)
        self.status = status
        self.error = error
        self.headers = list(headers)

    @classmethod
    def of(cls, exc: AgentBackendError) -> _Refusal:
        status = status_for(exc)
        error = _refusal_error(status, str(exc), error_to_wire(exc).model_dump())
        headers = [(k.lower().encode(), v.encode()) for k, v in error_headers(exc).items()]
        return cls(status, error, headers)


def _refusal_error(status: int, message: str, detail: Any = None) -> JsonRpcError:
    """A refusal's JSON-RPC error: the status and words for MCP clients, the daemon's error too.

    ``type`` and ``fields`` (the daemon's :class:`~agent_backend.wire.ErrorDetail`, as
    ``/v1`` sends it) ride beside ``code`` and ``message``: JSON-RPC clients ignore
    members they do not know, and the daemon's own clients read them.
    """
    if not isinstance(detail, dict):
        detail = error_to_wire(DaemonError(message, status=status)).model_dump()
    code = types.INVALID_REQUEST if status < 500 else types.INTERNAL_ERROR
    phrase = http.HTTPStatus(status).phrase if status in http.HTTPStatus._value2member_map_ else ""
    extra = {"type": detail.get("type", "DaemonError"), "fields": detail.get("fields", {})}
    return JsonRpcError(code, f"{status} {phrase}: {message}", {"status": status}, extra=extra)


def _error_message(request_id: Any, error: JsonRpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": error.to_wire()}


async def _send(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    all_headers = [*(_JSON_HEADERS if body else []), *headers]
    all_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def _send_refusal(send: Send, refusal: _Refusal) -> None:
    body = orjson.dumps(_error_message(None, refusal.error))
    await _send(send, refusal.status, body, refusal.headers)


def _host_allowed(value: str, names: Sequence[str], prefixes: Sequence[str] = ("",)) -> bool:
    for prefix in prefixes:
        for name in names:
            base = prefix + name
            if value == base or (value.startswith(base + ":") and value[len(base) + 1 :].isdigit()):
                return True
    return False


def loopback_guard(scope: Scope) -> _Refusal | None:
    """DNS rebinding protection for a daemon on loopback: Host and Origin must be loopback."""
    host = origin = None
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
        elif name == b"origin":
            origin = value.decode("latin-1")
    if host is not None and not _host_allowed(host, _LOOPBACK_NAMES):
        return _Refusal(
            421,
            _refusal_error(
                421,
                f"Host {clip(host, 100)!r} is not this daemon's: it listens on loopback and "
                "answers only Host 127.0.0.1, localhost or [::1] (DNS rebinding protection)",
            ),
        )
    if origin and not _host_allowed(origin, _LOOPBACK_NAMES, ("http://", "https://")):
        return _Refusal(
            403,
            _refusal_error(
                403,
                f"Origin {clip(origin, 100)!r} may not call this daemon: it listens on loopback "
                "and accepts only loopback origins (DNS rebinding protection)",
            ),
        )
    return None


class McpEndpoint:
    """The ASGI app of ``/mcp`` (behind the daemon's auth and limits; see the module docstring)."""

    def __init__(
        self,
        handlers: McpHandlers,
        sessions: McpSessions,
        *,
        path: CallPath,
        guard: Callable[[Scope], _Refusal | None] | None = None,
    ) -> None:
        self.handlers = handlers
        """The MCP methods; its ``tools/call`` runs on ``path`` (``McpHandlers(run=path.run)``)."""
        self.sessions = sessions
        self.path = path
        """The daemon's call path: the limits a batch is checked against, its slots (see above)."""
        self.guard = guard

    def __repr__(self) -> str:
        return f"<McpEndpoint {self.sessions!r}>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.guard is not None and (refusal := self.guard(scope)) is not None:
                raise refusal
            method = scope["method"]
            if method == "POST":
                await self._post(scope, receive, send)
            elif method == "DELETE":
                await self._delete(scope, send)
            else:
                allow = [(b"allow", b"POST, DELETE")]
                message = (
                    "this server sends no messages unasked, so it offers no SSE stream; "
                    "POST requests to it"
                    if method == "GET"
                    else f"{clip(method, 20)} is not allowed on /mcp (POST, DELETE)"
                )
                raise _Refusal(405, _refusal_error(405, message), allow)
        except _Refusal as refusal:
            await _send_refusal(send, refusal)

    # -- DELETE -----------------------------------------------------------------------------------

    async def _delete(self, scope: Scope, send: Send) -> None:
        session_id = _header(scope, b"mcp-session-id")
        if session_id is None:
            raise _Refusal(400, _refusal_error(400, "DELETE needs the Mcp-Session-Id to end"))
        try:
            await self.sessions.close(str(scope.get(PRINCIPAL_KEY, "")), session_id)
        except AgentBackendError as exc:
            raise _Refusal.of(exc) from None
        await _send(send, 204, b"")

    # -- POST -------------------------------------------------------------------------------------

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        content_type = accept = session_id = version_header = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == b"accept":
                accept = value
            elif name == b"mcp-session-id":
                session_id = value.decode("latin-1")
            elif name == b"mcp-protocol-version":
                version_header = value.decode("latin-1")
        if content_type is None or not content_type.lower().startswith(b"application/json"):
            raise _Refusal(415, _refusal_error(415, "POST a JSON-RPC message as application/json"))
        if accept is not None and not _accepts_json(accept):
            raise _Refusal(
                406,
                _refusal_error(406, "this server answers in application/json; accept it"),
            )
        body = scope.get(BODY_KEY, b"")
        max_batch = self.path.max_batch
        if len(body) > _COUNT_FIRST_BYTES and _array_longer_than(body, max_batch):
            raise _Refusal.of(
                InvalidRequest(
                    f"a batch has at most {max_batch} messages; this one has more",
                    issues=[{"loc": ["body"], "msg": f"more than {max_batch} messages"}],
                )
            )
        try:
            decoded = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            error = JsonRpcError(types.PARSE_ERROR, f"Parse error: the body is not JSON ({exc})")
            raise _Refusal(400, error) from None

        principal = str(scope.get(PRINCIPAL_KEY, ""))
        if _is_initialize(decoded):
            await self._initialize(decoded, principal, send)
            return

        mcp: McpSession | None = None
        if session_id is not None:
            try:
                mcp = self.sessions.get(principal, session_id)
            except AgentBackendError as exc:
                raise _Refusal.of(exc) from None
            version = mcp.version
            if version_header is not None and version_header != version:
                raise _Refusal(
                    400,
                    _refusal_error(
                        400,
                        f"MCP-Protocol-Version {clip(version_header, 40)!r} is not the version "
                        f"this session negotiated ({version!r})",
                    ),
                )
        else:
            version = version_header or _DEFAULT_VERSION
            if version not in SERVED_VERSIONS:
                raise _Refusal(400, _unsupported(version))

        if isinstance(decoded, list):
            if version not in _BATCH_VERSIONS:
                raise _Refusal(
                    400,
                    JsonRpcError(
                        types.INVALID_REQUEST,
                        f"JSON-RPC batches are not part of protocol {version} (only 2025-03-26 "
                        "has them); POST one message at a time",
                    ),
                )
            if not decoded:
                raise _Refusal(400, JsonRpcError(types.INVALID_REQUEST, "an empty batch"))
            try:  # as /v1/batch does, before any of its calls is looked at
                self.path.check_batch(len(decoded), unit="messages")
            except AgentBackendError as exc:
                raise _Refusal.of(exc) from None
            messages = decoded
        else:
            messages = [decoded]

        exchange = _Exchange(self, principal, version, mcp)
        # As /v1/batch: arguments checked, then a slot per tools/call, all before any runs (one
        # message: the request's own slot, ConcurrencyLimit's, is its call's).
        calls = sum(1 for message in messages if _kind(message) == "request" and _is_call(message))
        with contextlib.ExitStack() as held:
            try:
                self.path.check_arguments(len(body), _call_arguments(messages))
                held.enter_context(self.path.slots(principal, calls, what="a JSON-RPC batch"))
            except AgentBackendError as exc:
                raise _Refusal.of(exc) from None
            replies = await exchange.run(messages, receive)
        if exchange.disconnected:
            return  # nobody to answer
        if not replies:
            await _send(send, 202, b"")
            return
        body = orjson.dumps(replies if isinstance(decoded, list) else replies[0])
        await _send(send, 200, body)

    async def _initialize(self, decoded: dict[str, Any], principal: str, send: Send) -> None:
        try:
            request = types.JSONRPCRequest.model_validate(decoded)
        except pydantic.ValidationError:
            raise _Refusal(400, _invalid_envelope()) from None
        try:
            version, result = self.handlers.initialize(request.params)
        except JsonRpcError as error:
            await _send(send, 200, orjson.dumps(_error_message(request.id, error)))
            return
        try:
            mcp = await self.sessions.create(principal, version)
        except AgentBackendError as exc:
            raise _Refusal.of(exc) from None
        logger.info("MCP session opened: %r", mcp)
        body = orjson.dumps({"jsonrpc": "2.0", "id": request.id, "result": result})
        await _send(send, 200, body, [(b"mcp-session-id", mcp.id.encode())])


class _Exchange:
    """The messages of one POST: requests answered, notifications applied, in one task group."""

    def __init__(
        self, endpoint: McpEndpoint, principal: str, version: str, mcp: McpSession | None
    ) -> None:
        self.endpoint = endpoint
        self.principal = principal
        self.version = version
        self.mcp = mcp
        self.disconnected = False

    async def run(self, messages: list[Any], receive: Receive) -> list[dict[str, Any]]:
        replies: list[dict[str, Any] | None] = [None] * len(messages)
        jobs: list[tuple[int, types.JSONRPCRequest]] = []
        for index, message in enumerate(messages):
            kind = _kind(message)
            if kind == "request":
                try:
                    jobs.append((index, types.JSONRPCRequest.model_validate(message)))
                except pydantic.ValidationError:
                    replies[index] = _error_message(_id_of(message), _invalid_envelope())
            elif kind == "notification":
                self._notify(message)
            elif kind == "invalid":
                replies[index] = _error_message(_id_of(message), _invalid_envelope())
            # a response to a request of ours: we send none, so there is nothing to match

        slow = any(request.method == "tools/call" for _, request in jobs)
        if len(jobs) == 1:
            index, request = jobs[0]
            if slow:
                replies[index] = await self._answer_watched(request, receive)
            else:
                replies[index] = await self._answer(request)
        elif jobs:
            with anyio.CancelScope() as work:
                async with anyio.create_task_group() as group:
                    if slow:
                        group.start_soon(self._watch_disconnect, receive, work)

                    async def answer(index: int, request: types.JSONRPCRequest) -> None:
                        replies[index] = await self._answer(request)

                    async with anyio.create_task_group() as calls:
                        for index, request in jobs:
                            calls.start_soon(answer, index, request)
                    group.cancel_scope.cancel()  # the watcher
            if work.cancelled_caught:
                logger.info("MCP client disconnected; its batch was ended")
        return [reply for reply in replies if reply is not None]

    async def _answer_watched(
        self, request: types.JSONRPCRequest, receive: Receive
    ) -> dict[str, Any] | None:
        """:meth:`_answer` for a ``tools/call``, ended by a disconnect (None) or a cancellation.

        One cancel scope serves both: ``notifications/cancelled`` finds it
        under the request's id, and the disconnect watcher cancels it.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on asyncio: the portable way
            return await self._answer_in_group(request, receive)
        with anyio.CancelScope() as work:
            # One asyncio task, not an anyio task group: the group costs ~120 us per
            # request here (most of a call). Cancelled on the way out, it ends on the
            # loop's next turn and holds nothing.
            watcher = loop.create_task(self._watch_disconnect(receive, work))
            try:
                return await self._answer(request, scope=work)
            finally:
                watcher.cancel()
        self._cancelled(request)
        return None

    async def _answer_in_group(
        self, request: types.JSONRPCRequest, receive: Receive
    ) -> dict[str, Any] | None:
        with anyio.CancelScope() as work:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_disconnect, receive, work)
                reply = await self._answer(request, scope=work)
                group.cancel_scope.cancel()
            return reply
        self._cancelled(request)
        return None

    async def _run_call(
        self, request: types.JSONRPCRequest, mcp: McpSession, scope: anyio.CancelScope
    ) -> dict[str, Any]:
        mcp.calls[request.id] = scope  # for notifications/cancelled
        try:
            result = await self.endpoint.handlers.handle(
                request.method,
                request.params,
                version=self.version,
                session=mcp.session,
                call_id=f"mcp-{request.id}",
            )
        finally:
            if mcp.calls.get(request.id) is scope:
                del mcp.calls[request.id]
        return {"jsonrpc": "2.0", "id": request.id, "result": result}

    async def _watch_disconnect(self, receive: Receive, work: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the replayed body
        self.disconnected = True
        work.cancel()

    def _cancelled(self, request: types.JSONRPCRequest) -> None:
        """No reply for a request that was ended: cancelled, its session ended, or its client gone.

        The spec asks for no response to a cancelled request; on HTTP that is a
        202 with no body, which the SDK clients take as "none will follow" even
        while they are closing (a late JSON-RPC answer crashes the mcp 2.x client
        then).
        """
        why = "its client disconnected" if self.disconnected else "it was cancelled"
        logger.info("MCP request %r ended: %s", request.id, why)

    def _notify(self, message: dict[str, Any]) -> None:
        if message.get("method") != "notifications/cancelled":
            return  # initialized, progress, roots changed...: nothing to do
        try:
            params = types.CancelledNotificationParams.model_validate(message.get("params") or {})
        except pydantic.ValidationError:
            return
        if params.request_id is None:
            return
        mcp = self.mcp or self.endpoint.sessions.stateless_of(self.principal)
        if mcp is not None and mcp.cancel(params.request_id):
            logger.info("MCP request %r cancelled by the client", params.request_id)

    async def _answer(
        self, request: types.JSONRPCRequest, *, scope: anyio.CancelScope | None = None
    ) -> dict[str, Any] | None:
        """The reply to one request; a ``tools/call`` runs under ``scope`` (or its own)."""
        handlers = self.endpoint.handlers
        if request.method == "server/discover":
            return _error_message(request.id, _unsupported(LATEST_MODERN_VERSION))
        try:
            if request.method != "tools/call":
                result = await handlers.handle(
                    request.method, request.params, version=self.version, session=None
                )
                return {"jsonrpc": "2.0", "id": request.id, "result": result}
            mcp = self.mcp
            if mcp is None:
                try:
                    mcp = await self.endpoint.sessions.stateless(self.principal, self.version)
                except AgentBackendError as exc:
                    return _error_message(request.id, _Refusal.of(exc).error)
            if scope is not None:
                return await self._run_call(request, mcp, scope)
            with anyio.CancelScope() as own:
                return await self._run_call(request, mcp, own)
            self._cancelled(request)
            return None
        except JsonRpcError as error:
            return _error_message(request.id, error)
        except Exception:
            logger.exception("MCP %s failed", request.method)
            bug = JsonRpcError(types.INTERNAL_ERROR, "internal error in the daemon; see its log")
            return _error_message(request.id, bug)


def _skip_space(text: str, index: int) -> int:
    """The index of the first character at or after ``index`` that is not JSON whitespace."""
    match = _SPACE.match(text, index)
    return match.end() if match is not None else index


def _array_longer_than(body: bytes, limit: int) -> bool:
    """Whether ``body`` is a JSON array of more than ``limit`` elements, read no further than
    element ``limit + 1``: a batch of 10,000 messages is refused in the time of 257, not after
    a whole parse that holds the event loop for tens of ms. False when it is not such an array
    or the count cannot tell (invalid JSON): the whole parse then decides."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    index = _skip_space(text, 0)
    if not text.startswith("[", index):
        return False
    index = _skip_space(text, index + 1)
    for count in range(1, limit + 2):
        try:
            _, index = _DECODER.raw_decode(text, index)
        except ValueError:
            return False
        if count > limit:
            return True
        index = _skip_space(text, index)
        if not text.startswith(",", index):
            return False  # the array ended (or is not JSON) within the limit
        index = _skip_space(text, index + 1)
    return False  # not reached


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def _accepts_json(accept: bytes) -> bool:
    accept = accept.lower()
    return b"application/json" in accept or b"*/*" in accept or b"application/*" in accept


def _kind(message: Any) -> str:
    if not isinstance(message, dict):
        return "invalid"
    if "method" in message:
        return "request" if "id" in message else "notification"
    if "id" in message and ("result" in message or "error" in message):
        return "response"
    return "invalid"


def _is_call(message: dict[str, Any]) -> bool:
    return message.get("method") == "tools/call"


def _call_arguments(messages: list[Any]) -> Iterator[tuple[str, Any]]:
    """``(label, arguments)`` of each ``tools/call`` in ``messages``, for the size check."""
    for message in messages:
        if isinstance(message, dict) and _is_call(message):
            params = message.get("params")
            if isinstance(params, dict):
                yield f"tools/call {clip(str(params.get('name')), 80)!r}", params.get("arguments")


def _is_initialize(decoded: Any) -> bool:
    return isinstance(decoded, dict) and decoded.get("method") == "initialize" and "id" in decoded


def _id_of(message: Any) -> Any:
    if isinstance(message, dict):
        value = message.get("id")
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return value
    return None


def _invalid_envelope() -> JsonRpcError:
    return JsonRpcError(
        types.INVALID_REQUEST,
        'Invalid Request: expected {"jsonrpc": "2.0", "id": ..., "method": "...", "params": {...}}',
    )


def _unsupported(requested: str) -> JsonRpcError:
    return JsonRpcError(
        types.UNSUPPORTED_PROTOCOL_VERSION,
        f"protocol version {clip(requested, 40)!r} is not served here; this server speaks "
        f"{', '.join(SERVED_VERSIONS)} (initialize to start a session)",
        {"supported": list(SERVED_VERSIONS), "requested": requested},
    )


# -- the daemon's refusals, as MCP clients read them --------------------------------------------


class JsonRpcRefusals:
    """ASGI middleware for ``/mcp``: the daemon's error bodies rewritten as JSON-RPC errors.

    The daemon's middlewares (auth, body limit, concurrency) answer with an
    :class:`~agent_backend.wire.ErrorBody`; MCP clients read only a
    JSON-RPC error, and show its message. The status stays; a 401 says how
    to pass the static token, and its ``WWW-Authenticate: Bearer`` names no
    ``resource_metadata``: nothing points a client at OAuth discovery.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: Message | None = None

        async def rewrite(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is not None and message["type"] == "http.response.body":
                start, held = held, None
                await self._send_rewritten(scope, start, message, send)
                return
            await send(message)

        await self.app(scope, receive, rewrite)

    async def _send_rewritten(
        self, scope: Scope, start: Message, message: Message, send: Send
    ) -> None:
        status: int = start["status"]
        body: bytes = message.get("body", b"")
        detail = None
        with contextlib.suppress(ValueError):
            decoded = orjson.loads(body)
            if isinstance(decoded, dict) and "jsonrpc" not in decoded:
                detail = decoded.get("error")
        if detail is None or message.get("more_body", False):  # already JSON-RPC, or streamed
            await send(start)
            await send(message)
            return
        text = str(detail.get("message", "")) if isinstance(detail, dict) else ""
        headers = [
            (name, value)
            for name, value in start.get("headers", [])
            if name not in (b"content-length", b"content-type")
        ]
        if status == 401:
            text += (
                "; send 'Authorization: Bearer <token>' with the daemon's static token "
                "(`agent-backend serve` prints where it is); this server does not use OAuth"
            )
        refusal = _Refusal(status, _refusal_error(status, text, detail), headers)
        await _send_refusal(send, refusal)


def mount(app: ASGIApp, mcp_stack: ASGIApp) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``app`` with ``/mcp`` answered by ``mcp_stack`` instead."""

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == MCP_PATH:
            await mcp_stack(scope, receive, send)
        else:
            await app(scope, receive, send)

    return route
