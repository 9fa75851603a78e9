"""The guarded protocol's bounds, around each of uvicorn's HTTP implementations.

A real uvicorn server on a free 127.0.0.1 port serves a small app through
:class:`GuardedHTTPProtocol` holding httptools' protocol, then h11's (one
contract, parametrized); raw sockets attack it. Every wait is on a state or
an answer, bounded generously; no test asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import pytest
import uvicorn
from anyio.streams.buffered import BufferedByteReceiveStream

from agent_backend.daemon.transport import (
    ConnectionGuard,
    ConnectionLimits,
    GuardedHTTPProtocol,
    HttpKind,
    RefusalLog,
    watch_requests,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KINDS: list[HttpKind] = ["httptools", "h11"]
WITHIN = 30.0


@dataclasses.dataclass
class Served:
    guard: ConnectionGuard
    port: int
    seen: list[str] = dataclasses.field(default_factory=list)
    """The paths the app was called for."""
    disconnects: list[str] = dataclasses.field(default_factory=list)
    """The paths whose app saw ``http.disconnect`` while reading the body."""
    gate: anyio.Event = dataclasses.field(default_factory=anyio.Event)

    async def connect(self) -> anyio.abc.SocketStream:
        return await anyio.connect_tcp("127.0.0.1", self.port)


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    with anyio.fail_after(WITHIN):
        while not condition():  # noqa: ASYNC110 - the server's state, which sets no event
            await anyio.sleep(0.01)


async def answer(stream: anyio.abc.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    with anyio.fail_after(WITHIN):
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            while True:
                received += await stream.receive()
    return received


async def response(reader: BufferedByteReceiveStream) -> tuple[bytes, bytes]:
    """One response with a ``content-length``: its head and body."""
    with anyio.fail_after(WITHIN):
        head = await reader.receive_until(b"\r\n\r\n", 65536)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head, await reader.receive_exactly(length)


def make_app(served: Served) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": "hi"})
            while (await receive())["type"] != "websocket.disconnect":
                pass
            served.disconnects.append(scope["path"])
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        served.seen.append(path)
        if path == "/hold":
            await served.gate.wait()
        body = b""
        if scope["method"] == "POST":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    served.disconnects.append(path)
                    return
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        payload = f"{path} {len(body)}".encode()
        headers = [(b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    return app


@contextlib.asynccontextmanager
async def serving(http: HttpKind, **limits: Any) -> AsyncIterator[Served]:
    settings = {
        "max_head_bytes": 4096,
        "head_timeout": 60.0,
        "body_timeout": 60.0,
        "max_connections": 100,
        "retry_after": 1.0,
        **limits,
    }
    guard = ConnectionGuard(ConnectionLimits(**settings), log=RefusalLog(), http=http)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    served = Served(guard=guard, port=sock.getsockname()[1])
    config = uvicorn.Config(
        watch_requests(make_app(served)),
        http=guard.protocol(),
        lifespan="off",
        log_config=None,
        log_level="warning",
        h11_max_incomplete_event_size=2 * settings["max_head_bytes"],
    )
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(server.serve, [sock])
            await wait_for(lambda: server.started, "the server started")
            try:
                yield served
            finally:
                served.gate.set()
                server.should_exit = True
    finally:
        guard.log.close()
        sock.close()


@pytest.mark.parametrize("http", KINDS)
async def test_requests_of_every_framing_pass_on_one_connection(http: HttpKind) -> None:
    async with serving(http) as served, await served.connect() as stream:
        reader = BufferedByteReceiveStream(stream)
        # Two pipelined in one write, a Content-Length body, a chunked body, its head and
        # body over a few writes: the guard's parser keeps step with uvicorn's.
        await stream.send(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await response(reader))[1] == b"/a 0"
        assert (await response(reader))[1] == b"/b 0"
        await stream.send(b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        assert (await response(reader))[1] == b"/c 5"
        await stream.send(b"POST /d HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n")
        await stream.send(b"\r\n3\r\nabc\r\n")
        await stream.send(b"2\r\nde\r\n0\r\n\r\n")
        assert (await response(reader))[1] == b"/d 5"
        # A head that ends within the bound, then a body larger than it, in one write.
        big = b"x" * 20000
        await stream.send(
            b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
        )
        assert (await response(reader))[1] == b"/e 20000"
        await wait_for(lambda: len(served.guard.idle) == 1, "the connection counted idle")
        assert served.seen == ["/a", "/b", "/c", "/d", "/e"]
    await wait_for(lambda: not served.guard.connections, "the guard forgot the connection")
    assert not served.guard.log.counts


@pytest.mark.parametrize("http", KINDS)
async def test_a_head_over_the_bound_gets_431_before_the_app(http: HttpKind) -> None:
    async with serving(http, max_head_bytes=4096) as served:
        async with await served.connect() as stream:
            await stream.send(b"GET /big HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000)
            answered = await answer(stream)
        assert answered.startswith(b"HTTP/1.1 431 "), answered[:200]
        assert b"exceed 4096 bytes" in answered
        assert b"connection: close" in answered
        # A head over the bound arriving in small pieces is refused the same way (the answer
        # may be lost to the reset of a close with unread bytes: the guard's count tells).
        async with await served.connect() as stream:
            await stream.send(b"GET /big HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(anyio.BrokenResourceError, OSError):
                for _ in range(100):
                    await stream.send(b"X-Pad: " + b"a" * 100 + b"\r\n")
            await answer(stream)
        await wait_for(
            lambda: served.guard.log.counts["request head too large (431)"] == 2, "refused"
        )
        assert served.seen == []


@pytest.mark.parametrize("http", KINDS)
async def test_a_head_not_whole_by_its_deadline_gets_408(http: HttpKind) -> None:
    async with serving(http, head_timeout=0.2) as served, await served.connect() as stream:
        await stream.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        answered = await answer(stream)
        assert answered.startswith(b"HTTP/1.1 408 "), answered[:200]
        assert b"did not arrive within 0.2 s" in answered
        assert served.seen == []


@pytest.mark.parametrize("http", KINDS)
async def test_a_stalled_body_gets_408_and_the_app_sees_a_disconnect(http: HttpKind) -> None:
    async with serving(http, body_timeout=0.2) as served, await served.connect() as stream:
        await stream.send(b"POST /stall HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        answered = await answer(stream)
        assert answered.startswith(b"HTTP/1.1 408 "), answered[:200]
        assert b"the request body stalled" in answered
        await wait_for(lambda: served.disconnects == ["/stall"], "the app saw the disconnect")


@pytest.mark.parametrize("http", KINDS)
async def test_the_body_clock_waits_while_the_client_waits_for_100_continue(
    http: HttpKind,
) -> None:
    async with serving(http, body_timeout=60.0) as served, await served.connect() as stream:
        reader = BufferedByteReceiveStream(stream)
        await stream.send(
            b"POST /hold HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
        )
        await wait_for(lambda: served.seen == ["/hold"], "the app called")
        (connection,) = served.guard.connections
        # Long past the body's deadline, as the guard sees it: not the client's delay yet.
        connection._last_progress -= 1000
        connection._check_deadlines()
        assert not connection.transport.is_closing()
        served.gate.set()  # the app reads: uvicorn sends 100 Continue, the client its body
        with anyio.fail_after(WITHIN):
            assert await reader.receive_until(b"\r\n\r\n", 1000) == b"HTTP/1.1 100 Continue"
        await stream.send(b"ok")
        assert (await response(reader))[1] == b"/hold 2"


@pytest.mark.parametrize("http", KINDS)
async def test_connections_over_the_cap_get_503(http: HttpKind) -> None:
    async with serving(http, max_connections=2) as served:
        held = [await served.connect() for _ in range(2)]
        await wait_for(lambda: len(served.guard.connections) == 2, "both held")
        async with await served.connect() as over:
            answered = await answer(over)
        assert answered.startswith(b"HTTP/1.1 503 "), answered[:200]
        assert b"retry-after: 1\r\n" in answered
        assert b"too many open connections" in answered
        for stream in held:
            await stream.aclose()
        await wait_for(lambda: not served.guard.connections, "the held ones forgotten")


@pytest.mark.parametrize("http", KINDS)
async def test_an_idle_keep_alive_connection_makes_room(http: HttpKind) -> None:
    async with serving(http, max_connections=2) as served:
        idle = [await served.connect() for _ in range(2)]
        for stream in idle:
            await stream.send(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await response(BufferedByteReceiveStream(stream)))[1] == b"/first 0"
        await wait_for(lambda: len(served.guard.idle) == 2, "both idle")
        async with await served.connect() as new:
            reader = BufferedByteReceiveStream(new)
            await new.send(b"GET /new HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await response(reader))[1] == b"/new 0"
        assert await answer(idle[0]) == b""  # the oldest was closed, without a word
        assert served.guard.log.counts["idle keep-alive closed to make room"] == 1
        for stream in idle:
            await stream.aclose()


@pytest.mark.parametrize("http", KINDS)
async def test_a_busy_connection_is_not_idle(http: HttpKind) -> None:
    async with serving(http, max_connections=1) as served, await served.connect() as busy:
        await busy.send(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await wait_for(lambda: served.seen == ["/hold"], "the app called")
        assert not served.guard.idle
        async with await served.connect() as over:
            assert (await answer(over)).startswith(b"HTTP/1.1 503 ")
        served.gate.set()
        assert (await response(BufferedByteReceiveStream(busy)))[1] == b"/hold 0"


@pytest.mark.parametrize("http", KINDS)
async def test_a_slow_head_is_cut_to_make_room(http: HttpKind) -> None:
    async with serving(http, max_connections=2) as served:
        served.guard.stalled_after = 0.0  # every head still arriving counts as slow
        slow = [await served.connect() for _ in range(2)]
        for stream in slow:
            await stream.send(b"GET /slo")
        await wait_for(lambda: len(served.guard.heads) == 2, "both heads arriving")
        async with await served.connect() as new:
            reader = BufferedByteReceiveStream(new)
            await new.send(b"GET /new HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await response(reader))[1] == b"/new 0"
        cut = await answer(slow[0])
        assert cut.startswith(b"HTTP/1.1 408 "), cut[:200]
        assert b"a new connection needed room" in cut
        for stream in slow:
            await stream.aclose()


@pytest.mark.parametrize("http", KINDS)
async def test_bytes_that_are_not_http_get_400_and_a_close(http: HttpKind) -> None:
    async with serving(http) as served:
        async with await served.connect() as stream:
            await stream.send(b"\x16\x03\x01 not an HTTP request\r\n\r\n")
            answered = await answer(stream)
        assert answered.startswith(b"HTTP/1.1 400 "), answered[:200]
        assert served.seen == []
        await wait_for(lambda: not served.guard.connections, "the guard forgot it")


@pytest.mark.parametrize("http", KINDS)
async def test_a_websocket_upgrade_counts_against_the_cap_until_it_closes(http: HttpKind) -> None:
    async with serving(http) as served:
        async with await served.connect() as stream:
            reader = BufferedByteReceiveStream(stream)
            await stream.send(
                b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            )
            with anyio.fail_after(WITHIN):
                head = await reader.receive_until(b"\r\n\r\n", 4096)
                assert head.startswith(b"HTTP/1.1 101 "), head
                assert await reader.receive_exactly(4) == b"\x81\x02hi"  # a text frame
            (connection,) = served.guard.connections
            assert not served.guard.heads
            assert not served.guard.idle
            assert connection._timer is None  # no head or body deadline on a WebSocket
        await wait_for(lambda: served.disconnects == ["/ws"], "the app saw the close")
        await wait_for(lambda: not served.guard.connections, "the guard forgot it")


@pytest.mark.parametrize("http", KINDS)
async def test_bytes_after_an_upgrade_that_was_not_made_close_the_connection(
    http: HttpKind,
) -> None:
    async with serving(http) as served, await served.connect() as stream:
        reader = BufferedByteReceiveStream(stream)
        await stream.send(
            b"GET /h2c HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
        )
        assert (await response(reader))[1] == b"/h2c 0"  # answered in HTTP/1.1
        await stream.send(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        answered = await answer(stream)
        assert answered.startswith(b"HTTP/1.1 400 "), answered[:200]
        assert b"does not switch protocols" in answered
        assert served.seen == ["/h2c"]
        await wait_for(lambda: not served.guard.connections, "the guard forgot it")


def test_the_guard_holds_the_protocol_that_http_names() -> None:
    limits = ConnectionLimits(
        max_head_bytes=1024, head_timeout=1, body_timeout=1, max_connections=1, retry_after=1
    )
    names = {http: ConnectionGuard(limits, http=http).inner.__name__ for http in KINDS}
    assert names == {"httptools": "HttpToolsProtocol", "h11": "H11Protocol"}
    bounded = ConnectionGuard(limits).protocol()
    assert issubclass(bounded, GuardedHTTPProtocol)
    assert bounded.guard.limits is limits
