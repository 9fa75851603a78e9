"""One socket write per response: uvicorn's HTTP protocol over a transport that coalesces writes.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls: two ``send`` system calls, and on a virtual
machine each one that wakes the peer costs up to half a millisecond of CPU.
:class:`_CoalescingTransport` gathers the writes made during one turn of the
event loop and sends them together on the next (``call_soon``), so a small
response leaves in one segment. Everything else is passed to the real
transport untouched.

This module must never hold data past the current loop turn, and never
write after the transport began closing.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:  # httptools missing: uvicorn's pure-Python protocol
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]

__all__ = ["CoalescingHTTPProtocol"]


class _CoalescingTransport:
    """An ``asyncio.Transport`` whose writes of one loop turn leave as one."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHTTPProtocol(_Base):
    """uvicorn's HTTP protocol (httptools, else h11) writing through :class:`_CoalescingTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        super().connection_made(_CoalescingTransport(transport))  # type: ignore[arg-type]
