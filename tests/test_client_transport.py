"""agent_backend.Client over its HTTP/1.1 transport, on a real daemon: reuse, cut connections, cookies."""

from __future__ import annotations

import uuid

import anyio
import httpx
import pytest
from daemon_fixtures import TALLY, Daemon, daemon_fixture  # noqa: F401
from tcp_proxy import TCPProxy

from agent_backend.client import Client
from agent_backend.http11 import HTTP11Transport

pytestmark = pytest.mark.anyio


async def test_http_urls_use_the_lean_transport_and_https_httpx_own() -> None:
    async with Client("http://127.0.0.1:1", token="t" * 20) as plain:
        assert isinstance(plain._http._transport, HTTP11Transport)
    async with Client("https://127.0.0.1:1", token="t" * 20) as secure:
        assert isinstance(secure._http._transport, httpx.AsyncHTTPTransport)


async def test_calls_share_one_keep_alive_connection(daemon: Daemon) -> None:
    async with TCPProxy(int(daemon.url.rsplit(":", 1)[1])) as proxy:
        async with Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token) as client:
            for i in range(10):
                assert (await client.call(("echo", {"value": str(i)}))).output == str(i)
            async with client.session() as session:
                await session.call(("echo", {"value": "in a session"}))
            assert len(await client.call_many([("echo", {"value": "x"})] * 3)) == 3
            transport = client._http._transport
            assert isinstance(transport, HTTP11Transport)
            assert transport.statistics().connections_open == 1
        assert proxy.accepted == 1


async def test_connections_cut_between_calls_are_replaced(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with TCPProxy(int(daemon.url.rsplit(":", 1)[1])) as proxy:
        async with Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token) as client:
            await client.call(("tally", {"key": key}))
            await proxy.cut()
            await anyio.sleep(0.05)
            result = await client.call(("tally", {"key": key}))
        assert proxy.accepted == 2
    assert result.output == "2"
    assert TALLY[key] == 2


async def test_a_call_whose_connection_is_cut_runs_once(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with TCPProxy(int(daemon.url.rsplit(":", 1)[1])) as proxy:
        async with (
            Client(f"http://127.0.0.1:{proxy.port}", token=daemon.token, backoff=0.01) as client,
            anyio.create_task_group() as group,
        ):

            async def cut_soon() -> None:
                await anyio.sleep(0.3)
                await proxy.cut()  # the answer is lost mid-call

            group.start_soon(cut_soon)
            result = await client.call(("tally", {"key": key, "delay": 0.6}))
        assert proxy.accepted == 2, "retried on a new connection, with the same key"
    assert result.output == "1"
    assert TALLY[key] == 1


async def test_cookies_a_proxy_sets_are_kept() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        headers = {"set-cookie": "lb=node-2; Path=/"} if request.url.path.endswith("tools") else {}
        return httpx.Response(200, json={"format": "openai", "tools": []}, headers=headers)

    async with Client(
        "http://lb.test", token="t" * 20, transport=httpx.MockTransport(handler)
    ) as c:
        assert await c.tools() == []
        assert dict(c._http.cookies) == {"lb": "node-2"}
        c._http.cookies = {"other": "1"}
        assert dict(c._http.cookies) == {"other": "1"}
