"""One socket write per response: uvicorn's HTTP protocol over a transport that coalesces writes.

uvicorn writes a response's status line and headers, then its body, as two
``transport.write`` calls: two ``send`` system calls, and on a virtual
machine each one that wakes the peer costs up to half a millisecond of CPU.
:class:`_CoalescingTransport` gathers the writes made during one turn of the
event loop and sends them together: as soon as the response is complete
(:meth:`CoalescingHTTPProtocol.on_response_complete`), else on the loop's
next turn (``call_soon``, for a response still streaming). A small response
leaves in one segment, without waiting for another turn of the loop.
Everything else is passed to the real transport untouched.

This module must never hold data past the current loop turn, and never
write after the transport began closing.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

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
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        """Send what was written so far (a no-op when nothing is pending)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHTTPProtocol(_Base):
    """uvicorn's HTTP protocol (httptools, else h11) writing through :class:`_CoalescingTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not isinstance(transport, asyncio.Transport): uvloop's transports are not subclasses.
        coalescing = _CoalescingTransport(cast(asyncio.Transport, transport))
        super().connection_made(coalescing)  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        # The whole response is written: send it now rather than on the next loop turn.
        transport: Any = self.transport
        if isinstance(transport, _CoalescingTransport):
            transport.flush()
        super().on_response_complete()
