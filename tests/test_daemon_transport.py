"""The coalescing transport: the writes of one loop turn leave as one; close flushes; abort drops."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent_backend.daemon.transport import _CoalescingTransport

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
