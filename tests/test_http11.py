"""HTTP11Transport against a real uvicorn and a scripted TCP peer on 127.0.0.1.

Framing (Content-Length, chunked, the close; both directions), keep-alive
reuse and when a connection is not reused, the server closing connections
between requests (resent only when that is safe), errors as httpx's own
classes (refused, timeouts, protocol), and the bound on connections.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest
from http11_fixtures import Peer, ScriptedServer, Uvicorn, free_port, start_uvicorn

from agent_backend.http11 import HTTP11Transport

pytestmark = pytest.mark.anyio

OK_EMPTY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@pytest.fixture(scope="module")
def server() -> Iterator[Uvicorn]:
    with start_uvicorn() as running:
        yield running


def client(url: str, transport: HTTP11Transport | None = None, **options: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, transport=transport or HTTP11Transport(), **options)


def port_of(response: httpx.Response) -> int:
    return int(response.headers["x-client-port"])


def assert_idle(transport: HTTP11Transport, *, open_: int) -> None:
    stats = transport.statistics()
    assert (stats.requests_active, stats.requests_queued) == (0, 0), transport
    assert stats.connections_open == stats.connections_idle == open_, transport


# -- framing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 70_000, 300_000, 2_000_000])
async def test_content_length_bodies_of_every_size(server: Uvicorn, size: int) -> None:
    transport = HTTP11Transport()
    async with client(server.url, transport) as http:
        response = await http.get("/length", params={"size": size})
        again = await http.get("/length", params={"size": 3})
        assert_idle(transport, open_=1)
    assert response.status_code == 200
    assert response.content == bytes(i % 251 for i in range(size))
    assert response.http_version == "HTTP/1.1"
    assert response.elapsed.total_seconds() >= 0
    assert port_of(again) == port_of(response), "the connection was reused"


async def test_chunked_answers_are_decoded_and_the_connection_reused(server: Uvicorn) -> None:
    transport = HTTP11Transport()
    async with client(server.url, transport) as http:
        response = await http.get("/chunked", params={"parts": 5})
        again = await http.get("/chunked", params={"parts": 1})
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.text == "".join(f"part {i};" for i in range(5))
        assert again.text == "part 0;"
        assert port_of(again) == port_of(response)
        async with http.stream("GET", "/chunked", params={"parts": 3}) as streamed:
            parts = [chunk async for chunk in streamed.aiter_raw()]
        assert b"".join(parts) == b"part 0;part 1;part 2;"
    assert_idle(transport, open_=0)


async def test_request_bodies_by_length_and_chunked(server: Uvicorn) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for i in range(4):
            yield f"piece {i} ".encode() * 1000

    expected = b"".join([f"piece {i} ".encode() * 1000 for i in range(4)])
    async with client(server.url) as http:
        by_length = await http.post("/echo", content=b"x" * 500_000)
        chunked = await http.post("/echo", content=pieces())
        empty = await http.post("/echo")
    assert (by_length.headers["x-framing"], by_length.content) == ("length", b"x" * 500_000)
    assert (chunked.headers["x-framing"], chunked.content) == ("chunked", expected)
    assert empty.content == b""
    assert port_of(by_length) == port_of(chunked) == port_of(empty)


async def test_head_204_and_304_have_no_body_and_keep_the_connection(server: Uvicorn) -> None:
    async with client(server.url) as http:
        head = await http.head("/length", params={"size": 100})
        no_content = await http.get("/status", params={"code": 204})
        not_modified = await http.get("/status", params={"code": 304})
        after = await http.get("/length", params={"size": 5})
    assert head.headers["content-length"] == "100"
    assert head.content == no_content.content == not_modified.content == b""
    assert (no_content.status_code, not_modified.status_code) == (204, 304)
    assert len({port_of(r) for r in (head, no_content, not_modified, after)}) == 1


async def test_bodies_delimited_by_the_close_1xx_and_trailers() -> None:
    async def handler(peer: Peer, index: int) -> None:
        request = await server.read(peer)
        if b"/until-close" in request:
            await peer.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of ")
            await anyio.sleep(0.05)
            await peer.send(b"this")
            return  # the close ends the body
        await peer.send(
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        )
        await peer.send(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            b"4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nx-trailer: t\r\n\r\n"
        )
        request = await server.read(peer)  # the connection is reused after the trailers
        if request:
            await peer.send(OK_EMPTY)

    async with ScriptedServer(handler) as server:
        transport = HTTP11Transport()
        async with client(server.url, transport) as http:
            closed = await http.get("/until-close")
            informational = await http.get("/hints")
            after = await http.get("/after")
        assert closed.text == "all of this"
        assert informational.status_code == 200
        assert informational.text == "wikipedia"
        assert after.text == "ok"
        assert server.accepted == 2, "closed after the close-delimited body, reused after chunks"


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: no\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
    ],
    ids=[
        "http2-status",
        "four-digit-status",
        "conflicting-lengths",
        "negative-length",
        "header-without-colon",
        "obsolete-folding",
        "bad-chunk-size",
        "body-cut-short",
        "unasked-101",
    ],
)
async def test_malformed_answers_are_remote_protocol_errors(answer: bytes) -> None:
    async def handler(peer: Peer, index: int) -> None:
        await server.read(peer)
        await peer.send(answer)

    async with ScriptedServer(handler) as server:
        transport = HTTP11Transport()
        async with client(server.url, transport) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.get("/")
        assert_idle(transport, open_=0)


async def test_requests_that_cannot_be_framed_are_refused_locally() -> None:
    transport = HTTP11Transport()
    async with client("http://127.0.0.1:1", transport) as http:
        with pytest.raises(httpx.LocalProtocolError, match="Content-Length"):
            await http.post("/", content=b"abc", headers={"content-length": "5"})
        with pytest.raises(httpx.LocalProtocolError, match="header"):
            await http.get("/", headers={"x-evil": "a\r\nInjected: yes"})
    assert_idle(transport, open_=0)


# -- keep-alive -------------------------------------------------------------------------------------


async def test_one_connection_serves_sequential_requests(server: Uvicorn) -> None:
    transport = HTTP11Transport()
    async with client(server.url, transport) as http:
        ports = {port_of(await http.get("/length", params={"size": i})) for i in range(20)}
        assert len(ports) == 1
        assert_idle(transport, open_=1)
        assert "1 open, 1 idle" in repr(transport)
    assert transport.is_closed()
    assert_idle(transport, open_=0)


async def test_connection_close_and_unread_bodies_are_not_reused(server: Uvicorn) -> None:
    transport = HTTP11Transport()
    async with client(server.url, transport) as http:
        first = await http.get("/close")
        second = await http.get("/length")
        assert port_of(second) != port_of(first), "the server said Connection: close"
        async with http.stream("GET", "/length", params={"size": 1_000_000}) as big:
            streamed_port = port_of(big)
            await big.aiter_raw().__anext__()  # a part of the body only
        after = await http.get("/length")
        assert port_of(after) != streamed_port, "a body left unread makes the connection unusable"
        assert_idle(transport, open_=1)


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    with start_uvicorn(timeout_keep_alive=0.2) as short:
        transport = HTTP11Transport(keepalive_expiry=None)
        async with client(short.url, transport) as http:
            first = await http.post("/count", params={"key": "idle"})
            await anyio.sleep(0.6)  # uvicorn closes the idle connection
            second = await http.post("/count", params={"key": "idle"})
        assert (first.text, second.text) == ("1", "2"), "each POST ran once"
        assert port_of(second) != port_of(first)


async def test_idle_connections_expire(server: Uvicorn) -> None:
    transport = HTTP11Transport(keepalive_expiry=0.1)
    async with client(server.url, transport) as http:
        first = await http.get("/length")
        await anyio.sleep(0.3)
        second = await http.get("/length")
    assert port_of(second) != port_of(first)


def _closes_the_second_request() -> ScriptedServer:
    """A peer that answers the first request on each connection and drops the second unanswered."""

    async def handler(peer: Peer, index: int) -> None:
        await server.read(peer)
        await peer.send(OK_EMPTY)
        await server.read(peer)  # read, never answered: as if the close raced the reuse

    server = ScriptedServer(handler)
    return server


@pytest.mark.parametrize(
    ("method", "headers"),
    [("GET", {}), ("PUT", {}), ("DELETE", {}), ("POST", {"Idempotency-Key": "k-1"})],
)
async def test_safe_requests_are_resent_when_a_reused_connection_was_closed(
    method: str, headers: dict[str, str]
) -> None:
    server = _closes_the_second_request()
    async with server:
        transport = HTTP11Transport()
        async with client(server.url, transport) as http:
            first = await http.request(method, "/one", headers=headers, content=b"body")
            second = await http.request(method, "/two", headers=headers, content=b"body")
        assert first.text == second.text == "ok"
        assert server.accepted == 2
        sent = [r.split(b" ", 2)[1] for r in server.requests]
        assert sent == [b"/one", b"/two", b"/two"], "the second request went again, once"


async def test_a_post_without_idempotency_key_is_never_resent() -> None:
    server = _closes_the_second_request()
    async with server:
        transport = HTTP11Transport()
        async with client(server.url, transport) as http:
            await http.post("/one", content=b"body")
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await http.post("/two", content=b"body")
            streamed = http.build_request("PUT", "/three", content=_one_piece())
            await http.send(streamed)  # a new connection: answered
            with pytest.raises(httpx.RemoteProtocolError):
                # a streamed body cannot be sent twice, even with an idempotent method
                await http.send(http.build_request("PUT", "/four", content=_one_piece()))
        sent = [r.split(b" ", 2)[1] for r in server.requests]
        assert sent == [b"/one", b"/two", b"/three", b"/four"]
        assert_idle(transport, open_=0)


async def _one_piece() -> AsyncIterator[bytes]:
    yield b"piece"


# -- errors -----------------------------------------------------------------------------------------


async def test_connection_refused_is_connect_error() -> None:
    transport = HTTP11Transport()
    async with client(f"http://127.0.0.1:{free_port()}", transport) as http:
        with pytest.raises(httpx.ConnectError, match="cannot connect"):
            await http.get("/")
    assert_idle(transport, open_=0)


async def test_read_timeout_closes_the_connection(server: Uvicorn) -> None:
    transport = HTTP11Transport()
    async with client(server.url, transport, timeout=httpx.Timeout(5, read=0.2)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/slow", params={"seconds": 2})
        assert_idle(transport, open_=0)
        async with http.stream("GET", "/chunked", params={"parts": 2}) as streamed:
            assert streamed.status_code == 200
            await streamed.aread()
        assert (await http.get("/length")).status_code == 200


async def test_write_timeout_when_the_peer_does_not_read() -> None:
    stalled = anyio.Event()

    async def handler(peer: Peer, index: int) -> None:
        await peer.stream.receive()  # one read (anyio stops reading from the socket after it)
        await stalled.wait()  # and never another

    async with ScriptedServer(handler, receive_buffer=4096) as server:
        transport = HTTP11Transport()
        async with client(server.url, transport, timeout=httpx.Timeout(5, write=0.3)) as http:
            with pytest.raises(httpx.WriteTimeout):
                await http.post("/", content=b"x" * (16 << 20))
            assert_idle(transport, open_=0)
        stalled.set()


async def test_cancellation_leaves_the_pool_consistent(server: Uvicorn) -> None:
    transport = HTTP11Transport(max_connections=1)
    async with client(server.url, transport) as http:
        with anyio.move_on_after(0.2):
            await http.get("/slow", params={"seconds": 2})
        assert_idle(transport, open_=0)
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(http.get, "/slow", params={"seconds": 0.5}))
            await anyio.sleep(0.1)
            with anyio.move_on_after(0.1):  # cancelled while queued for the one connection
                await http.get("/length")
            assert transport.statistics().requests_queued == 0
        assert (await http.get("/length")).status_code == 200
        assert_idle(transport, open_=1)


# -- the bound on connections -----------------------------------------------------------------------


async def test_connections_are_bounded_and_requests_queue_in_order(server: Uvicorn) -> None:
    transport = HTTP11Transport(max_connections=2)
    peak = 0
    responses: list[httpx.Response] = []

    async def one(i: int) -> None:
        responses.append(await http.get("/slow", params={"seconds": 0.3}))

    async with client(server.url, transport) as http:
        async with anyio.create_task_group() as group:
            for i in range(6):
                group.start_soon(one, i)
            for _ in range(20):
                await anyio.sleep(0.05)
                stats = transport.statistics()
                peak = max(peak, stats.connections_open)
                assert stats.requests_active + stats.requests_queued <= 6
        assert [r.status_code for r in responses] == [200] * 6
        assert len({port_of(r) for r in responses}) == 2
        assert peak == 2
        assert_idle(transport, open_=2)


async def test_pool_timeout(server: Uvicorn) -> None:
    transport = HTTP11Transport(max_connections=1)
    async with client(server.url, transport, timeout=httpx.Timeout(5, pool=0.1)) as http:
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(http.get, "/slow", params={"seconds": 0.5}))
            await anyio.sleep(0.1)
            with pytest.raises(httpx.PoolTimeout):
                await http.get("/length")
        assert_idle(transport, open_=1)


async def test_https_and_upgrades_go_to_the_fallback() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text="fallback")

    transport = HTTP11Transport(fallback=httpx.MockTransport(handler))
    async with httpx.AsyncClient(transport=transport) as http:
        secure = await http.get("https://example.invalid/x")
        upgrade = await http.get("http://127.0.0.1:1/ws", headers={"Upgrade": "websocket"})
    assert secure.text == upgrade.text == "fallback"
    assert seen == ["https://example.invalid/x", "http://127.0.0.1:1/ws"]
