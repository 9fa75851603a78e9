"""Exactly once under retries: the ``Idempotency-Key`` header.

A POST that carries a key runs once. A retry with the same key (and the same
token) gets the first response, replayed byte for byte with
``Idempotent-Replayed: true``; a retry that arrives while the first is still
running waits for it. The same key with a different request (method, path
or body, compared as canonical JSON) is a 409.

Kept responses are bounded in time (``ttl`` from when they finished), in
count and in bytes; the oldest finished ones are dropped first. A response
with a 5xx status is handed to the requests waiting on it and then dropped,
so a later retry runs again (the daemon or its backend failed: nothing was
known to have happened, or it is worth another try). A first request that
ends without any response (cancelled) lets its waiters take over.

:class:`IdempotencyStore` is a synchronous state machine (tested without a
network); :class:`Idempotency` is the ASGI middleware around it. This module
must never run a request twice for one key while the first is running or
kept, and never keep more than its bounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Literal

import anyio
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_backend.daemon.auth import PRINCIPAL_KEY
from agent_backend.daemon.errors import send_error
from agent_backend.daemon.limits import BODY_KEY
from agent_backend.errors import IdempotencyConflict, InvalidRequest
from agent_backend.wire import API_PREFIX

__all__ = ["Idempotency", "IdempotencyStatistics", "IdempotencyStore", "StoredResponse"]

logger = logging.getLogger("agent_backend.daemon")

_HEADER: Final = b"idempotency-key"
_REPLAYED: Final = (b"idempotent-replayed", b"true")
_MAX_KEY = 255
_VALID_KEY: Final = re.compile(rb"[\x21-\x7e]{1,%d}" % _MAX_KEY)


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    size: int = dataclasses.field(init=False, compare=False)
    """Bytes it holds, as counted against the store's bound."""

    def __post_init__(self) -> None:
        size = len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + 64
        object.__setattr__(self, "size", size)


@dataclasses.dataclass(eq=False, slots=True)
class _Entry:
    fingerprint: bytes
    done: anyio.Event
    response: StoredResponse | None = None
    expires: float = float("inf")


@dataclasses.dataclass(frozen=True, slots=True)
class IdempotencyStatistics:
    running: int
    kept: int
    kept_bytes: int
    replays: int
    conflicts: int


Key = tuple[str, str]
Action = Literal["run", "wait", "replay", "conflict"]


class IdempotencyStore:
    """Keys to running or finished requests; state changes are synchronous."""

    def __init__(
        self,
        *,
        ttl: float,
        max_entries: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._running: dict[Key, _Entry] = {}
        self._kept: OrderedDict[Key, _Entry] = OrderedDict()  # oldest finished first
        self._bytes = 0
        self._replays = 0
        self._conflicts = 0

    def __repr__(self) -> str:
        return (
            f"<IdempotencyStore [running: {len(self._running)} | kept: {len(self._kept)},"
            f" {self._bytes} bytes]>"
        )

    def statistics(self) -> IdempotencyStatistics:
        return IdempotencyStatistics(
            running=len(self._running),
            kept=len(self._kept),
            kept_bytes=self._bytes,
            replays=self._replays,
            conflicts=self._conflicts,
        )

    def begin(self, key: Key, fingerprint: bytes) -> tuple[Action, _Entry | None]:
        """What to do with a request: run it, wait for the first, replay it, or refuse it."""
        self._evict()
        entry = self._running.get(key)
        action: Action = "wait"
        if entry is None:
            entry = self._kept.get(key)
            action = "replay"
        if entry is not None:
            if entry.fingerprint != fingerprint:
                self._conflicts += 1
                return "conflict", entry
            if action == "replay":
                self._replays += 1
            return action, entry
        entry = _Entry(fingerprint, anyio.Event())
        if len(self._running) < self.max_entries:
            self._running[key] = entry
        else:  # cannot happen under the concurrency limit; run unrecorded rather than refuse
            logger.warning("idempotency store full of running requests; running one unrecorded")
        return "run", entry

    def finish(self, key: Key, entry: _Entry, response: StoredResponse | None) -> None:
        """The first request ended with ``response`` (None: it ended without one)."""
        if self._running.get(key) is entry:
            del self._running[key]
        entry.response = response
        entry.done.set()
        keep = response is not None and response.status < 500 and response.size <= self.max_bytes
        if keep and response is not None:
            entry.expires = self._clock() + self.ttl
            self._kept[key] = entry
            self._bytes += response.size
            self._evict()

    def _drop_oldest(self) -> None:
        _, entry = self._kept.popitem(last=False)
        assert entry.response is not None
        self._bytes -= entry.response.size

    def _evict(self) -> None:
        now = self._clock()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._drop_oldest()
        while self._kept and (
            self._bytes > self.max_bytes or len(self._kept) + len(self._running) > self.max_entries
        ):
            self._drop_oldest()


def fingerprint(method: str, path: str, body: bytes) -> bytes:
    """A digest of the request; the body as canonical JSON, so key order does not matter."""
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        canonical = body
    digest = hashlib.sha256(f"{method} {path}\n".encode())
    digest.update(canonical)
    return digest.digest()


class Idempotency:
    """ASGI middleware: POSTs under ``/v1/`` with an ``Idempotency-Key`` run once."""

    def __init__(self, app: ASGIApp, *, store: IdempotencyStore, max_response_bytes: int) -> None:
        self.app = app
        self.store = store
        self.max_response_bytes = max_response_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not scope["path"].startswith(API_PREFIX + "/")
        ):
            await self.app(scope, receive, send)
            return
        raw_key = None
        for name, value in scope["headers"]:
            if name == _HEADER:
                raw_key = value
                break
        if raw_key is None:
            await self.app(scope, receive, send)
            return
        if not _VALID_KEY.fullmatch(raw_key):
            await send_error(
                send,
                InvalidRequest(
                    f"an Idempotency-Key is 1 to {_MAX_KEY} visible ASCII characters",
                    issues=[{"loc": ["header", "Idempotency-Key"], "msg": "invalid key"}],
                ),
            )
            return
        key = (str(scope.get(PRINCIPAL_KEY, "")), raw_key.decode("ascii"))
        digest = fingerprint(scope["method"], scope["path"], scope.get(BODY_KEY, b""))
        while True:
            action, entry = self.store.begin(key, digest)
            assert entry is not None
            if action == "conflict":
                await send_error(
                    send,
                    IdempotencyConflict(
                        "this Idempotency-Key was used for a different request; use a new key",
                        key=key[1],
                    ),
                )
                return
            if action == "run":
                await self._run(key, entry, scope, receive, send)
                return
            if action == "wait":
                await entry.done.wait()
            if entry.response is not None:
                await _replay(send, entry.response)
                return
            # The first request ended without a response (cancelled): take over.

    async def _run(
        self, key: Key, entry: _Entry, scope: Scope, receive: Receive, send: Send
    ) -> None:
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        complete = False
        client_gone = False

        async def capture(message: Message) -> None:
            nonlocal status, headers, size, complete, client_gone
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k != b"date"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size <= self.max_response_bytes:
                    chunks.append(chunk)
                complete = not message.get("more_body", False)
            if client_gone:
                return
            try:
                await send(message)
            except OSError:  # the client left; finish anyway so that its retry gets the result
                client_gone = True

        response: StoredResponse | None = None
        try:
            await self.app(scope, receive, capture)
            if complete and status and size <= self.max_response_bytes:
                response = StoredResponse(status, tuple(headers), b"".join(chunks))
        finally:
            self.store.finish(key, entry, response)


async def _replay(send: Send, response: StoredResponse) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [*response.headers, _REPLAYED],
        }
    )
    await send({"type": "http.response.body", "body": response.body})
