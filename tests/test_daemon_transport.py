"""The coalescing transport: the writes of one loop turn (or one response) leave as one; close flushes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
import uvicorn.server

from agent_backend.daemon.transport import CoalescingHTTPProtocol, _CoalescingTransport

pytestmark = pytest.mark.anyio


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_one_turn_one_write() -> None:
    inner = Recorder()
    transport = _CoalescingTransport(inner)
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"{}")
    assert inner.writes == []
    assert transport.get_write_buffer_size() == 21
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest passes through


async def test_close_flushes_and_abort_drops() -> None:
    inner = Recorder()
    transport = _CoalescingTransport(inner)
    transport.write(b"last words")
    transport.close()
    assert inner.writes == [b"last words"]
    assert inner.closed
    await asyncio.sleep(0)
    assert inner.writes == [b"last words"]  # not twice
    other = Recorder()
    dropped = _CoalescingTransport(other)
    dropped.write(b"never sent")
    dropped.abort()
    await asyncio.sleep(0)
    assert other.writes == []
    assert other.aborted


async def test_flush_sends_at_once_and_the_scheduled_flush_is_then_a_no_op() -> None:
    inner = Recorder()
    transport = _CoalescingTransport(inner)
    transport.write(b"head")
    transport.write(b"body")
    transport.flush()
    assert inner.writes == [b"headbody"]
    await asyncio.sleep(0)
    assert inner.writes == [b"headbody"]


class FlowRecorder:
    """A transport that is not an ``asyncio.Transport`` subclass, as uvloop's are not."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        info = {"peername": ("127.0.0.1", 2), "sockname": ("127.0.0.1", 1)}
        return info.get(name, default)


async def test_a_complete_response_leaves_before_send_returns() -> None:
    inner = FlowRecorder()
    seen: list[list[bytes]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"4")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"done"})
        seen.append(list(inner.writes))  # on the wire already, in one write

    config = uvicorn.Config(app, log_config=None, lifespan="off", server_header=False)
    config.load()
    protocol = CoalescingHTTPProtocol(config, uvicorn.server.ServerState(), {})
    protocol.connection_made(inner)  # type: ignore[arg-type]
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(seen) == 1
    assert len(seen[0]) == 1
    assert seen[0][0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert seen[0][0].endswith(b"\r\n\r\ndone")
    protocol.connection_lost(None)
