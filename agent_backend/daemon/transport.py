"""The daemon's HTTP protocol: uvicorn's, writing through a coalescing transport, bounded before auth.

Coalescing. uvicorn writes a response's status line and headers, then its
body, as two ``transport.write`` calls: two ``send`` system calls, and on a
virtual machine each one that wakes the peer costs up to half a millisecond
of CPU. :class:`_CoalescingTransport` gathers the writes made during one turn
of the event loop and sends them together: as soon as the response is
complete (:meth:`CoalescingHTTPProtocol.on_response_complete`), else on the
loop's next turn (``call_soon``, for a response still streaming).

Bounds (:class:`ConnectionGuard`), enforced here because they must hold
before a request reaches the app and its token check:

* a request head (request line and headers) larger than ``max_head_bytes``
  gets 431, having been read no further than that plus one read;
* a head not received whole within ``head_timeout`` of its first byte (of
  the connection, for the first request) gets 408: each byte does not
  extend it; a body that brings no byte for ``body_timeout`` gets 408 (or
  is cut, when a response has begun);
* past ``max_connections`` open connections, a new one makes room: the
  connection whose head has been arriving longest is cut (408) when that is
  over a quarter of ``head_timeout`` (a head a client sent at once arrives in
  one read: one still arriving that long is a slow or stalled client's, and
  slowloris connections cannot hold every slot until their deadline), else
  the oldest idle keep-alive connection is closed; when neither exists, the
  new one gets 503 with ``Retry-After`` and is closed.

Each refusal is counted by :class:`RefusalLog`, which logs one summary line
per interval, never one per connection. The bounds hook httptools' parser
callbacks; under uvicorn's pure-Python fallback only the connection cap and
uvicorn's own ``h11_max_incomplete_event_size`` (a 400) apply.

This module must never hold data past the current loop turn, never write
after the transport began closing, and never write a second response over
one that has begun.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http
import logging
from typing import Any, ClassVar, cast

from agent_backend.daemon.errors import error_body
from agent_backend.errors import DaemonError

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base

    _PARSER_HOOKS = True
except ImportError:  # httptools missing: uvicorn's pure-Python protocol
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]

    _PARSER_HOOKS = False

__all__ = ["CoalescingHTTPProtocol", "ConnectionGuard", "ConnectionLimits", "RefusalLog"]

logger = logging.getLogger("agent_backend.daemon")


class _CoalescingTransport:
    """An ``asyncio.Transport`` whose writes of one loop turn leave as one."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what was written so far (a no-op when nothing is pending)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


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
    """The limits and the state that the connections of one server share."""

    def __init__(self, limits: ConnectionLimits, *, log: RefusalLog | None = None) -> None:
        self.limits = limits
        self.log = log if log is not None else RefusalLog()
        # Idle keep-alive connections, oldest first: the first to close when the cap is reached.
        self.idle: dict[CoalescingHTTPProtocol, None] = {}
        # Connections whose request head is arriving, by when it began (oldest first): one
        # arriving for longer than stalled_after is cut to make room before an idle one.
        self.heads: dict[CoalescingHTTPProtocol, float] = {}
        self.stalled_after = limits.head_timeout / 4


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


class CoalescingHTTPProtocol(_Base):
    """uvicorn's HTTP protocol (httptools, else h11) writing through :class:`_CoalescingTransport`.

    With a :attr:`guard` (:meth:`bounded`), it enforces the module's bounds.
    """

    guard: ClassVar[ConnectionGuard | None] = None

    @classmethod
    def bounded(cls, guard: ConnectionGuard) -> type[CoalescingHTTPProtocol]:
        """This protocol, enforcing ``guard``'s limits on every connection of one server."""
        return cast(
            type[CoalescingHTTPProtocol], type("BoundedHTTPProtocol", (cls,), {"guard": guard})
        )

    # Per-connection state of the bounds (set in connection_made).
    _cut: bool = False
    _idle: bool = False
    _head_open: bool = True
    _head_bytes: int = 0
    _heads_done: int = 0
    _head_deadline: float | None = None
    _body_open: bool = False
    _last_progress: float = 0.0
    _timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        full = guard is not None and len(self.connections) >= guard.limits.max_connections
        if full:
            assert guard is not None
            full = not (self._evict_stalled(guard) or self._evict_idle(guard))
        # Not isinstance(transport, asyncio.Transport): uvloop's transports are not subclasses.
        coalescing = _CoalescingTransport(cast(asyncio.Transport, transport))
        super().connection_made(coalescing)  # type: ignore[arg-type]
        if guard is None:
            return
        if full:
            retry = str(max(1, round(guard.limits.retry_after)))
            message = "the daemon has too many open connections; retry later"
            self._end(503, message, "over the connection cap", {"retry-after": retry})
            return
        if _PARSER_HOOKS:
            self._start_head(guard, self.loop.time())

    def _start_head(self, guard: ConnectionGuard, now: float) -> None:
        """A request head begins to arrive (the connection opened, or a next request's byte)."""
        self._head_deadline = now + guard.limits.head_timeout
        guard.heads[self] = now
        self._arm(self._head_deadline)

    def _head_done(self) -> None:
        if self.guard is not None:
            self.guard.heads.pop(self, None)

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
            del guard.idle[oldest]
            oldest._idle = False
            if not oldest.transport.is_closing():
                guard.log.note("idle keep-alive closed to make room")
                oldest.transport.close()
                return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cut = True
        self._stop_timer()
        self._unmark_idle()
        self._head_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        guard = self.guard
        if guard is None or not _PARSER_HOOKS:
            super().data_received(data)
            return
        if self._cut:
            return
        self._unmark_idle()
        now = self.loop.time()
        self._last_progress = now
        if not self._head_open:
            super().data_received(data)
            return
        if self._head_deadline is None:  # the first byte of a keep-alive connection's next request
            self._start_head(guard, now)
        room = guard.limits.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # The head may end within the room left: parse that much, and refuse only if it did not.
        heads = self._heads_done
        if room > 0:
            self._head_bytes += room
            super().data_received(data[:room])
        if self._cut or self.transport.is_closing():
            return
        if self._heads_done == heads:
            limit = guard.limits.max_head_bytes
            self._end(
                431,
                f"the request line and headers exceed {limit} bytes",
                "request head too large (431)",
            )
            return
        self.data_received(data[room:])

    # httptools' parser callbacks: where a head and a body begin and end.
    def on_headers_complete(self) -> None:
        guard = self.guard
        if guard is not None:
            self._head_done()
            self._head_open = False
            self._heads_done += 1
            self._head_bytes = 0
            self._head_deadline = None
            self._body_open = True
            self._last_progress = self.loop.time()
            self._arm(self._last_progress + guard.limits.body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.guard is not None:
            self._body_open = False
            self._head_open = True
            self._head_bytes = 0
            self._head_deadline = None

    def on_response_complete(self) -> None:
        # The whole response is written: send it now rather than on the next loop turn.
        transport: Any = self.transport
        if isinstance(transport, _CoalescingTransport):
            transport.flush()
        super().on_response_complete()
        guard = self.guard
        if (
            guard is not None
            and self.timeout_keep_alive_task is not None
            and not self.transport.is_closing()
        ):
            guard.idle[self] = None
            self._idle = True

    def _unmark_idle(self) -> None:
        if self._idle:
            self._idle = False
            if self.guard is not None:
                self.guard.idle.pop(self, None)

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
        guard = self.guard
        if guard is None or self._cut or self.transport.is_closing():
            return
        now = self.loop.time()
        if self._head_open and self._head_deadline is not None:
            if now >= self._head_deadline:
                timeout = guard.limits.head_timeout
                message = f"the request line and headers did not arrive within {timeout:g} s"
                self._end(408, message, "request head timed out (408)")
            else:
                self._arm(self._head_deadline)
            return
        if not self._body_open:
            return
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            self._last_progress = now  # the daemon is not reading: not the client's delay
        deadline = self._last_progress + guard.limits.body_timeout
        if now >= deadline:
            timeout = guard.limits.body_timeout
            message = f"the request body stalled: no byte for {timeout:g} s"
            self._end(408, message, "request body stalled (408)")
        else:
            self._arm(deadline)

    def _end(
        self, status: int, message: str, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        """Answer ``status`` when no response has begun on this connection, and close it."""
        assert self.guard is not None
        self._cut = True
        self._stop_timer()
        self._unmark_idle()
        self._head_done()
        self.guard.log.note(reason)
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(_raw_response(status, message, headers))
        if cycle is not None and not cycle.response_complete:
            # The app sees a disconnect; what it sends later is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
