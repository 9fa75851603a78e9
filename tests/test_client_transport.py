"""agent_backend.Client's connections, on a real daemon: reuse, cut connections, lost answers, timeouts, cookies.

Faults are made by proxies on 127.0.0.1 between the client and the daemon:
:class:`~support.tcp_proxy.TCPProxy` resets connections at will, :class:`LosingProxy`
forwards each request but throws away the daemon's next answer and resets
the connection, as when a connection dies after the daemon ran the call.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import Callable

import aiohttp.web
import anyio
import anyio.abc
import pytest
from support.daemon_fixtures import TALLY, Daemon, daemon_fixture  # noqa: F401
from support.tcp_proxy import Listener, TCPProxy, reset_on_close

from agent_backend.client import Client
from agent_backend.errors import BackendUnavailable, PoolClosed

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
