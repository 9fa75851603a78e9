"""Bounds on what one request, and one caller, may ask of the daemon.

* :class:`BodyLimit`: a body over ``max_body_bytes`` is refused with 413,
  from its ``Content-Length`` before a byte is read, or as soon as a
  chunked body passes the limit. The body read is kept in the scope
  (:data:`BODY_KEY`) for the idempotency check, and replayed to the app.
* :class:`ConcurrencyLimit` and :class:`InFlight`: each token may have
  ``limit`` tool calls in flight, whichever route carries them. A request
  takes one slot as it comes in; a batch (``/v1/batch``, a JSON-RPC batch
  on ``/mcp``) takes one more per call beyond the first before any of them
  runs (:meth:`InFlight.hold`), all or none. Past the limit the request is
  refused at once with 429 and ``Retry-After``, never queued (a queue would
  hide overload from the caller); a batch of more calls than ``limit`` could
  never run, and is refused with 422 saying the most it may hold. While the
  daemon drains for shutdown, new work is refused with 503, and work
  cancelled at the end of the grace period is answered 503 too.

Per-call argument size is checked where the call is read (``app.py``).
This module must never buffer more than the limit, and never wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Final

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY
from agent_backend.daemon.errors import send_error
from agent_backend.errors import (
    InvalidRequest,
    RateLimited,
    RequestTooLarge,
    ServiceUnavailable,
)
from agent_backend.wire import API_PREFIX

__all__ = [
    "BODY_KEY",
    "UNLIMITED_PATHS",
    "BodyLimit",
    "ConcurrencyLimit",
    "InFlight",
    "check_batch_size",
]

#: The ASGI scope key the request body is kept under once read.
BODY_KEY: Final = "agent_backend.body"
#: Cheap read-only routes that are never counted against a token's concurrency.
UNLIMITED_PATHS: Final = frozenset(
    {f"{API_PREFIX}/health/live", f"{API_PREFIX}/health/ready", "/metrics", "/openapi.json"}
)

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: read a request body up to ``max_bytes``; 413 past it."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"the request body is larger than {self.max_bytes} bytes",
            limit=self.max_bytes,
            what="body",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await send_error(send, self._too_large())
                    return
                break
        try:
            body, after = await self._read(receive)
        except _TooLarge:
            await send_error(send, self._too_large())
            return
        scope[BODY_KEY] = body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            if after is not None:  # the client left while we read
                return after
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> tuple[bytes, Message | None]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def check_batch_size(size: int, max_batch: int, *, unit: str = "calls") -> None:
    """Refuse a batch of more than ``max_batch`` items with 422, on every route alike."""
    if size > max_batch:
        raise InvalidRequest(
            f"a batch has at most {max_batch} {unit}, not {size}",
            issues=[{"loc": ["body", "calls"], "msg": f"more than {max_batch} {unit}"}],
        )


class InFlight:
    """Each token's call slots in flight, and the most it may hold (shared by ``/v1``, ``/mcp``
    and the metrics).

    One slot per tool call: a request holds one from its start to its end
    (:class:`ConcurrencyLimit`), and a batch one more per call beyond the
    first while it runs (:meth:`hold`). Synchronous and called from one event
    loop, so each method is atomic.
    """

    def __init__(self, *, limit: int, retry_after: float) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self.retry_after = retry_after
        self.counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<InFlight limit={self.limit} {self.counts}>"

    def total(self) -> int:
        return sum(self.counts.values())

    def of(self, principal: str) -> int:
        return self.counts.get(principal, 0)

    def refusal(self, *, needed: int = 1) -> RateLimited:
        """The 429 for a request that needs ``needed`` slots more than the token has free."""
        if needed <= 1:
            message = (
                f"{self.limit} calls are already in flight for this token, the most it may have "
                "(each request holds one slot, a batch one per call)"
            )
        else:
            message = (
                f"this batch needs {needed} of this token's {self.limit} call slots and fewer "
                "are free (other calls are in flight); none of it ran"
            )
        return RateLimited(message, retry_after=self.retry_after, limit=self.limit)

    def take(self, principal: str, calls: int, *, what: str = "a batch") -> int:
        """Take a slot for each of ``calls`` calls of one request beyond its own (the first).

        All at once, before the calls start; returns how many were taken, to
        :meth:`give` back when the request ends. Raises, having taken nothing:
        :class:`InvalidRequest` (422) when ``calls`` is more than ``limit``, so
        that no wait could make room; :class:`RateLimited` (429, ``Retry-After``)
        when the token lacks that many free slots now.
        """
        extra = calls - 1
        if extra <= 0:  # the request's own slot covers it
            return 0
        if calls > self.limit:
            raise InvalidRequest(
                f"{what} may hold at most {self.limit} calls, not {calls}: that is the most this "
                "token may have in flight (max_concurrent_per_token); split it",
                issues=[{"loc": ["body", "calls"], "msg": f"more than {self.limit} calls"}],
            )
        held = self.counts.get(principal, 0)
        if held + extra > self.limit:
            raise self.refusal(needed=calls)
        self.counts[principal] = held + extra
        return extra

    def give(self, principal: str, taken: int) -> None:
        """Give back ``taken`` slots of ``principal`` (what :meth:`take` returned)."""
        if taken:
            left = self.counts[principal] - taken
            if left:
                self.counts[principal] = left
            else:
                del self.counts[principal]

    @contextlib.contextmanager
    def hold(self, principal: str, calls: int, *, what: str = "a batch") -> Iterator[None]:
        """:meth:`take` on the way in, :meth:`give` on the way out (cancellation included)."""
        taken = self.take(principal, calls, what=what)
        try:
            yield
        finally:
            self.give(principal, taken)


class ConcurrencyLimit:
    """ASGI middleware: a slot of ``in_flight`` per request, 429 when its token has none free."""

    def __init__(self, app: ASGIApp, *, in_flight: InFlight, draining: Callable[[], bool]) -> None:
        self.app = app
        self.in_flight = in_flight
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.draining():
            await send_error(send, ServiceUnavailable("the daemon is shutting down"))
            return
        principal = scope.get(PRINCIPAL_KEY, "")
        in_flight = self.in_flight
        counts = in_flight.counts
        count = counts.get(principal, 0)
        if count >= in_flight.limit:
            await send_error(send, in_flight.refusal())
            return
        # Counted synchronously before the first await, released in finally: no leak on cancel.
        counts[principal] = count + 1
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except anyio.get_cancelled_exc_class():
            if not self.draining():
                raise
            # Cancelled by shutdown after the grace period (its processes are being
            # killed). This is the top of the request's task, and uvicorn would
            # swallow the cancellation and answer 500: answer 503 instead, which
            # says "not done, retry elsewhere or later".
            if not started:
                with contextlib.suppress(Exception):
                    await send_error(
                        send,
                        ServiceUnavailable(
                            "the daemon shut down before this request finished; "
                            "what it started was stopped"
                        ),
                    )
        finally:
            left = counts[principal] - 1  # inline: every request passes here
            if left:
                counts[principal] = left
            else:
                del counts[principal]
