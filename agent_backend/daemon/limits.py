"""Bounds on what one request, and one caller, may ask of the daemon.

* :class:`BodyLimit`: a body over ``max_body_bytes`` is refused with 413,
  from its ``Content-Length`` before a byte is read, or as soon as a
  chunked body passes the limit. The body read is kept in the scope
  (:data:`BODY_KEY`) for the idempotency check, and replayed to the app.
* :class:`ConcurrencyLimit`: each token may have ``limit`` requests in
  flight; one more is refused at once with 429 and ``Retry-After``, never
  queued (a queue would hide overload from the caller). While the daemon
  drains for shutdown, new work is refused with 503, and work cancelled at
  the end of the grace period is answered 503 too.

Per-call argument size is checked where the call is read (``app.py``).
This module must never buffer more than the limit, and never wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Final

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY
from agent_backend.daemon.errors import send_error
from agent_backend.errors import RateLimited, RequestTooLarge, ServiceUnavailable
from agent_backend.wire import API_PREFIX

__all__ = ["BODY_KEY", "UNLIMITED_PATHS", "BodyLimit", "ConcurrencyLimit", "InFlight"]

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


class InFlight:
    """Requests in flight per token (shared with metrics)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<InFlight {self.counts}>"

    def total(self) -> int:
        return sum(self.counts.values())

    def of(self, principal: str) -> int:
        return self.counts.get(principal, 0)


class ConcurrencyLimit:
    """ASGI middleware: at most ``limit`` requests in flight per token; 429 beyond."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        retry_after: float,
        draining: Callable[[], bool],
        in_flight: InFlight | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.retry_after = retry_after
        self.draining = draining
        self.in_flight = in_flight if in_flight is not None else InFlight()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.draining():
            await send_error(send, ServiceUnavailable("the daemon is shutting down"))
            return
        principal = scope.get(PRINCIPAL_KEY, "")
        counts = self.in_flight.counts
        count = counts.get(principal, 0)
        if count >= self.limit:
            await send_error(
                send,
                RateLimited(
                    f"{self.limit} requests are already in flight for this token",
                    retry_after=self.retry_after,
                    limit=self.limit,
                ),
            )
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
            left = counts[principal] - 1
            if left:
                counts[principal] = left
            else:
                del counts[principal]
