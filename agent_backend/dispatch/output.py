"""Capture a stream of any length in bounded memory: its head and its tail.

Pure: no I/O. A command that prints a gigabyte costs ``limit`` bytes here,
not a gigabyte: the first half of the bound is kept as the head, the last
half as a rolling tail, and everything in between is only counted.
"""

from __future__ import annotations

from agent_backend.dispatch.backend import Output

__all__ = ["OutputBuffer", "head_tail"]


def _marker(dropped: int) -> bytes:
    return f"\n[... {dropped} bytes omitted ...]\n".encode()


class OutputBuffer:
    """Feed chunks as they arrive; :meth:`result` gives the bounded :class:`Output`."""

    __slots__ = ("_head", "_head_limit", "_tail", "_tail_limit", "total")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        self._head_limit = limit - limit // 2
        self._tail_limit = limit // 2
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or self._tail_limit == 0:
            return
        self._tail += chunk[-self._tail_limit :]
        excess = len(self._tail) - self._tail_limit
        if excess > 0:
            del self._tail[:excess]

    def result(self) -> Output:
        kept = len(self._head) + len(self._tail)
        if kept == self.total:
            return Output(bytes(self._head + self._tail), self.total, False)
        dropped = self.total - kept
        return Output(bytes(self._head) + _marker(dropped) + bytes(self._tail), self.total, True)


def head_tail(data: bytes, limit: int) -> Output:
    """The bounded :class:`Output` of bytes already in memory."""
    buffer = OutputBuffer(limit)
    buffer.feed(data)
    return buffer.result()
