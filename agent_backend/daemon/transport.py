"""The daemon's HTTP protocol: uvicorn's, behind bounds that hold before a request reaches the app.

:class:`GuardedHTTPProtocol` is each connection's asyncio protocol. It does
not subclass uvicorn's: it holds one (httptools' or h11's, as ``http``
names them in ``uvicorn.Config``), made with the keywords uvicorn's server
passes to any protocol class (``config``, ``server_state``, ``app_state``),
hands it the connection's events through the public ``asyncio.Protocol``
methods, and watches the bytes itself with a request parser of its own
(httptools' ``HttpRequestParser``): where each request head and body begin
and end. The bounds, enforced on those bytes because they must hold before
the app and its token check:

* a request head (request line and headers) larger than ``max_head_bytes``
  gets 431, having been read no further than that plus one read (a head
  pipelined behind another in one read is counted from the next read);
* a head not received whole within ``head_timeout`` of its first byte (of
  the connection, for the first request) gets 408: each byte does not
  extend it; a body that brings no byte for ``body_timeout`` gets 408 (or
  is cut, when a response has begun), its clock stopped while the daemon is
  not reading (uvicorn paused the transport) or the client waits for
  ``100 Continue``;
* past ``max_connections`` open connections, a new one makes room: the
  connection whose head has been arriving longest is cut (408) when that is
  over a quarter of ``head_timeout`` (a head a client sent at once arrives in
  one read: one still arriving that long is a slow or stalled client's, and
  slowloris connections cannot hold every slot until their deadline), else
  the oldest idle keep-alive connection is closed; when neither exists, the
  new one gets 503 with ``Retry-After`` and is closed.

A connection is idle between requests once the app has returned from the
last one: the app is wrapped (:func:`watch_requests`) and learns its
connection from a context variable set while uvicorn's protocol runs on the
connection's bytes (uvicorn starts a request's task there, and a task keeps
the context it was started in). Each refusal is counted by
:class:`RefusalLog`, which logs one summary line per interval, never one per
connection.

This module must never pass uvicorn a read that takes a head past the bound, never
write after the transport began closing, and never write a second response
over one that has begun.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import http
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Final, Literal, cast

import httptools
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from agent_backend.daemon.errors import error_body
from agent_backend.errors import DaemonError

__all__ = [
    "ConnectionGuard",
    "ConnectionLimits",
    "GuardedHTTPProtocol",
    "HttpKind",
    "RefusalLog",
    "watch_requests",
]

logger = logging.getLogger("agent_backend.daemon")

#: uvicorn's HTTP implementations this module can hold, by their names in ``uvicorn.Config``.
#: The daemon runs httptools' (a dependency); under h11's, give h11 a head limit above
#: ``max_head_bytes`` (``h11_max_incomplete_event_size``, 16 KiB by default), so that the
#: guard's 431 answers first.
HttpKind = Literal["httptools", "h11"]

#: The connection whose bytes uvicorn's protocol is handling now; the tasks it starts keep it.
_CONNECTION: Final[contextvars.ContextVar[GuardedHTTPProtocol | None]] = contextvars.ContextVar(
    "agent_backend_connection", default=None
)
_CONTINUE: Final = b"HTTP/1.1 100 "


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """What one connection may do before its request reaches the app (see the module docstring)."""

    max_head_bytes: int
    head_timeout: float
    body_timeout: float
    max_connections: int
    retry_after: float


class RefusalLog:
    """Counts refused and cut connections; logs one line at once, then one summary per interval."""

    def __init__(self, *, interval: float = 10.0) -> None:
        self.interval = interval
        self.counts: collections.Counter[str] = collections.Counter()
        """Everything noted since the start, per reason (for tests and metrics)."""
        self._window: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, reason: str) -> None:
        """Count one refusal; safe to call thousands of times a second (from the loop's thread)."""
        self.counts[reason] += 1
        self._window[reason] += 1
        if self._timer is None:
            self._flush(first=True)

    def _flush(self, *, first: bool = False) -> None:
        self._timer = None
        if not self._window:
            return
        total = sum(self._window.values())
        parts = ", ".join(f"{count} {reason}" for reason, count in self._window.most_common())
        since = "" if first else f" in the last {self.interval:g} s"
        logger.warning(
            "refused or cut %d connection%s%s: %s", total, "" if total == 1 else "s", since, parts
        )
        self._window.clear()
        self._timer = asyncio.get_running_loop().call_later(self.interval, self._flush)

    def close(self) -> None:
        """Log what is still counted and stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._window:
            parts = ", ".join(f"{count} {reason}" for reason, count in self._window.most_common())
            logger.warning("refused or cut %d connections: %s", sum(self._window.values()), parts)
            self._window.clear()


class ConnectionGuard:
    """The limits, and the state that the connections of one server share.

    ``http`` picks uvicorn's protocol that each connection holds.
    """

    def __init__(
        self,
        limits: ConnectionLimits,
        *,
        log: RefusalLog | None = None,
        http: HttpKind = "httptools",
    ) -> None:
        self.limits = limits
        self.log = log if log is not None else RefusalLog()
        self.http = http
        self.inner: Callable[..., asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS[http])
        """uvicorn's protocol class for ``http``, as ``uvicorn.Config(http=...)`` loads it."""
        self.connections: set[GuardedHTTPProtocol] = set()
        """The open connections that count against ``max_connections``."""
        # Idle keep-alive connections, oldest first: the first to close when the cap is reached.
        self.idle: dict[GuardedHTTPProtocol, None] = {}
        # Connections whose request head is arriving, by when it began (oldest first): one
        # arriving for longer than stalled_after is cut to make room before an idle one.
        self.heads: dict[GuardedHTTPProtocol, float] = {}
        self.stalled_after = limits.head_timeout / 4

    def __repr__(self) -> str:
        return (
            f"<ConnectionGuard http={self.http} [conns: {len(self.connections)} open, "
            f"{len(self.idle)} idle, {len(self.heads)} heads arriving]>"
        )

    def protocol(self) -> type[GuardedHTTPProtocol]:
        """The protocol class to give ``uvicorn.Config(http=...)``: each connection guarded here."""
        bounded = type("BoundedHTTPProtocol", (GuardedHTTPProtocol,), {"guard": self})
        return cast(type[GuardedHTTPProtocol], bounded)


def watch_requests(app: ASGIApp) -> ASGIApp:
    """``app``, telling each request's :class:`GuardedHTTPProtocol` when the app is done with it.

    Give this to ``uvicorn.Config`` (with ``reset_contextvars`` off, its default): without it, a
    guarded connection never counts as idle, and the cap cannot close one to make room.
    """

    async def watched(scope: Scope, receive: Receive, send: Send) -> None:
        connection = _CONNECTION.get()
        if connection is None:  # lifespan, or a connection this module does not guard
            await app(scope, receive, send)
            return
        try:
            await app(scope, receive, send)
        finally:
            connection._request_done()

    return watched


def _raw_response(status: int, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole ``Connection: close`` response with the daemon's JSON error body."""
    body = error_body(DaemonError(message, status=status))
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _WatchedTransport:
    """The transport uvicorn's protocol writes to: it notes that a response began, drops what is
    written once the connection began closing (after a refusal's own answer), and keeps the
    connection's protocol the guard when uvicorn hands it on (a WebSocket upgrade)."""

    __slots__ = ("_connection", "_transport")

    def __init__(self, transport: asyncio.Transport, connection: GuardedHTTPProtocol) -> None:
        self._transport = transport
        self._connection = connection

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._transport.is_closing():
            return
        connection = self._connection
        if not connection._responding:
            if bytes(data[: len(_CONTINUE)]) == _CONTINUE:
                connection._continued()
            else:
                connection._responding = True
                connection._expect_continue = False
        self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._connection._switched(cast(asyncio.Protocol, protocol))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedHTTPProtocol(asyncio.Protocol):
    """One connection: uvicorn's protocol inside, the module's bounds around it.

    Made by uvicorn's server through :meth:`ConnectionGuard.protocol`, with the keywords it
    passes to every protocol class; those go to uvicorn's protocol unread.
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(self, **uvicorn_keywords: Any) -> None:
        self._keywords = uvicorn_keywords
        self.loop = asyncio.get_running_loop()  # uvicorn makes protocols on the running loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self.inner: asyncio.Protocol | None = None
        """uvicorn's protocol, once the connection is accepted under the cap."""
        self._parser = httptools.HttpRequestParser(self)
        # As uvicorn's own parser: a request is answered even when more follows a
        # "Connection: close" one on the wire.
        if hasattr(self._parser, "set_dangerous_leniencies"):
            self._parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._cut = False  # refused or closed by this module: nothing more is read
        self._inner_lost = False  # uvicorn's protocol was told the connection is gone
        # Why the guard's parser stopped following the bytes ("upgrade", "invalid", "switched"
        # once uvicorn handed the connection to a WebSocket protocol), if it did.
        self._unframed: str | None = None
        self._idle = False
        self._head_open = True
        self._head_bytes = 0
        self._heads_done = 0
        self._head_deadline: float | None = None
        self._body_open = False
        self._expect_continue = False
        self._last_progress = 0.0
        self._pending = 0  # requests whose head arrived and whose app has not returned
        self._responding = False  # a response began since the app last returned
        self._timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        state = "cut" if self._cut else "idle" if self._idle else "body" if self._body_open else ""
        state = state or ("head" if self._head_deadline is not None else "between requests")
        return f"<GuardedHTTPProtocol {state}, {self._pending} request(s) in the app>"

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance(transport, asyncio.Transport): uvloop's transports are not subclasses.
        self.transport = cast(asyncio.Transport, transport)
        guard = self.guard
        if len(guard.connections) >= guard.limits.max_connections and not (
            self._evict_stalled(guard) or self._evict_idle(guard)
        ):
            self._cut = True
            guard.log.note("over the connection cap")
            retry = str(max(1, round(guard.limits.retry_after)))
            message = "the daemon has too many open connections; retry later"
            self.transport.write(_raw_response(503, message, {"retry-after": retry}))
            self.transport.close()
            return
        guard.connections.add(self)
        self.inner = guard.inner(**self._keywords)
        self.inner.connection_made(_WatchedTransport(self.transport, self))  # type: ignore[arg-type]
        self._start_head(self.loop.time())

    def data_received(self, data: bytes) -> None:
        if self._cut or self.inner is None:
            return
        if self._unframed == "switched":  # a WebSocket's: its protocol bounds its own frames
            self.inner.data_received(data)
            return
        if self._unframed == "upgrade":  # what follows an upgrade request is not HTTP/1.1
            self._end(400, "this daemon does not switch protocols", "upgrade request cut (400)")
            return
        self._unmark_idle()
        self._last_progress = self.loop.time()
        if not self._frame(data):
            return  # refused: not a byte of this read reaches uvicorn
        token = _CONNECTION.set(self)
        try:
            self.inner.data_received(data)
        finally:
            _CONNECTION.reset(token)
        if self._unframed == "invalid" and not self._cut and not self.transport.is_closing():
            # uvicorn's parser took what the guard's refused: the bounds no longer follow it.
            self._end(400, "the request is not valid HTTP/1.1", "invalid request cut (400)")

    def eof_received(self) -> bool | None:
        if self.inner is None or self._inner_lost:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cut = True
        self._closed()
        if self.inner is not None and not self._inner_lost:
            self._inner_lost = True
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None and not self._inner_lost:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None and not self._inner_lost:
            self.inner.resume_writing()

    # -- framing: where heads and bodies begin and end ---------------------------------------------

    def _frame(self, data: bytes) -> bool:
        """Run ``data`` through the guard's parser, counting head bytes; False when refused."""
        limit = self.guard.limits.max_head_bytes
        while True:
            if not self._head_open:
                self._parse(data)
                return True
            room = limit - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                self._parse(data)
                return True
            # The head may end within the room left: parse that much, and refuse only if it did not.
            heads = self._heads_done
            if room > 0:
                self._head_bytes += room
                self._parse(data[:room])
                if self._unframed is not None:
                    return True  # uvicorn's parser decides (a 400)
            if self._heads_done == heads:
                message = f"the request line and headers exceed {limit} bytes"
                self._end(431, message, "request head too large (431)")
                return False
            data = data[room:]

    def _parse(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The rest of the connection is another protocol's: uvicorn hands it to a WebSocket
            # protocol (_switched), or answers the request in HTTP/1.1 and the next read ends it.
            self._unframed = "upgrade"
        except httptools.HttpParserError:
            # uvicorn's parser answers 400 and closes (data_received closes it if it did not).
            self._unframed = "invalid"

    # httptools' callbacks, from the guard's parser.
    def on_message_begin(self) -> None:
        self._unmark_idle()
        if self._head_deadline is None:  # the first byte of a keep-alive connection's next request
            self._start_head(self.loop.time())

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 6 and name.lower() == b"expect":
            self._expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self.guard.heads.pop(self, None)
        self._head_open = False
        self._heads_done += 1
        self._head_bytes = 0
        self._head_deadline = None
        self._body_open = True
        self._pending += 1
        self._last_progress = self.loop.time()
        self._arm(self._last_progress + self.guard.limits.body_timeout)

    def on_message_complete(self) -> None:
        self._body_open = False
        self._expect_continue = False
        self._head_open = True
        self._head_bytes = 0
        self._head_deadline = None
        self._maybe_idle()

    # -- what uvicorn's side tells this one --------------------------------------------------------

    def _request_done(self) -> None:
        """The app returned from a request of this connection (its response is complete)."""
        self._pending = max(0, self._pending - 1)
        self._responding = False
        self._maybe_idle()

    def _switched(self, protocol: asyncio.Protocol) -> None:
        """uvicorn handed the connection to ``protocol`` (a WebSocket's): the bytes and events go
        there from now on, and the connection counts against the cap until it closes."""
        self.inner = protocol
        self._unframed = "switched"
        self._stop_timer()
        self._unmark_idle()
        self.guard.heads.pop(self, None)
        self._head_deadline = None
        self._body_open = False

    def _continued(self) -> None:
        """uvicorn sent ``100 Continue``: the body's clock starts now."""
        self._expect_continue = False
        self._last_progress = self.loop.time()

    # -- the cap -----------------------------------------------------------------------------------

    def _start_head(self, now: float) -> None:
        """A request head begins to arrive (the connection opened, or a next request's byte)."""
        self._head_deadline = now + self.guard.limits.head_timeout
        self.guard.heads[self] = now
        self._arm(self._head_deadline)

    def _maybe_idle(self) -> None:
        """Count the connection idle when it waits for a next request, nothing in the app."""
        if self._pending or self._body_open or self._head_deadline is not None or self._idle:
            return
        if self._unframed is not None:
            return
        if self._cut or self.transport.is_closing():
            return
        self._idle = True
        self.guard.idle[self] = None

    def _unmark_idle(self) -> None:
        if self._idle:
            self._idle = False
            self.guard.idle.pop(self, None)

    def _closed(self) -> None:
        """Forget this connection in the guard's state (it is closing)."""
        self._stop_timer()
        self._unmark_idle()
        self.guard.heads.pop(self, None)
        self.guard.connections.discard(self)

    @staticmethod
    def _evict_stalled(guard: ConnectionGuard) -> bool:
        """Cut the connection whose head has arrived for longest, when that is longer than
        ``guard.stalled_after``; False when there is none."""
        if not guard.heads:
            return False
        oldest, began = next(iter(guard.heads.items()))
        if oldest.loop.time() - began < guard.stalled_after:
            return False
        oldest._end(
            408,
            "the request line and headers arrived too slowly, and a new connection needed room",
            "slow request head cut to make room (408)",
        )
        return True

    @staticmethod
    def _evict_idle(guard: ConnectionGuard) -> bool:
        """Close the oldest idle keep-alive connection; False when there is none."""
        while guard.idle:
            oldest = next(iter(guard.idle))
            oldest._unmark_idle()
            if not oldest.transport.is_closing():
                guard.log.note("idle keep-alive closed to make room")
                oldest._closed()
                oldest.transport.close()
                return True
        return False

    # -- deadlines ---------------------------------------------------------------------------------

    def _arm(self, when: float) -> None:
        """Check the deadlines at ``when`` (or earlier, when already due sooner)."""
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._check_deadlines)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_deadlines(self) -> None:
        self._timer = None
        if self._cut or self._unframed == "switched" or self.transport.is_closing():
            return
        now = self.loop.time()
        limits = self.guard.limits
        if self._head_open and self._head_deadline is not None:
            if now >= self._head_deadline:
                message = (
                    f"the request line and headers did not arrive within {limits.head_timeout:g} s"
                )
                self._end(408, message, "request head timed out (408)")
            else:
                self._arm(self._head_deadline)
            return
        if not self._body_open:
            return
        if self._expect_continue or not self.transport.is_reading():
            self._last_progress = now  # the daemon is not reading: not the client's delay
        deadline = self._last_progress + limits.body_timeout
        if now >= deadline:
            message = f"the request body stalled: no byte for {limits.body_timeout:g} s"
            self._end(408, message, "request body stalled (408)")
        else:
            self._arm(deadline)

    def _end(
        self, status: int, message: str, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        """Answer ``status`` when no response has begun on this connection, and close it."""
        self._cut = True
        self._closed()
        self.guard.log.note(reason)
        if not self._responding and not self.transport.is_closing():
            self.transport.write(_raw_response(status, message, headers))
        self.transport.close()
        if self.inner is not None and not self._inner_lost:
            # uvicorn's protocol lets the app see a disconnect; what it sends later is dropped.
            self._inner_lost = True
            self.inner.connection_lost(None)
