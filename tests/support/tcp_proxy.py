"""A small TCP proxy on 127.0.0.1 for fault tests: forward, then cut every connection at will.

``async with TCPProxy(target_port) as proxy:`` listens on ``proxy.port`` and
forwards each connection to ``127.0.0.1:target_port``. ``proxy.cut()`` resets
every forwarded connection (RST, like a dropped NAT entry or a crashed
middlebox); ``proxy.freeze()`` stops forwarding bytes while keeping the
connections open (a silent partition: only keepalives notice);
``proxy.refuse = True`` closes new connections at once.

This module must never listen on or connect to anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from types import TracebackType
from typing import Self

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

__all__ = ["Listener", "TCPProxy", "reset_on_close"]

HOST = "127.0.0.1"


def reset_on_close(stream: anyio.abc.SocketStream) -> None:
    """SO_LINGER 0: closing sends RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock = stream.extra(SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Listener:
    """Listens on 127.0.0.1 (``port``, picked free) and serves each connection with :meth:`_handle`.

    ``async with`` a subclass: the connections' tasks are cancelled and the listener
    closed on the way out, after :meth:`_closing`.
    """

    def __init__(self) -> None:
        self.port = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._listener: anyio.abc.SocketListener | None = None

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        raise NotImplementedError

    async def _closing(self) -> None:
        """What to do before the connections' tasks are cancelled."""

    async def __aenter__(self) -> Self:
        self._listener = await anyio.create_tcp_listener(local_host=HOST, local_port=0)
        self.port = self._listener.extra(SocketAttribute.local_port)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._listener.serve, self._handle)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tg is not None
        assert self._listener is not None
        await self._closing()
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(exc_type, exc, tb)
        await self._listener.aclose()


class TCPProxy(Listener):
    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self.refuse = False
        self.accepted = 0
        self._flowing = anyio.Event()
        self._flowing.set()
        self._pairs: set[tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]] = set()

    async def _closing(self) -> None:
        await self.cut()

    @property
    def connections(self) -> int:
        return len(self._pairs)

    def freeze(self) -> None:
        """Stop forwarding (bytes are held, connections stay open) until :meth:`thaw`."""
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def thaw(self) -> None:
        self._flowing.set()

    async def cut(self) -> None:
        """Reset every forwarded connection, both sides."""
        pairs, self._pairs = list(self._pairs), set()
        for client, upstream in pairs:
            for stream in (client, upstream):
                reset_on_close(stream)
                with contextlib.suppress(Exception):
                    await stream.aclose()

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        self.accepted += 1
        if self.refuse:
            reset_on_close(client)
            await client.aclose()
            return
        try:
            upstream = await anyio.connect_tcp(HOST, self.target_port)
        except OSError:
            reset_on_close(client)
            await client.aclose()
            return
        pair = (client, upstream)
        self._pairs.add(pair)
        try:
            async with anyio.create_task_group() as pipes:
                pipes.start_soon(self._pipe, client, upstream, pipes.cancel_scope)
                pipes.start_soon(self._pipe, upstream, client, pipes.cancel_scope)
        finally:
            self._pairs.discard(pair)
            with anyio.CancelScope(shield=True):
                for stream in pair:
                    with contextlib.suppress(Exception):
                        await stream.aclose()

    async def _pipe(
        self, source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, scope: anyio.CancelScope
    ) -> None:
        try:
            async for chunk in source:
                await self._flowing.wait()
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            scope.cancel()
