"""A client for the daemon with the same calls as :class:`~agent_backend.dispatch.Dispatcher`.

Switching between in-process and remote execution is one line::

    runner = Dispatcher(registry, pool)            # in this process
    runner = Client("http://127.0.0.1:8765")       # through a daemon
    async with runner:
        result = await runner.call(("exec", {"command": "ls"}))
        async with runner.session() as session:
            await session.call(("write_file", {"path": "a.txt", "content": "hi"}))

Every call carries an ``Idempotency-Key``; a retry (after a connection error,
a 429 with ``Retry-After``, or a 503) sends the same key, so the daemon runs
the call once and hands the retry the first result. Failures come back as
the same exception classes as in-process (:func:`agent_backend.wire.error_from_wire`),
and an unreachable daemon as :class:`~agent_backend.errors.BackendUnavailable`.

Requests to an ``http://`` daemon go through :class:`~agent_backend.http11.HTTP11Transport`
(a lean HTTP/1.1 keep-alive transport: with it a call costs the client about
a third of the CPU it does on httpx's default one); ``https://`` through httpx's own.

:class:`SyncClient` is the same client for code without an event loop.
This module must never retry without the idempotency key, never retry a
5xx that may have run the call (502, 504), and never import a class a
server names.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, Self

import anyio
import anyio.from_thread
import httpx
import orjson

from agent_backend.backoff import backoff_delay
from agent_backend.dispatch import CallLike, ToolResult, as_tool_call
from agent_backend.errors import AgentBackendError, BackendUnavailable, NotFound, PoolClosed
from agent_backend.http11 import HTTP11Transport
from agent_backend.lifecycle import AsyncResource, SyncResource
from agent_backend.tokens import find_token
from agent_backend.wire import (
    API_PREFIX,
    IDEMPOTENCY_HEADER,
    BatchResponse,
    Readiness,
    SessionInfo,
    ToolsResponse,
    error_from_wire,
)

__all__ = ["DEFAULT_URL", "Client", "RemoteSession", "SyncClient", "SyncSession"]

#: Where ``agent-backend serve`` listens by default.
DEFAULT_URL: Final = "http://127.0.0.1:8765"
URL_ENV: Final = "AGENT_BACKEND_URL"

_IDEMPOTENCY_HEADER = IDEMPOTENCY_HEADER.encode()
# Safe to retry with the same key: refused before running (429 RateLimited, 503).
_RETRY_STATUSES = frozenset({429, 503})
# The longest Retry-After honoured; beyond it the error is raised.
_MAX_RETRY_AFTER = 30.0
_Format = Literal["openai", "anthropic", "mcp"]


def _dumps(body: object) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # integers past 64 bits
        return json.dumps(body).encode()


def _wire_call(call: CallLike, index: int) -> dict[str, Any]:
    item = as_tool_call(call, index)
    arguments = item.arguments
    wire: dict[str, Any] = {
        "id": item.id,
        "name": item.name,
        "arguments": arguments if isinstance(arguments, str) else dict(arguments),
    }
    if item.error is not None:
        wire["error"] = item.error
    return wire


class _Cookies(httpx.Cookies):
    """httpx's cookie jar, minus the cost of looking for cookies in answers that set none.

    httpx hands every response to :mod:`http.cookiejar` through adapter objects,
    which costs more CPU than parsing the response (bench/daemon_bench.py);
    the daemon sets no cookies, but a proxy in front of it may, and those are kept.
    """

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers:
            super().extract_cookies(response)


class _AsyncClient(httpx.AsyncClient):
    """``httpx.AsyncClient`` with :class:`_Cookies` as its jar."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._jar = _Cookies(options.get("cookies"))

    @property
    def cookies(self) -> httpx.Cookies:
        return self._jar

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._jar = _Cookies(cookies)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds <= _MAX_RETRY_AFTER else None


class Client(AsyncResource):
    """The daemon's API as the :class:`Dispatcher`'s: ``call``, ``call_many``, ``session()``.

    ``url`` defaults to ``$AGENT_BACKEND_URL`` or ``http://127.0.0.1:8765``;
    ``token`` to ``$AGENT_BACKEND_TOKEN`` or the daemon's token file on this
    machine. One keep-alive connection pool serves every call; close it with
    ``async with`` or :meth:`aclose`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 900.0,
        max_connections: int = 100,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """
        Args:
            retries: attempts after the first, for connection errors, 429 and 503.
            backoff: seconds before the first retry; doubled each time (with jitter).
            read_timeout: seconds to wait for an answer; a call runs up to its tool's
                timeout, so keep this above the daemon's ``max_timeout``.
            max_connections: connections to the daemon open at once (more calls wait).
            transport: an httpx transport (tests); default: :class:`HTTP11Transport` for
                an ``http://`` URL, httpx's own for ``https://``.
        """
        if retries < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError("retries, backoff and max_backoff must not be negative")
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        token = token if token is not None else find_token()
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        if transport is None and self.url.startswith("http://"):
            transport = HTTP11Transport(max_connections=max_connections)
        self._http = _AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=limits,
            transport=transport,
        )
        # httpx's defaults that say nothing to the daemon (it never compresses, and
        # HTTP/1.1 keeps connections alive anyway); every header costs httpx CPU per request.
        for name in ("Accept", "Accept-Encoding", "Connection"):
            del self._http.headers[name]
        # Absolute URLs for the fixed routes: httpx re-parses a relative one on every request.
        self._urls = {
            path: httpx.URL(self.url + path)
            for path in (
                f"{API_PREFIX}/call",
                f"{API_PREFIX}/batch",
                f"{API_PREFIX}/sessions",
                f"{API_PREFIX}/tools",
                f"{API_PREFIX}/health/ready",
            )
        }
        self._closed = False

    def __repr__(self) -> str:
        return f"<Client {self.url}{' closed' if self._closed else ''}>"

    async def aclose(self) -> None:
        """Close the connection pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._http.aclose()

    def is_closed(self) -> bool:
        return self._closed

    # -- requests -----------------------------------------------------------------------------------

    def _delay(self, attempt: int) -> float:
        return backoff_delay(attempt + 1, first=self.backoff, ceiling=self.max_backoff)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        key: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise PoolClosed("the client is closed")
        headers: list[tuple[bytes, bytes]] = []  # raw: httpx normalizes str headers again
        content = None
        if body is not None:
            content = _dumps(body)
            headers.append((b"Content-Type", b"application/json"))
        if key is not None:
            headers.append((_IDEMPOTENCY_HEADER, key.encode()))
        attempt = 0
        while True:
            try:
                response = await self._http.request(
                    method,
                    self._urls.get(path, path),
                    content=content,
                    headers=headers,
                    params=params,
                )
            except httpx.TransportError as exc:
                if attempt >= self.retries or (key is None and method == "POST"):
                    raise BackendUnavailable(
                        f"cannot reach the daemon at {self.url}: {type(exc).__name__}: {exc}",
                        backend="daemon",
                        host=self.url,
                    ) from None
                delay = self._delay(attempt)
            else:
                if response.status_code < 400:
                    return response
                retry_after = _retry_after(response)
                retriable = response.status_code in _RETRY_STATUSES and (
                    response.status_code != 429 or retry_after is not None
                )
                if not retriable or attempt >= self.retries:
                    raise self._error(response)
                delay = retry_after if retry_after is not None else self._delay(attempt)
            attempt += 1
            await anyio.sleep(delay)

    def _error(self, response: httpx.Response) -> AgentBackendError:
        try:
            body = response.json()
        except ValueError:
            body = None
        return error_from_wire(body, status=response.status_code)

    # -- the Dispatcher's calls ---------------------------------------------------------------------

    async def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's limit, as in Dispatcher.call
        session: RemoteSession | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        """Run one call on the daemon; model-caused problems are results, the rest raise."""
        body = _wire_call(call, 0)
        if timeout is not None:
            body["timeout"] = timeout
        if session is not None:
            body["session"] = session._require_open()
        response = await self._request(
            "POST", f"{API_PREFIX}/call", body=body, key=idempotency_key or uuid.uuid4().hex
        )
        return ToolResult.model_validate_json(response.content)

    async def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, as in Dispatcher.call
        session: RemoteSession | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        """Run independent calls concurrently on the daemon; results in call order."""
        body: dict[str, Any] = {"calls": [_wire_call(c, i) for i, c in enumerate(calls)]}
        if timeout is not None:
            body["timeout"] = timeout
        if session is not None:
            body["session"] = session._require_open()
        response = await self._request(
            "POST", f"{API_PREFIX}/batch", body=body, key=idempotency_key or uuid.uuid4().hex
        )
        return BatchResponse.model_validate_json(response.content).results

    def session(self) -> RemoteSession:
        """A new session on the daemon: ``async with client.session() as session``."""
        return RemoteSession(self)

    async def tools(self, format: _Format = "openai") -> list[dict[str, Any]]:
        """The daemon's tool list, in the shape ``format``'s API expects."""
        response = await self._request("GET", f"{API_PREFIX}/tools", params={"format": format})
        return ToolsResponse.model_validate_json(response.content).tools

    async def ready(self) -> Readiness:
        """The daemon's readiness (not an error when it is not ready)."""
        try:
            response = await self._http.get(self._urls[f"{API_PREFIX}/health/ready"])
        except httpx.TransportError as exc:
            raise BackendUnavailable(
                f"cannot reach the daemon at {self.url}: {exc}", backend="daemon", host=self.url
            ) from None
        if response.status_code in (200, 503):
            return Readiness.model_validate_json(response.content)
        raise self._error(response)


class RemoteSession(AsyncResource):
    """A session on the daemon; the same calls as :class:`~agent_backend.dispatch.Session`."""

    id: str
    """The daemon's id for the session (set on entry)."""
    host: str
    """The host its calls run on (set on entry)."""
    workspace: str
    """Its workspace on that host (set on entry)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._state: Literal["new", "open", "closed"] = "new"

    def __repr__(self) -> str:
        where = f" {self.id} {self.host}:{self.workspace}" if self._state != "new" else ""
        return f"<RemoteSession{where} {self._state}>"

    def is_open(self) -> bool:
        return self._state == "open"

    def is_closed(self) -> bool:
        return self._state == "closed"

    def _require_open(self) -> str:
        if self._state != "open":
            raise PoolClosed(f"the session is {self._state}: use `async with client.session()`")
        return self.id

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def open(self) -> None:
        if self._state != "new":
            raise PoolClosed(f"a session can be opened once (it is {self._state})")
        response = await self.client._request(
            "POST", f"{API_PREFIX}/sessions", body={}, key=uuid.uuid4().hex
        )
        info = SessionInfo.model_validate_json(response.content)
        self.id, self.host, self.workspace = info.id, info.host, info.workspace
        self._state = "open"

    async def aclose(self) -> None:
        """Close the session on the daemon; idempotent (a session already gone is fine)."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(NotFound, PoolClosed):
                await self.client._request("DELETE", f"{API_PREFIX}/sessions/{self.id}")

    async def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - as in Session.call
        idempotency_key: str | None = None,
    ) -> ToolResult:
        return await self.client.call(
            call, timeout=timeout, session=self, idempotency_key=idempotency_key
        )

    async def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - as in Session.call_many
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        return await self.client.call_many(
            calls, timeout=timeout, session=self, idempotency_key=idempotency_key
        )


class SyncClient(SyncResource):
    """:class:`Client` for code without an event loop; its loop runs on a private thread.

    ``with SyncClient(url) as client: client.call(("exec", {"command": "ls"}))``.
    """

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self.client = Client(url, **options)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False

    def __repr__(self) -> str:
        return f"<SyncClient {self.client.url}{' closed' if self._closed else ''}>"

    def close(self) -> None:
        """Close the connections and stop the private thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self.client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,
        session: SyncSession | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        remote = session.remote if session is not None else None
        return self._portal.call(
            lambda: self.client.call(
                call, timeout=timeout, session=remote, idempotency_key=idempotency_key
            )
        )

    def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,
        session: SyncSession | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        remote = session.remote if session is not None else None
        items = list(calls)
        return self._portal.call(
            lambda: self.client.call_many(
                items, timeout=timeout, session=remote, idempotency_key=idempotency_key
            )
        )

    def session(self) -> SyncSession:
        """``with client.session() as session: session.call(...)``."""
        return SyncSession(self)

    def tools(self, format: _Format = "openai") -> list[dict[str, Any]]:
        return self._portal.call(self.client.tools, format)

    def ready(self) -> Readiness:
        return self._portal.call(self.client.ready)


class SyncSession(SyncResource):
    """A :class:`RemoteSession` for :class:`SyncClient`."""

    def __init__(self, owner: SyncClient) -> None:
        self.owner = owner
        self.remote = RemoteSession(owner.client)

    def __repr__(self) -> str:
        return repr(self.remote).replace("RemoteSession", "SyncSession", 1)

    @property
    def id(self) -> str:
        return self.remote.id

    def __enter__(self) -> Self:
        self.open()
        return self

    def open(self) -> None:
        self.owner._portal.call(self.remote.open)

    def close(self) -> None:
        self.owner._portal.call(self.remote.aclose)

    def call(
        self, call: CallLike, *, timeout: float | None = None, idempotency_key: str | None = None
    ) -> ToolResult:
        return self.owner.call(call, timeout=timeout, session=self, idempotency_key=idempotency_key)

    def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        return self.owner.call_many(
            calls, timeout=timeout, session=self, idempotency_key=idempotency_key
        )
