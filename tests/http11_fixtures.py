"""Servers for the HTTP/1.1 transport's tests, all on 127.0.0.1 and a free port.

* :func:`start_uvicorn`: a real uvicorn (on a thread with its own event loop)
  serving :class:`Probe`, a small ASGI app whose routes exercise framing:
  ``/length?size=N`` (Content-Length), ``/chunked?parts=N`` (chunked: no
  length, several body messages), ``/echo`` (the request body back, and how
  it was framed), ``/slow?seconds=S``, ``/count?key=K`` (how many times
  that key arrived), ``/close`` (answers ``Connection: close``),
  ``/status?code=N``. Every answer says which client port it came from
  (``x-client-port``), so a test can tell connections apart.
* :class:`ScriptedServer`: a raw TCP server whose handler a test writes, for
  answers uvicorn never gives (bodies delimited by the close, 1xx, trailers,
  malformed heads) and for a peer that closes or stalls on cue.

This module must never listen on anything but 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

import anyio
import anyio.abc
import uvicorn
from anyio.abc import SocketAttribute

HOST = "127.0.0.1"


class Probe:
    """The ASGI app behind :func:`start_uvicorn`."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.ports: list[int] = []
        """The client port of every request, in arrival order."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        port = scope["client"][1]
        self.ports.append(port)
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        headers = [(b"x-client-port", str(port).encode())]
        path = scope["path"]
        status = 200
        if path == "/length":
            payload = bytes(i % 251 for i in range(int(query.get("size", "10"))))
            await _answer(send, status, headers, payload)
        elif path == "/chunked":
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for part in range(int(query.get("parts", "3"))):
                chunk = f"part {part};".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/echo":
            framing = b"chunked" if _header(scope, b"transfer-encoding") else b"length"
            await _answer(send, status, [*headers, (b"x-framing", framing)], body)
        elif path == "/slow":
            await anyio.sleep(float(query.get("seconds", "1")))
            await _answer(send, status, headers, b"slow")
        elif path == "/count":
            key = query.get("key", "")
            self.counts[key] += 1
            await _answer(send, status, headers, str(self.counts[key]).encode())
        elif path == "/close":
            await _answer(send, status, [*headers, (b"connection", b"close")], b"bye")
        elif path == "/status":
            code = int(query.get("code", "200"))
            await _answer(send, code, headers, b"" if code in (204, 304) else b"status")
        else:
            await _answer(send, 404, headers, b"no such route")


def _header(scope: Any, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _answer(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    if status not in (204, 304):
        headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Uvicorn:
    def __init__(self, url: str, app: Probe, server: uvicorn.Server) -> None:
        self.url = url
        self.app = app
        self.server = server


@contextlib.contextmanager
def start_uvicorn(*, timeout_keep_alive: float = 5.0) -> Iterator[Uvicorn]:
    """A real uvicorn serving :class:`Probe` on a thread, until the block ends."""
    app = Probe()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        access_log=False,
        # uvicorn types it int but compares it as seconds.
        timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="uvicorn for http11 tests", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if errors or not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start: {errors}")
        time.sleep(0.01)
    try:
        yield Uvicorn(f"http://{HOST}:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    if errors:
        raise errors[0]


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
    return port


class Peer:
    """One accepted connection of a :class:`ScriptedServer`, with a read buffer."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    @property
    def port(self) -> int:
        port: int = self.stream.extra(SocketAttribute.remote_port)
        return port

    async def read_request(self) -> bytes:
        """One request's head and Content-Length body (b"" at EOF)."""
        while b"\r\n\r\n" not in self.buffer:
            try:
                self.buffer += await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return b""
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            if name.strip().lower() == b"transfer-encoding":
                chunked = True
        if chunked:  # kept as sent: chunks up to and with the last one
            while b"\r\n0\r\n\r\n" not in b"\r\n" + self.buffer:
                self.buffer += await self.stream.receive()
            end = (b"\r\n" + self.buffer).index(b"\r\n0\r\n\r\n") + 5
            body, self.buffer = self.buffer[:end], self.buffer[end:]
            return head + b"\r\n\r\n" + body
        while len(self.buffer) < length:
            self.buffer += await self.stream.receive()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return head + b"\r\n\r\n" + body

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)


Handler = Callable[[Peer, int], Awaitable[None]]


class ScriptedServer:
    """``async with ScriptedServer(handler) as server``: ``handler(peer, index)`` per connection.

    ``index`` counts connections from 0; the connection is closed when the handler returns.
    """

    def __init__(self, handler: Handler, *, receive_buffer: int | None = None) -> None:
        """``receive_buffer``: SO_RCVBUF of accepted sockets (small: a peer that stalls soon)."""
        self.handler = handler
        self.receive_buffer = receive_buffer
        self.port = 0
        self.accepted = 0
        self.requests: list[bytes] = []
        """Every request a handler read with :meth:`read`, in order."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._listener: anyio.abc.SocketListener | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def read(self, peer: Peer) -> bytes:
        request = await peer.read_request()
        if request:
            self.requests.append(request)
        return request

    async def __aenter__(self) -> ScriptedServer:
        self._listener = await anyio.create_tcp_listener(local_host=HOST, local_port=0)
        self.port = self._listener.extra(SocketAttribute.local_port)
        if self.receive_buffer is not None:  # inherited by accepted sockets
            listening = self._listener.extra(SocketAttribute.raw_socket)
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.receive_buffer)
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
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(exc_type, exc, tb)
        await self._listener.aclose()

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        index = self.accepted
        self.accepted += 1
        async with stream:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.handler(Peer(stream), index)
