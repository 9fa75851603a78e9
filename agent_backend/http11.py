"""A lean HTTP/1.1 keep-alive transport for httpx, over anyio streams, for plain ``http://``.

httpx's default transport (httpcore driving h11) spends most of a client's
CPU on a small request: in ``bench/daemon_bench.py`` on the 2-core test VM,
a call through ``httpx.AsyncClient`` on it costs the client 1.0 to 1.5 ms of
CPU, more than the daemon spends answering it; through
:class:`agent_backend.Client` on this transport, 0.4 to 0.5 ms.
:class:`HTTP11Transport` does the job for the case the client has, plain
HTTP/1.1 to a daemon, in one pass: the request leaves in one write, the
response head is parsed with a few ``bytes`` operations and one regular
expression, and a small body is read with the head and handed over as
bytes, its connection back in the pool before httpx sees the response.
Anything else (``https://``, an ``Upgrade``) goes to a fallback transport,
httpx's default.

What it speaks: requests framed by ``Content-Length`` (or chunked, for a
streamed body of unknown length); responses framed by ``Content-Length``,
chunked (trailers read and dropped) or by the end of the connection; 1xx
answers skipped; no body for ``HEAD``, 204 and 304. Errors are httpx's own
(``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``, ...), so code
written for httpx, and the client's retries, need no change.

Connections are pooled per origin and bounded (``max_connections`` open at
once, requests beyond wait in order, ``PoolTimeout`` after the pool
timeout). The pool is a synchronous state machine (:class:`ConnectionPool`);
opening and closing sockets happens outside it. A connection goes back to
the pool only when its response was read to the end with explicit framing
and neither side asked to close. An idle one is checked before reuse (too
old? readable, that is closed by the server or holding stray bytes?). When
a reused connection turns out closed before any byte of the answer came,
the request is sent again on another connection, but only when that is
safe: an idempotent method (RFC 9110, 9.2.2) or an ``Idempotency-Key``
header, and a body held in memory.

This module must never resend a request that is not safe to resend, never
reuse a connection in an unknown state (cancelled, timed out, body unread),
and never have more than ``max_connections`` open.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
import select
import socket
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Final, Literal, Self

import anyio
import anyio.abc
import httpx

__all__ = ["ConnectionPool", "HTTP11Transport", "PoolStatistics"]

Origin = tuple[str, int]

#: Longest response head accepted (status line and headers).
MAX_HEAD_BYTES: Final = 64 * 1024
#: Most response headers accepted.
MAX_HEADERS: Final = 200
# Bodies up to this size (by Content-Length) are read with the head and returned as bytes.
_EAGER_BODY_BYTES = 256 * 1024
# Request bodies up to this size leave in the same write as the head.
_COALESCE_BODY_BYTES = 256 * 1024
_RECEIVE_BYTES = 64 * 1024
# RFC 9110 9.2.2: a client may resend these automatically.
_IDEMPOTENT_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Header lines, each "name: value\r\n": a token, then no NUL, CR or LF in the value
# (checked for the whole block at once: one pass in C instead of two regexes a header).
_HEADER_LINES = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00\r\n]*\r\n)*")
_BAD_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


# -- the pool: a synchronous state machine --------------------------------------------------------


class _Connection:
    """One TCP connection to one origin; at most one request on it at a time."""

    __slots__ = (
        "buffer",
        "idle_since",
        "origin",
        "received",
        "requests",
        "sock",
        "state",
        "stream",
    )

    def __init__(self, origin: Origin, stream: anyio.abc.ByteStream, sock: socket.socket | None):
        self.origin = origin
        self.stream = stream
        self.sock = sock
        self.buffer = bytearray()
        """Bytes received and not yet consumed."""
        self.requests = 0
        """Requests started on this connection."""
        self.received = False
        """Whether a byte of the current request's answer has come."""
        self.idle_since = 0.0
        self.state: Literal["active", "idle", "closed"] = "active"

    def __repr__(self) -> str:
        return f"<_Connection {self.origin[0]}:{self.origin[1]} {self.state}, {self.requests} requests>"

    def is_idle(self) -> bool:
        return self.state == "idle"

    def is_closed(self) -> bool:
        return self.state == "closed"

    def has_expired(self, now: float, keepalive_expiry: float | None) -> bool:
        return keepalive_expiry is not None and now - self.idle_since > keepalive_expiry

    def is_readable(self) -> bool:
        """True when an idle connection has something to read: EOF (the server closed it) or junk."""
        if self.buffer:
            return True
        if self.sock is None:
            return False
        try:
            if hasattr(select, "poll"):
                poller = select.poll()
                poller.register(self.sock, select.POLLIN)
                return bool(poller.poll(0))
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):  # closed under us
            return True

    async def aclose(self) -> None:
        self.state = "closed"
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.stream.aclose()


@dataclasses.dataclass(eq=False)
class _Waiter:
    """A request waiting for a connection: it gets an idle one, or a slot to open one."""

    origin: Origin
    event: anyio.Event | None = None
    """Made only when the waiter has to wait (set when it is given something, or on close)."""
    connection: _Connection | None = None
    slot: bool = False

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()

    def is_assigned(self) -> bool:
        return self.connection is not None or self.slot


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStatistics:
    connections_open: int
    """Open connections, idle ones and ones being opened included."""
    connections_idle: int
    requests_active: int
    """Requests holding a connection (or opening one)."""
    requests_queued: int
    """Requests waiting for a connection."""


class ConnectionPool:
    """Idle connections per origin, a bound on open ones, and the requests waiting for one.

    Every method is synchronous and returns the connections the caller must
    close (that I/O is done outside, shielded). A request asks with
    :meth:`assign`; if nothing is free it is queued and its event is set when
    :meth:`release` hands it a connection or a slot.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        max_keepalive_connections: int,
        keepalive_expiry: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.max_connections = max_connections
        self.max_keepalive_connections = max(0, min(max_keepalive_connections, max_connections))
        self.keepalive_expiry = keepalive_expiry
        self._clock = clock
        self._idle: dict[Origin, list[_Connection]] = {}  # most recently used last
        self._idle_count = 0
        self._open = 0  # connections open or being opened, idle ones included
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self._closed = False

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<ConnectionPool [requests: {s.requests_active} active, {s.requests_queued} queued"
            f" | conns: {s.connections_open} open, {s.connections_idle} idle]>"
        )

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            connections_open=self._open,
            connections_idle=self._idle_count,
            requests_active=self._open - self._idle_count,
            requests_queued=len(self._waiting),
        )

    def is_closed(self) -> bool:
        return self._closed

    def take_idle(self, origin: Origin) -> tuple[_Connection | None, list[_Connection]]:
        """An idle connection to ``origin`` for a request that need not queue (nobody waits).

        The fast path of :meth:`assign`; also returns the connections to close.
        """
        to_close: list[_Connection] = []
        if self._waiting or self._closed:
            return None, to_close
        return self._take_idle(origin, to_close), to_close

    def assign(self, waiter: _Waiter) -> list[_Connection]:
        """Give ``waiter`` an idle connection or a slot now, or queue it."""
        if self._closed:
            raise RuntimeError("the connection pool is closed")
        self._waiting.append(waiter)
        return self._assign()

    def release(self, connection: _Connection, *, reusable: bool) -> list[_Connection]:
        """A request is done with ``connection``; keep it for the next one only if ``reusable``."""
        if connection.state != "active":
            raise RuntimeError(f"{connection!r} released twice")
        if not reusable or self._closed:
            connection.state = "closed"
            self._open -= 1
            return [connection, *self._assign()]
        connection.state = "idle"
        connection.idle_since = self._clock()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._idle_count += 1
        to_close = self._assign()
        while self._idle_count > self.max_keepalive_connections:
            to_close.append(self._pop_oldest_idle())
        return to_close

    def release_slot(self) -> list[_Connection]:
        """Opening a connection with a slot failed: the slot is free again."""
        self._open -= 1
        return self._assign()

    def discard(self, waiter: _Waiter) -> list[_Connection]:
        """``waiter`` gave up (cancelled, timed out): hand back whatever it was given."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(waiter)
        to_close: list[_Connection] = []
        if waiter.connection is not None:
            to_close = self.release(waiter.connection, reusable=True)
            waiter.connection = None
        elif waiter.slot:
            waiter.slot = False
            to_close = self.release_slot()
        return to_close

    def close(self) -> list[_Connection]:
        """No more requests; every idle connection is returned for closing, waiters are woken."""
        self._closed = True
        to_close: list[_Connection] = []
        while self._idle_count:
            to_close.append(self._pop_oldest_idle())
        while self._waiting:
            self._waiting.popleft().wake()
        return to_close

    # -- internals --

    def _pop_oldest_idle(self) -> _Connection:
        origin = min(self._idle, key=lambda o: self._idle[o][0].idle_since)
        connections = self._idle[origin]
        connection = connections.pop(0)
        if not connections:
            del self._idle[origin]
        self._idle_count -= 1
        self._open -= 1
        connection.state = "closed"
        return connection

    def _take_idle(self, origin: Origin, to_close: list[_Connection]) -> _Connection | None:
        connections = self._idle.get(origin)
        now = self._clock()
        while connections:
            connection = connections.pop()
            self._idle_count -= 1
            if connection.has_expired(now, self.keepalive_expiry) or connection.is_readable():
                connection.state = "closed"
                self._open -= 1
                to_close.append(connection)
                continue
            if not connections:
                del self._idle[origin]
            connection.state = "active"
            return connection
        self._idle.pop(origin, None)
        return None

    def _assign(self) -> list[_Connection]:
        to_close: list[_Connection] = []
        while self._waiting:
            waiter = self._waiting[0]
            connection = self._take_idle(waiter.origin, to_close)
            if connection is not None:
                waiter.connection = connection
            elif self._open < self.max_connections:
                self._open += 1
                waiter.slot = True
            elif self._idle_count:  # idle connections to other origins make room
                to_close.append(self._pop_oldest_idle())
                self._open += 1
                waiter.slot = True
            else:
                break
            self._waiting.popleft()
            waiter.wake()
        return to_close


# -- the transport --------------------------------------------------------------------------------


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the answer came."""

    def __init__(self, error: httpx.TransportError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclasses.dataclass(slots=True)
class _Outgoing:
    """A request as it goes on the wire."""

    head: bytes
    body: bytes | httpx.AsyncByteStream
    chunked: bool
    """Send the body (a stream) in chunked encoding."""
    length: int | None
    """The declared Content-Length."""
    safe: bool
    """Safe to send again: idempotent (method or Idempotency-Key) and the body is in memory."""
    close: bool
    """The request asks for the connection to be closed after it."""


@dataclasses.dataclass(slots=True)
class _Head:
    status: int
    reason: bytes
    version: bytes
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    framing: Literal["none", "length", "chunked", "close"]
    length: int


class HTTP11Transport(httpx.AsyncBaseTransport):
    """httpx transport: HTTP/1.1 keep-alive over anyio TCP streams for ``http://`` URLs.

    ``httpx.AsyncClient(transport=HTTP11Transport(max_connections=10))``.
    ``fallback`` serves what it does not speak (``https://``, upgrades); by
    default an ``httpx.AsyncHTTPTransport()`` made on first use (pass your
    own for TLS settings).
    """

    def __init__(
        self,
        *,
        max_connections: int = 100,
        max_keepalive_connections: int | None = None,
        keepalive_expiry: float | None = 4.0,
        fallback: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """
        Args:
            max_connections: connections open at once, over all origins.
            max_keepalive_connections: idle connections kept (default: ``max_connections``).
            keepalive_expiry: seconds an idle connection is kept (``None``: no limit); best
                below the server's keep-alive timeout (uvicorn's: 5 s).
            fallback: the transport for what this one does not speak.
        """
        self.pool = ConnectionPool(
            max_connections=max_connections,
            max_keepalive_connections=(
                max_connections if max_keepalive_connections is None else max_keepalive_connections
            ),
            keepalive_expiry=keepalive_expiry,
        )
        self._fallback = fallback
        self._fallback_limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry,
        )
        self._closed = False

    def __repr__(self) -> str:
        return repr(self.pool).replace("ConnectionPool", "HTTP11Transport", 1)

    def statistics(self) -> PoolStatistics:
        return self.pool.statistics()

    def is_closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the idle connections (busy ones close as their requests end); idempotent."""
        if self._closed:
            return
        self._closed = True
        to_close = self.pool.close()
        with anyio.CancelScope(shield=True):
            try:
                await _close_all(to_close)
            finally:
                if self._fallback is not None:
                    await self._fallback.aclose()

    # -- one request --

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        outgoing = _serialize(request) if url.scheme == "http" else None
        if outgoing is None:
            return await self._fallback_transport().handle_async_request(request)
        timeouts = request.extensions.get("timeout", {})
        origin = (url.host, url.port or 80)
        while True:
            connection = await self._acquire(origin, request, timeouts)
            try:
                return await self._exchange(connection, request, outgoing, timeouts)
            except _Stale as stale:
                # The server closed an idle connection as it was reused: nothing of this
                # request was answered, so it may go again on another one, if that is safe.
                if not outgoing.safe:
                    raise stale.error from None

    def _fallback_transport(self) -> httpx.AsyncBaseTransport:
        if self._fallback is None:
            self._fallback = httpx.AsyncHTTPTransport(limits=self._fallback_limits)
        return self._fallback

    async def _acquire(
        self, origin: Origin, request: httpx.Request, timeouts: dict[str, float | None]
    ) -> _Connection:
        idle, to_close = self.pool.take_idle(origin)
        if to_close:
            with anyio.CancelScope(shield=True):
                await _close_all(to_close)
        if idle is not None:
            return idle
        waiter = _Waiter(origin)
        try:
            to_close = self.pool.assign(waiter)
            if not waiter.is_assigned():  # before any await: a release may come then
                waiter.event = anyio.Event()
            await _close_all(to_close)
            if not waiter.is_assigned():
                assert waiter.event is not None
                with anyio.move_on_after(_seconds(timeouts.get("pool"))):
                    await waiter.event.wait()
                if not waiter.is_assigned():
                    if self.pool.is_closed():
                        raise RuntimeError("the transport is closed")
                    raise httpx.PoolTimeout("no connection became free in time", request=request)
            if waiter.connection is not None:
                connection, waiter.connection = waiter.connection, None
                return connection
            waiter.slot = False  # ours now: a failure below hands it back with release_slot()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close_all(self.pool.discard(waiter))
            raise
        try:
            return await _connect(origin, request, timeouts)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _close_all(self.pool.release_slot())
            raise

    async def _release(self, connection: _Connection, *, reusable: bool) -> None:
        await _close_all(self.pool.release(connection, reusable=reusable))

    async def _exchange(
        self,
        connection: _Connection,
        request: httpx.Request,
        outgoing: _Outgoing,
        timeouts: dict[str, float | None],
    ) -> httpx.Response:
        reused = connection.requests > 0
        connection.requests += 1
        connection.received = False
        read_timeout = _seconds(timeouts.get("read"))
        phase: Literal["write", "read"] = "write"
        handed_over = False  # to the pool, or to the response's body stream
        try:
            with anyio.CancelScope() as scope:
                try:
                    await _send(connection, outgoing, request, scope, timeouts)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    error: httpx.TransportError = httpx.WriteError(
                        f"sending the request failed: {exc!r}", request=request
                    )
                    raise (_Stale(error) if reused else error) from None
                phase = "read"
                try:
                    head = await _receive_head(connection, request, scope, read_timeout)
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    if reused and not connection.received:
                        raise _Stale(exc) from None
                    raise
                if outgoing.close:
                    head.keep_alive = False
                if head.framing == "length" and head.length <= _EAGER_BODY_BYTES:
                    body = await _receive_exactly(
                        connection, head.length, request, scope, read_timeout
                    )
                elif head.framing != "none":
                    handed_over = True
                    stream = _BodyStream(self, connection, head, request, read_timeout)
                    return _response(head, stream)
                else:
                    body = b""
                handed_over = True
                await self._release(connection, reusable=head.keep_alive)
                return _response(head, httpx.ByteStream(body))
            error_class = httpx.WriteTimeout if phase == "write" else httpx.ReadTimeout
            raise error_class(f"{phase} timed out", request=request)
        except BaseException:
            if not handed_over:
                with anyio.CancelScope(shield=True):
                    await self._release(connection, reusable=False)
            raise


async def _close_all(connections: list[_Connection]) -> None:
    for connection in connections:
        await connection.aclose()


async def _connect(
    origin: Origin, request: httpx.Request, timeouts: dict[str, float | None]
) -> _Connection:
    host, port = origin
    with anyio.move_on_after(_seconds(timeouts.get("connect"))):
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            raise httpx.ConnectError(
                f"cannot connect to {host}:{port}: {exc}", request=request
            ) from exc
        try:
            sock: socket.socket | None = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        except anyio.TypedAttributeLookupError:
            sock = None
        return _Connection(origin, stream, sock)
    raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request)


def _seconds(value: float | None) -> float:
    return math.inf if value is None else value


def _deadline(seconds: float) -> float:
    return anyio.current_time() + seconds if seconds != math.inf else math.inf


def _restart(scope: anyio.CancelScope, seconds: float) -> None:
    """Give ``scope`` ``seconds`` from now (a write's, or a read's, timeout).

    A move of less than a millisecond is skipped: each move reschedules a timer,
    and the read that follows a small write would move it by microseconds.
    """
    deadline, current = _deadline(seconds), scope.deadline
    if deadline != current and (math.inf in (deadline, current) or abs(deadline - current) > 1e-3):
        scope.deadline = deadline


def _response(head: _Head, stream: httpx.AsyncByteStream) -> httpx.Response:
    return httpx.Response(
        head.status,
        headers=head.headers,
        stream=stream,
        extensions={"http_version": head.version, "reason_phrase": head.reason},
    )


# -- writing the request --------------------------------------------------------------------------


def _serialize(request: httpx.Request) -> _Outgoing | None:
    """The request as it goes on the wire; ``None`` for what this transport leaves to the fallback."""
    method = request.method.encode("ascii")
    if not _TOKEN.fullmatch(method):
        raise httpx.LocalProtocolError(f"invalid method {request.method!r}", request=request)
    target = request.url.raw_path or b"/"
    if _BAD_TARGET.search(target):
        raise httpx.LocalProtocolError(f"invalid request target {target[:80]!r}", request=request)
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    declared: bytes | None = None
    chunked = close = False
    safe = method in _IDEMPOTENT_METHODS
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"content-length":
            if declared is not None or not value.isdigit():
                raise httpx.LocalProtocolError(
                    f"bad Content-Length {value[:40]!r}", request=request
                )
            declared = value
        elif lower == b"transfer-encoding":
            if value.strip().lower() != b"chunked":
                raise httpx.LocalProtocolError(
                    f"unsupported Transfer-Encoding {value[:40]!r}", request=request
                )
            chunked = True
        elif lower == b"upgrade":
            return None
        elif lower == b"idempotency-key":
            safe = True
        elif lower == b"connection":
            close = b"close" in (t.strip().lower() for t in value.split(b","))
        parts += (name, b": ", value, b"\r\n")
    if declared is not None and chunked:
        raise httpx.LocalProtocolError(
            "both Content-Length and Transfer-Encoding: chunked", request=request
        )
    length = int(declared) if declared is not None else None
    body: bytes | httpx.AsyncByteStream
    try:
        body = request.content
    except httpx.RequestNotRead:
        if not isinstance(request.stream, httpx.AsyncByteStream):
            raise httpx.LocalProtocolError(
                "a synchronous request body in an async client", request=request
            ) from None
        body = request.stream
        safe = False  # a stream is used up by sending it once
        if length is None and not chunked:
            parts += (b"Transfer-Encoding", b": ", b"chunked", b"\r\n")
            chunked = True
    else:
        if chunked:
            raise httpx.LocalProtocolError(
                "Transfer-Encoding: chunked with a body already read", request=request
            )
        if length is None:
            if body:
                parts += (b"Content-Length", b": ", str(len(body)).encode(), b"\r\n")
        elif length != len(body):
            raise httpx.LocalProtocolError(
                f"Content-Length {length} does not match the body ({len(body)} bytes)",
                request=request,
            )
    head = b"".join(parts)
    # One line per header (no CR or LF inside a value), each a token, a colon and no NUL.
    lines = len(parts) // 4  # four parts a line, the request line included
    if (
        head.count(b"\n") != lines
        or head.count(b"\r") != lines
        or not _HEADER_LINES.fullmatch(head, head.index(b"\n") + 1)
    ):
        raise httpx.LocalProtocolError(
            "a header name is not a token, or a value holds CR, LF or NUL", request=request
        )
    return _Outgoing(head + b"\r\n", body, chunked, length, safe, close)


async def _send(
    connection: _Connection,
    outgoing: _Outgoing,
    request: httpx.Request,
    scope: anyio.CancelScope,
    timeouts: dict[str, float | None],
) -> None:
    stream = connection.stream
    write_timeout = _seconds(timeouts.get("write"))
    _restart(scope, write_timeout)
    body = outgoing.body
    if isinstance(body, bytes):
        if len(body) <= _COALESCE_BODY_BYTES:
            await stream.send(outgoing.head + body)  # one write: each one that wakes the peer costs
        else:
            await stream.send(outgoing.head)
            await stream.send(body)
        return
    await stream.send(outgoing.head)
    sent = 0
    async for chunk in body:
        if not chunk:
            continue
        sent += len(chunk)
        _restart(scope, write_timeout)
        if outgoing.chunked:
            await stream.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        elif outgoing.length is not None and sent > outgoing.length:
            raise httpx.LocalProtocolError(
                "the request body is longer than its Content-Length", request=request
            )
        else:
            await stream.send(chunk)
    if outgoing.chunked:
        await stream.send(b"0\r\n\r\n")
    elif outgoing.length is not None and sent != outgoing.length:
        raise httpx.LocalProtocolError(
            "the request body is shorter than its Content-Length", request=request
        )


# -- reading the response -------------------------------------------------------------------------


async def _fill(
    connection: _Connection,
    request: httpx.Request,
    scope: anyio.CancelScope | None,
    read_timeout: float,
) -> None:
    """Receive more bytes into the connection's buffer; EOF and resets raise httpx's errors."""
    if scope is not None:
        _restart(scope, read_timeout)
    try:
        data = await connection.stream.receive(_RECEIVE_BYTES)
    except anyio.EndOfStream:
        raise httpx.RemoteProtocolError(
            "the server closed the connection before the response was complete"
            if connection.received
            else "Server disconnected without sending a response.",
            request=request,
        ) from None
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
        raise httpx.ReadError(f"reading the response failed: {exc!r}", request=request) from exc
    connection.received = True
    connection.buffer += data


async def _receive_head(
    connection: _Connection, request: httpx.Request, scope: anyio.CancelScope, read_timeout: float
) -> _Head:
    buffer = connection.buffer
    while True:
        searched = 0
        while (end := buffer.find(b"\r\n\r\n", searched)) < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError("the response head is too large", request=request)
            searched = max(0, len(buffer) - 3)
            await _fill(connection, request, scope, read_timeout)
        head = _parse_head(bytes(buffer[:end]), request)
        del buffer[: end + 4]
        if head.status >= 200:
            return head
        if head.status == 101:
            raise httpx.RemoteProtocolError(
                "101 Switching Protocols to a request without Upgrade", request=request
            )
        # 100 Continue, 102, 103: the final answer follows.


def _parse_head(raw: bytes, request: httpx.Request) -> _Head:
    status_end = raw.find(b"\r\n")
    if status_end >= 0 and not _HEADER_LINES.fullmatch(raw + b"\r\n", status_end + 2):
        raise httpx.RemoteProtocolError("a malformed response header line", request=request)
    lines = raw.split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        raise httpx.RemoteProtocolError("too many response headers", request=request)
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(
            f"not an HTTP/1.1 status line: {lines[0][:80]!r}", request=request
        )
    status = int(code)
    headers: list[tuple[bytes, bytes]] = []
    lengths: set[bytes] = set()
    codings: list[bytes] = []
    keep_alive = version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        value = value.strip(b" \t")
        headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length":
            lengths.update(v.strip(b" \t") for v in value.split(b","))
        elif lower == b"transfer-encoding":
            codings += (c.strip(b" \t").lower() for c in value.split(b","))
        elif lower == b"connection" and b"close" in (
            t.strip(b" \t").lower() for t in value.split(b",")
        ):
            keep_alive = False
    framing: Literal["none", "length", "chunked", "close"]
    length = 0
    if status in (204, 304) or status < 200 or request.method == "HEAD":
        framing = "none"
    elif codings:
        # RFC 9112 6.3: Transfer-Encoding overrides Content-Length (the connection is then
        # not reused); a final coding other than chunked is read until the close.
        framing = "chunked" if codings[-1] == b"chunked" else "close"
        if lengths or framing == "close":
            keep_alive = False
    elif lengths:
        value = next(iter(lengths))
        if len(lengths) != 1 or not value.isdigit() or len(value) > 18:
            raise httpx.RemoteProtocolError(
                f"bad Content-Length {b', '.join(sorted(lengths))[:80]!r}", request=request
            )
        framing, length = "length", int(value)
    else:
        framing = "close"
        keep_alive = False
    return _Head(status, reason, version, headers, keep_alive, framing, length)


async def _receive_exactly(
    connection: _Connection,
    size: int,
    request: httpx.Request,
    scope: anyio.CancelScope | None,
    read_timeout: float,
) -> bytes:
    buffer = connection.buffer
    while len(buffer) < size:
        await _fill(connection, request, scope, read_timeout)
    data = bytes(buffer[:size])
    del buffer[:size]
    return data


async def _fill_timed(connection: _Connection, request: httpx.Request, read_timeout: float) -> None:
    with anyio.CancelScope(deadline=_deadline(read_timeout)) as scope:
        await _fill(connection, request, None, read_timeout)
    if scope.cancelled_caught:
        raise httpx.ReadTimeout("read timed out", request=request)


async def _receive_line(
    connection: _Connection, request: httpx.Request, read_timeout: float
) -> bytes:
    buffer = connection.buffer
    searched = 0
    while (end := buffer.find(b"\r\n", searched)) < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError("a chunk header line is too long", request=request)
        searched = max(0, len(buffer) - 1)
        await _fill_timed(connection, request, read_timeout)
    line = bytes(buffer[:end])
    del buffer[: end + 2]
    return line


class _BodyStream(httpx.AsyncByteStream):
    """A response body read as the caller iterates; its connection is released at the end."""

    def __init__(
        self,
        transport: HTTP11Transport,
        connection: _Connection,
        head: _Head,
        request: httpx.Request,
        read_timeout: float,
    ) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection
        self._head = head
        self._request = request
        self._read_timeout = read_timeout
        self._complete = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        if self._head.framing == "length":
            chunks = self._length(connection, self._head.length)
        elif self._head.framing == "chunked":
            chunks = self._chunked(connection)
        else:
            chunks = self._until_close(connection)
        async for chunk in chunks:
            yield chunk
        self._complete = True
        await self.aclose()

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with anyio.CancelScope(shield=True):
                reusable = self._complete and self._head.keep_alive
                await self._transport._release(connection, reusable=reusable)

    async def _length(self, connection: _Connection, remaining: int) -> AsyncIterator[bytes]:
        buffer = connection.buffer
        while remaining:
            if not buffer:
                await _fill_timed(connection, self._request, self._read_timeout)
            take = min(remaining, len(buffer))
            chunk = bytes(buffer[:take])
            del buffer[:take]
            remaining -= take
            yield chunk

    async def _chunked(self, connection: _Connection) -> AsyncIterator[bytes]:
        buffer = connection.buffer
        request = self._request
        while True:
            line = await _receive_line(connection, request, self._read_timeout)
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_text):
                raise httpx.RemoteProtocolError(f"bad chunk size {line[:40]!r}", request=request)
            size = int(size_text, 16)
            if size == 0:
                while await _receive_line(connection, request, self._read_timeout):
                    pass  # trailer fields, dropped
                return
            while size:
                if not buffer:
                    await _fill_timed(connection, request, self._read_timeout)
                take = min(size, len(buffer))
                chunk = bytes(buffer[:take])
                del buffer[:take]
                size -= take
                yield chunk
            if await _receive_line(connection, request, self._read_timeout):
                raise httpx.RemoteProtocolError("a chunk does not end with CRLF", request=request)

    async def _until_close(self, connection: _Connection) -> AsyncIterator[bytes]:
        buffer = connection.buffer
        while True:
            if buffer:
                chunk = bytes(buffer)
                buffer.clear()
                yield chunk
            try:
                await _fill_timed(connection, self._request, self._read_timeout)
            except httpx.RemoteProtocolError:
                return  # the end of the connection is the end of the body
