"""agent_backend.Client's connections, on a real daemon: reuse, cut connections, lost answers, timeouts, cookies.

Faults are made by proxies on 127.0.0.1 between the client and the daemon:
:class:`~support.tcp_proxy.TCPProxy` resets connections at will, :class:`LosingProxy`
forwards each request but throws away the daemon's next answer and resets
the connection, as when a connection dies after the daemon ran the call.
Refusals (429, 503, with or without ``Retry-After``) come from :class:`Busy`, a
real aiohttp server on 127.0.0.1 that answers as a daemon at its limit would, a
set number of times.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable

import aiohttp.web
import anyio
import anyio.abc
import anyio.to_thread
import pytest
from support.daemon_fixtures import TALLY, Daemon, daemon_fixture  # noqa: F401
from support.tcp_proxy import Listener, TCPProxy, reset_on_close

from agent_backend.client import Client, SyncClient
from agent_backend.errors import (
    BackendUnavailable,
    DaemonError,
    PoolClosed,
    RateLimited,
    ServiceUnavailable,
    TooManySessions,
)
from agent_backend.wire import (
    IDEMPOTENCY_HEADER,
    BatchResponse,
    ErrorBody,
    SessionInfo,
    ToolResult,
    error_to_wire,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

HOST = "127.0.0.1"
_KEY = re.compile(rb"(?im)^idempotency-key: *(\S+)\r$")
_REQUEST_LINE = re.compile(rb"(GET|POST|DELETE|PUT|HEAD) (/\S*) HTTP/1\.1\r\n")


class LosingProxy(Listener):
    """Forwards to the daemon; the next ``lose`` answers are dropped and their connection reset."""

    def __init__(self, target_port: int, *, lose: int = 1) -> None:
        super().__init__()
        self.target_port = target_port
        self.lose = lose
        self.accepted = 0
        self.sent: list[bytearray] = []
        """The bytes the client sent, per connection in order of arrival."""

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of each request that reached the daemon."""
        found = (_REQUEST_LINE.findall(bytes(sent)) for sent in self.sent)
        return [(m.decode(), p.decode()) for lines in found for m, p in lines]

    @property
    def keys(self) -> list[str]:
        return [k.decode() for sent in self.sent for k in _KEY.findall(bytes(sent))]

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.accepted += 1
        self.sent.append(bytearray())
        try:
            upstream = await anyio.connect_tcp(HOST, self.target_port)
        except OSError:
            reset_on_close(client)
            await client.aclose()
            return
        async with client, upstream, anyio.create_task_group() as pipes:
            pipes.start_soon(self._requests, client, upstream, pipes.cancel_scope)
            pipes.start_soon(self._answers, upstream, client, pipes.cancel_scope)

    async def _requests(
        self,
        client: anyio.abc.SocketStream,
        upstream: anyio.abc.SocketStream,
        scope: anyio.CancelScope,
    ) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            sent = self.sent[-1]
            async for chunk in client:
                sent += chunk
                await upstream.send(chunk)
        scope.cancel()

    async def _answers(
        self,
        upstream: anyio.abc.SocketStream,
        client: anyio.abc.SocketStream,
        scope: anyio.CancelScope,
    ) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for chunk in upstream:
                if self.lose > 0:
                    self.lose -= 1
                    reset_on_close(client)
                    break
                await client.send(chunk)
        scope.cancel()


async def _until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Wait, bounded, for a state of the daemon's thread or the proxy: no event to await."""
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)


def _port(daemon: Daemon) -> int:
    return int(daemon.url.rsplit(":", 1)[1])


async def test_calls_share_one_keep_alive_connection(daemon: Daemon) -> None:
    async with TCPProxy(_port(daemon)) as proxy:
        async with Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token) as client:
            for i in range(10):
                assert (await client.call(("echo", {"value": str(i)}))).output == str(i)
            async with client.session() as session:
                await session.call(("echo", {"value": "in a session"}))
            assert len(await client.call_many([("echo", {"value": "x"})] * 3)) == 3
            assert len(await client.tools()) > 0
            assert proxy.connections == 1
        assert proxy.accepted == 1


async def test_connections_cut_between_calls_are_replaced(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with TCPProxy(_port(daemon)) as proxy:
        async with Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token) as client:
            await client.call(("tally", {"key": key}))
            await proxy.cut()
            await _until(lambda: proxy.connections == 0)
            result = await client.call(("tally", {"key": key}))
        assert proxy.accepted == 2
    assert result.output == "2"
    assert TALLY[key] == 2


async def test_a_call_whose_connection_is_cut_runs_once(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with TCPProxy(_port(daemon)) as proxy:
        async with (
            Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token, backoff=0.01) as client,
            anyio.create_task_group() as group,
        ):

            async def cut_once_running() -> None:
                await _until(lambda: TALLY[key] == 1)  # it runs on the daemon's thread
                await proxy.cut()  # the answer is lost mid-call

            group.start_soon(cut_once_running)
            result = await client.call(("tally", {"key": key, "delay": 0.6}))
        assert proxy.accepted == 2, "retried on a new connection, with the same key"
    assert result.output == "1"
    assert TALLY[key] == 1


async def test_a_lost_answer_is_retried_with_the_same_key_so_the_tool_runs_once(
    daemon: Daemon,
) -> None:
    key = uuid.uuid4().hex
    async with (
        LosingProxy(_port(daemon)) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token, backoff=0.01) as client,
    ):
        result = await client.call(("tally", {"key": key}))
    assert proxy.requests == [("POST", "/v1/call")] * 2
    assert len(proxy.keys) == 2
    assert proxy.keys[0] == proxy.keys[1]
    assert proxy.accepted == 2
    assert result.output == "1"
    assert TALLY[key] == 1


async def test_a_post_without_a_key_is_never_sent_twice(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with (
        LosingProxy(_port(daemon)) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token, backoff=0.01) as client,
    ):
        with pytest.raises(BackendUnavailable, match="cannot reach the daemon"):
            await client._request(
                "POST", "/v1/call", body={"name": "tally", "arguments": {"key": key}}
            )
    assert proxy.requests == [("POST", "/v1/call")]
    assert proxy.keys == []
    assert TALLY[key] == 1


async def test_idempotent_requests_are_sent_again(daemon: Daemon) -> None:
    async with (
        LosingProxy(_port(daemon), lose=2) as proxy,
        Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token, backoff=0.01) as client,
    ):
        tools = await client.tools()
        async with client.session() as session:
            sid = session.id
    assert {t["function"]["name"] for t in tools} >= {"echo", "tally"}
    assert proxy.requests[:3] == [("GET", "/v1/tools?format=openai")] * 3
    assert proxy.requests[3:] == [("POST", "/v1/sessions"), ("DELETE", f"/v1/sessions/{sid}")]


async def test_retries_give_up_as_backend_unavailable() -> None:
    async with (
        LosingProxy(9, lose=0) as proxy,  # nothing listens on port 9
        Client(f"http://127.0.0.1:{proxy.port}", token="t" * 20, retries=2, backoff=0.01) as client,
    ):
        with anyio.fail_after(10), pytest.raises(BackendUnavailable) as unavailable:
            await client.call(("echo", {"value": "x"}))
    assert unavailable.value.host == f"http://127.0.0.1:{proxy.port}"
    assert proxy.accepted == 3, "the first attempt and two retries"


async def test_an_answer_slower_than_the_read_timeout_is_backend_unavailable(
    daemon: Daemon,
) -> None:
    async with Client(daemon.url, token=daemon.token, read_timeout=0.3, retries=0) as client:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="Timeout"):
            await client.call(("pause", {"seconds": 3}))
        assert time.monotonic() - started < 2
        assert (await client.call(("echo", {"value": "after"}))).output == "after"


async def test_a_closed_client_refuses_calls(daemon: Daemon) -> None:
    client = Client(daemon.url, token=daemon.token)
    await client.aclose()  # never used: nothing was opened
    await client.aclose()
    with pytest.raises(PoolClosed, match="closed"):
        await client.call(("echo", {"value": "x"}))


async def test_cookies_a_proxy_sets_are_kept() -> None:
    seen: list[str | None] = []

    async def tools(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.cookies.get("lb"))
        response = aiohttp.web.json_response({"format": "openai", "tools": []})
        response.set_cookie("lb", "node-2", path="/")
        return response

    app = aiohttp.web.Application()
    app.router.add_get("/v1/tools", tools)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, HOST, 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        async with Client(f"http://{HOST}:{port}", token="t" * 20) as client:
            assert await client.tools() == []
            assert await client.tools() == []
    finally:
        await runner.cleanup()
    assert seen == [None, "node-2"]


# -- refusals: a daemon at its limit ------------------------------------------------------------------


_JSON = "application/json"
_SERVED = ToolResult(call_id="call_0", tool="echo", ok=True, output="served")
_REFUSALS: list[DaemonError] = [
    RateLimited("too many requests in flight for this token", retry_after=1, limit=128),
    ServiceUnavailable("the daemon is busy"),
]
# Many more refusals than any test's client will wait through.
_ALWAYS = 1_000


class Busy:
    """Refuses the first ``refusals`` requests as ``error`` (its status, its wire body and
    ``Retry-After: retry_after`` when given), then answers as the daemon does."""

    def __init__(self, error: DaemonError, *, refusals: int, retry_after: str | None) -> None:
        self.status = error.status
        self.body = ErrorBody(error=error_to_wire(error)).model_dump_json().encode()
        self.refusals = refusals
        self.headers = {"Retry-After": retry_after} if retry_after is not None else {}
        self.seen: list[tuple[str, str]] = []
        """(method, path) of every request, refused or not."""
        self.keys: list[str | None] = []

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        await request.read()
        self.seen.append((request.method, request.path))
        self.keys.append(request.headers.get(IDEMPOTENCY_HEADER))
        if len(self.seen) <= self.refusals:
            return aiohttp.web.Response(
                status=self.status, body=self.body, headers=self.headers, content_type=_JSON
            )
        if request.method == "DELETE":
            return aiohttp.web.Response(status=204)
        answer: SessionInfo | BatchResponse | ToolResult
        if request.path == "/v1/sessions":
            answer = SessionInfo(id="s1", host="local", workspace="/w/s1")
        elif request.path == "/v1/batch":
            answer = BatchResponse(results=[_SERVED])
        else:
            answer = _SERVED
        return aiohttp.web.Response(body=answer.model_dump_json().encode(), content_type=_JSON)

    @property
    def attempts(self) -> int:
        return len(self.seen)


@contextlib.asynccontextmanager
async def serve(busy: Busy) -> AsyncIterator[str]:
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", busy.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, HOST, 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://{HOST}:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("refusal", _REFUSALS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("tool_timeout", [None, 5.0])
async def test_a_call_refused_more_often_than_its_retries_waits_for_a_slot(
    refusal: DaemonError, tool_timeout: float | None
) -> None:
    busy = Busy(refusal, refusals=5, retry_after="0.05")
    async with serve(busy) as url, Client(url, token="t" * 20, retries=1) as client:
        with anyio.fail_after(30):  # five waits of at most 0.075 s
            result = await client.call(("echo", {"value": "x"}), timeout=tool_timeout)
            results = await client.call_many([("echo", {"value": "x"})], timeout=tool_timeout)
    assert result.output == "served"
    assert [r.output for r in results] == ["served"]
    assert busy.seen == [("POST", "/v1/call")] * 6 + [("POST", "/v1/batch")]
    assert len(set(busy.keys[:6])) == 1, "every retry carries the call's idempotency key"


async def test_a_call_whose_deadline_is_shorter_than_the_retry_after_is_refused_at_once() -> None:
    refusal = RateLimited("too many requests in flight", retry_after=30, limit=1)
    busy = Busy(refusal, refusals=_ALWAYS, retry_after="30")
    async with serve(busy) as url:
        async with Client(url, token="t" * 20) as client:
            # A wait of 30 s would overrun the 20 s bound below, with a TimeoutError.
            with anyio.fail_after(20), pytest.raises(RateLimited) as limited:
                await client.call(("echo", {"value": "x"}), timeout=1.0)  # waits up to 6 s
        assert busy.attempts == 1
        assert limited.value.retry_after == 30
        assert limited.value.status == 429
        async with Client(url, token="t" * 20, busy_timeout=10.0) as client:
            with anyio.fail_after(20), pytest.raises(RateLimited):
                await client.call(("echo", {"value": "x"}))
        assert busy.attempts == 2


@pytest.mark.parametrize("refusal", _REFUSALS, ids=lambda e: type(e).__name__)
async def test_refusals_are_retried_until_the_deadline_not_a_number_of_times(
    refusal: DaemonError,
) -> None:
    busy = Busy(refusal, refusals=_ALWAYS, retry_after="0.05")
    async with serve(busy) as url, Client(url, token="t" * 20, retries=0, busy_timeout=0.5) as c:
        with anyio.fail_after(20), pytest.raises(type(refusal)):
            await c.call(("echo", {"value": "x"}))
    # Each wait is at least the 0.05 s asked for, and all of them end within the 0.5 s.
    assert 2 <= busy.attempts <= 11, busy.attempts


async def test_a_503_without_retry_after_stops_after_the_retries() -> None:
    busy = Busy(ServiceUnavailable("shutting down"), refusals=_ALWAYS, retry_after=None)
    async with (
        serve(busy) as url,
        Client(url, token="t" * 20, retries=2, backoff=0.01) as client,
    ):
        with anyio.fail_after(20), pytest.raises(ServiceUnavailable):
            await client.call(("echo", {"value": "x"}))
    assert busy.attempts == 3, "the first attempt and two retries"


@pytest.mark.parametrize("status", [502, 504])
async def test_a_502_or_504_is_never_sent_again(status: int) -> None:
    busy = Busy(DaemonError("gateway", status=status), refusals=_ALWAYS, retry_after="0")
    async with serve(busy) as url, Client(url, token="t" * 20, backoff=0.01) as client:
        with pytest.raises(DaemonError) as failed:
            await client.call(("echo", {"value": "x"}))
    assert failed.value.status == status
    assert busy.attempts == 1


async def test_a_post_without_a_key_is_not_sent_again_after_a_refusal() -> None:
    busy = Busy(_REFUSALS[0], refusals=_ALWAYS, retry_after="0")
    async with serve(busy) as url, Client(url, token="t" * 20) as client:
        with pytest.raises(RateLimited):
            await client._request("POST", "/v1/call", body={"name": "echo", "arguments": {}})
    assert busy.attempts == 1
    assert busy.keys == [None]


async def test_opening_a_session_waits_for_a_session_slot() -> None:
    full = TooManySessions("this token has 64 sessions open", limit=64)
    busy = Busy(full, refusals=3, retry_after="0.05")
    async with serve(busy) as url, Client(url, token="t" * 20, retries=0) as client:
        with anyio.fail_after(30):
            async with client.session() as session:
                assert session.id == "s1"
    assert busy.seen == [("POST", "/v1/sessions")] * 4 + [("DELETE", "/v1/sessions/s1")]


async def test_too_many_sessions_without_retry_after_is_raised_at_once() -> None:
    busy = Busy(TooManySessions("full", limit=1), refusals=_ALWAYS, retry_after=None)
    async with serve(busy) as url, Client(url, token="t" * 20, backoff=0.01) as client:
        with pytest.raises(TooManySessions):
            await client.session().open()
    assert busy.attempts == 1


async def test_the_sync_client_waits_for_a_slot_too() -> None:
    busy = Busy(_REFUSALS[0], refusals=4, retry_after="0.05")

    def run(url: str) -> tuple[ToolResult, str]:
        with SyncClient(url, token="t" * 20, retries=0) as client:
            result = client.call(("echo", {"value": "x"}), timeout=5.0)
            with client.session() as session:
                return result, session.id

    async with serve(busy) as url:
        with anyio.fail_after(30):
            result, session_id = await anyio.to_thread.run_sync(run, url)
    assert result.output == "served"
    assert session_id == "s1"
    assert busy.seen[:5] == [("POST", "/v1/call")] * 5
    assert busy.seen[5:] == [("POST", "/v1/sessions"), ("DELETE", "/v1/sessions/s1")]
