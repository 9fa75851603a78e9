"""The daemon's API over HTTP: :class:`Client` and its :class:`RemoteSession`.

Every call carries an ``Idempotency-Key``; a retry (after a connection error,
a 429 with ``Retry-After``, or a 503) sends the same key, so the daemon runs
the call once and hands the retry the first result. A refusal that carries
``Retry-After`` (the daemon at its limit: 429; busy or restarting: 503) is
retried for as long as the call may wait, not a number of times: the daemon
said it did not run the call, and a heavy user's calls should get a slot
rather than fail while others hold them. Failures come back as
the same exception classes as in-process (:func:`agent_backend.wire.error_from_wire`),
and an unreachable daemon as :class:`~agent_backend.errors.BackendUnavailable`:
aiohttp's exceptions are translated here and never reach the caller.

The HTTP client is one :class:`aiohttp.ClientSession` per :class:`Client`
(keep-alive pool, bounded connections), created on first use on the event
loop that uses it; asyncio only, as aiohttp is. Idle connections are kept
for less than uvicorn's 5 s keep-alive, so a request rarely lands on one the
daemon is closing; when it does, the request is sent again only when that
is safe: an idempotent method, or a POST with the key the daemon honours.
How long to wait between attempts is computed in :mod:`agent_backend.retry`.

This module must never retry without the idempotency key, never retry a
5xx that may have run the call (502, 504), and never import a class a
server names.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, Self

import anyio
import orjson

from agent_backend.errors import AgentBackendError, BackendUnavailable, NotFound, PoolClosed
from agent_backend.lifecycle import AsyncResource
from agent_backend.retry import (
    RETRY_AFTER_STATUSES,
    parse_retry_after,
    retry_after_delay,
    retry_delay,
)
from agent_backend.tokens import find_token
from agent_backend.wire import (
    API_PREFIX,
    IDEMPOTENCY_HEADER,
    BatchResponse,
    ForkResponse,
    Readiness,
    SessionInfo,
    ToolResult,
    ToolsResponse,
    error_from_wire,
)

if TYPE_CHECKING:
    import aiohttp
    from yarl import URL

    from agent_backend.dispatch import CallLike

__all__ = ["DEFAULT_URL", "URL_ENV", "Client", "RemoteSession", "ToolsFormat"]

#: Where ``agent-backend serve`` listens by default.
DEFAULT_URL: Final = "http://127.0.0.1:8765"
URL_ENV: Final = "AGENT_BACKEND_URL"

# RFC 9110 9.2.2: requests a client may send again when the connection failed.
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# Below uvicorn's default keep-alive (5 s): an idle connection is dropped here first.
_KEEPALIVE = 4.0
# How late past its timeout the daemon may answer a call: the Dispatcher's backstop_grace (5 s).
_REPLY_MARGIN: Final = 5.0
_JSON = "application/json"
_ROUTES = tuple(
    f"{API_PREFIX}/{route}" for route in ("call", "batch", "sessions", "tools", "health/ready")
)
#: The shapes :meth:`Client.tools` can give the tool list in (one per provider API).
ToolsFormat = Literal["openai", "anthropic", "mcp"]


def _dumps(body: object) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # integers past 64 bits
        return json.dumps(body).encode()


def _resendable(method: str, path: str, key: str | None) -> bool:
    """Whether a request may be sent again: an idempotent method, or a POST with the key."""
    return method in _IDEMPOTENT_METHODS or (
        key is not None and method == "POST" and path.startswith(API_PREFIX + "/")
    )


def _wire_call(call: CallLike, index: int) -> dict[str, Any]:
    if type(call) is tuple and len(call) == 2 and type(call[0]) is str and type(call[1]) is dict:
        return {"id": f"call_{index}", "name": call[0], "arguments": call[1]}  # the common case
    # Any other shape is read the one way dispatch reads it. Imported here, not with the
    # module, so that importing the client does not load dispatch (nor the schema layer).
    from agent_backend.dispatch import as_tool_call

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


class Client(AsyncResource):
    """The daemon's API as the :class:`Dispatcher`'s: ``call``, ``call_many``, ``session()``.

    ``url`` defaults to ``$AGENT_BACKEND_URL`` or ``http://127.0.0.1:8765``;
    ``token`` to ``$AGENT_BACKEND_TOKEN`` or the daemon's token file on this
    machine. One keep-alive connection pool serves every call; close it with
    ``async with`` or :meth:`aclose`.

    A request the daemon refuses with ``Retry-After`` (too many in flight for the
    token, too many sessions, busy) is sent again after that wait, with jitter,
    until ``busy_timeout`` (or a call's ``timeout`` plus 5 s) has passed, however
    many times that takes; connection errors and a 503 without ``Retry-After``
    are retried ``retries`` times with backoff. Every retry reuses the call's
    idempotency key, and a request without one is never sent twice.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        busy_timeout: float = 60.0,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 900.0,
        max_connections: int = 100,
    ) -> None:
        """
        Args:
            retries: attempts after the first, for connection errors and for 503 without
                ``Retry-After``.
            backoff: seconds before the first of those retries; doubled each time (with jitter).
            max_backoff: the longest of those waits.
            busy_timeout: how long a request refused with ``Retry-After`` keeps being sent
                again, in seconds from its first such refusal (429: the token's limit of
                requests in flight or of open sessions; 503: the daemon busy or restarting).
                Each retry waits what the daemon asked times a random factor in [1, 1.5),
                cut to end at this bound; a refusal that asks for a wait ending past it is
                raised at once (``RateLimited``, ``TooManySessions``, ``ServiceUnavailable``).
                ``call`` and ``call_many`` given ``timeout`` wait that timeout plus 5 s
                instead. 0: never wait.
            connect_timeout: seconds to open a TCP connection to the daemon.
            read_timeout: seconds one attempt may take, from the wait for a free connection
                to the end of the answer; a call runs up to its tool's timeout, so keep this
                above the daemon's ``max_timeout``.
            max_connections: connections to the daemon open at once (more calls wait).
        """
        if retries < 0 or backoff < 0 or max_backoff < 0 or busy_timeout < 0:
            raise ValueError("retries, backoff, max_backoff and busy_timeout must not be negative")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        token = token if token is not None else find_token()
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.busy_timeout = busy_timeout
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeouts = (connect_timeout, read_timeout)
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        self._lost: tuple[type[BaseException], ...] = ()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Client {self.url}{' closed' if self._closed else ''}>"

    async def aclose(self) -> None:
        """Close the connection pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._http is not None:
            with anyio.CancelScope(shield=True):
                await self._http.close()

    def is_closed(self) -> bool:
        return self._closed

    # -- requests -----------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        """The HTTP session, created on first use: aiohttp binds it to the running loop.

        aiohttp is imported here, not with the module: it takes longer to import than
        the rest of the client, and code that only imports ``agent_backend`` never pays it.
        """
        if self._closed:
            raise PoolClosed("the client is closed")
        if self._http is None:
            import aiohttp
            from yarl import URL

            # Parsed once: building a URL costs more than most of a request's other steps.
            self._urls = {path: URL(self.url + path) for path in _ROUTES}
            connect, read = self._timeouts
            self._lost = (aiohttp.ClientError, TimeoutError)
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                # One timer per request (total), as aiohttp's default: a per-read timer
                # is rescheduled on every chunk received, which costs CPU on each call.
                timeout=aiohttp.ClientTimeout(total=read, sock_connect=connect),
                # Keep cookies a proxy in front of the daemon sets, also when it is named by IP.
                cookie_jar=aiohttp.CookieJar(unsafe=True),
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, keepalive_timeout=_KEEPALIVE
                ),
            )
        return self._http

    def _unreachable(self, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(
            f"cannot reach the daemon at {self.url}: {type(exc).__name__}: {exc}",
            backend="daemon",
            host=self.url,
        )

    def _url(self, path: str, params: Mapping[str, str] | None) -> URL:
        url = self._urls.get(path)
        if url is None:
            from yarl import URL

            url = URL(self.url + path)
        return url.with_query(params) if params else url

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        key: str | None = None,
        params: Mapping[str, str] | None = None,
        answers: frozenset[int] = frozenset(),
        retries: int | None = None,
        wait: float | None = None,
    ) -> tuple[int, bytes]:
        """Status and body of the answer, after retries; a refusal raises its error class.

        Statuses in ``answers`` are returned, not raised. A connection error, or a 503
        without ``Retry-After``, is retried ``retries`` times (default: the client's) with
        backoff; a 429 or 503 with ``Retry-After`` for ``wait`` seconds from the first such
        refusal (default: ``busy_timeout``). One function from the call to the socket: each
        coroutine level costs on every resumption of a request, and nothing on the way to
        a success is spent on retries (no clock read, no count looked up).
        """
        http = self._http if self._http is not None and not self._closed else self._session()
        url = self._url(path, params)
        headers: dict[str, str] | None = None
        content = None
        if body is not None:
            content = _dumps(body)
            headers = {"Content-Type": _JSON}
            if key is not None:
                headers[IDEMPOTENCY_HEADER] = key
        elif key is not None:
            headers = {IDEMPOTENCY_HEADER: key}
        counted = 0  # retries after connection errors and 503s without Retry-After
        deadline: float | None = None  # for refusals with Retry-After: set at the first
        while True:
            retry_after = None
            try:
                async with http.request(method, url, data=content, headers=headers) as response:
                    answer = await response.read()
                    status = response.status
                    if status >= 400:
                        retry_after = response.headers.get("Retry-After")
            except self._lost as exc:  # aiohttp's errors end here
                failure: AgentBackendError = self._unreachable(exc)
                asked = None
            else:
                if status < 400 or status in answers:
                    return status, answer
                failure = self._error(status, answer)
                asked = parse_retry_after(retry_after) if status in RETRY_AFTER_STATUSES else None
                # Without Retry-After only a 503 is worth a retry: a 429 (too many sessions,
                # from an older daemon) will not clear by waiting, and a 502 or 504 may have
                # run the call.
                if asked is None and status != 503:
                    raise failure
            # A request that may have reached the daemon is sent again only when safe.
            if not _resendable(method, path, key):
                raise failure
            if asked is None:
                if counted >= (self.retries if retries is None else retries):
                    raise failure
                counted += 1
                delay = retry_delay(counted, first=self.backoff, ceiling=self.max_backoff)
            else:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (self.busy_timeout if wait is None else wait)
                # Raised now rather than after a sleep that could only end in another refusal.
                if now + asked >= deadline:
                    raise failure
                delay = retry_after_delay(asked, ceiling=deadline - now)
            await anyio.sleep(delay)

    def _error(self, status: int, answer: bytes) -> AgentBackendError:
        try:
            body = json.loads(answer)
        except ValueError:
            body = None
        return error_from_wire(body, status=status)

    # -- the Dispatcher's calls ---------------------------------------------------------------------

    async def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's limit, as in Dispatcher.call
        session: RemoteSession | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        """Run one call on the daemon; model-caused problems are results, the rest raise.

        ``timeout`` is the tool's limit on the daemon; refused while the daemon is at
        its limit, the call is retried until ``timeout`` plus 5 s from the first refusal
        (without ``timeout``: the client's ``busy_timeout``), then raises ``RateLimited``.
        """
        body = _wire_call(call, 0)
        if timeout is not None:
            body["timeout"] = timeout
        if session is not None:
            body["session"] = session._require_open()
        _, answer = await self._request(
            "POST",
            f"{API_PREFIX}/call",
            body=body,
            key=idempotency_key or uuid.uuid4().hex,
            wait=None if timeout is None else timeout + _REPLY_MARGIN,
        )
        return ToolResult.model_validate_json(answer)

    async def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, as in Dispatcher.call
        session: RemoteSession | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        """Run independent calls concurrently on the daemon; results in call order.

        Refusals are retried as for :meth:`call`, the batch as one request.
        """
        body: dict[str, Any] = {"calls": [_wire_call(c, i) for i, c in enumerate(calls)]}
        if timeout is not None:
            body["timeout"] = timeout
        if session is not None:
            body["session"] = session._require_open()
        _, answer = await self._request(
            "POST",
            f"{API_PREFIX}/batch",
            body=body,
            key=idempotency_key or uuid.uuid4().hex,
            wait=None if timeout is None else timeout + _REPLY_MARGIN,
        )
        return BatchResponse.model_validate_json(answer).results

    def session(self) -> RemoteSession:
        """A new session on the daemon: ``async with client.session() as session``."""
        return RemoteSession(self)

    async def tools(self, format: ToolsFormat = "openai") -> list[dict[str, Any]]:
        """The daemon's tool list, in the shape ``format``'s API expects."""
        _, answer = await self._request("GET", f"{API_PREFIX}/tools", params={"format": format})
        return ToolsResponse.model_validate_json(answer).tools

    async def ready(self) -> Readiness:
        """The daemon's readiness (not an error when it is not ready)."""
        _, answer = await self._request(
            "GET", f"{API_PREFIX}/health/ready", answers=frozenset({503}), retries=0, wait=0.0
        )
        return Readiness.model_validate_json(answer)


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
        """Open the session; one open already (a fork) is entered as it is, to be closed on exit."""
        if self._state != "open":
            await self.open()
        return self

    async def open(self) -> None:
        if self._state != "new":
            raise PoolClosed(f"a session can be opened once (it is {self._state})")
        _, answer = await self.client._request(
            "POST", f"{API_PREFIX}/sessions", body={}, key=uuid.uuid4().hex
        )
        info = SessionInfo.model_validate_json(answer)
        self.id, self.host, self.workspace = info.id, info.host, info.workspace
        self._state = "open"

    async def fork(self, n: int) -> list[RemoteSession]:
        """``n`` new open sessions whose workspaces start as copies of this one's (between
        calls; :meth:`agent_backend.dispatch.Session.fork`); close each."""
        session_id = self._require_open()
        _, answer = await self.client._request(
            "POST",
            f"{API_PREFIX}/sessions/{session_id}/fork",
            body={"n": n},
            key=uuid.uuid4().hex,
        )
        forks = []
        for info in ForkResponse.model_validate_json(answer).sessions:
            fork = RemoteSession(self.client)
            fork.id, fork.host, fork.workspace = info.id, info.host, info.workspace
            fork._state = "open"
            forks.append(fork)
        return forks

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
