"""Run the daemon: uvicorn on one socket, graceful shutdown, and nothing left behind.

Shutdown, on SIGTERM or SIGINT (or :meth:`DaemonServer.request_shutdown`):

1. readiness turns "not ready" and new requests get 503; uvicorn stops
   accepting connections and closes idle keep-alive ones;
2. requests in flight get ``grace`` seconds to finish;
3. those still running are cancelled: the backend kills their process
   groups (or remote processes) as on any cancellation;
4. the app's lifespan ends (MCP transport, sessions closed), then the caller
   closes the dispatcher and the pool, which ends anything still running.

The process then exits 0: a signal asked for this, and it was done. (uvicorn
re-raises the signal after a graceful exit; :class:`_UvicornServer` does not.)
A second SIGINT skips the wait.

At start the soft open-files limit is raised to the hard one, and the
connection cap defaults to three quarters of it (:mod:`.transport` enforces
it); ``socket.accept()`` failing for want of descriptors is counted in the
refusal summary instead of logged with a traceback per accept. This module
must never return while a
request task it started is still running, unless that task ignores
cancellation past a bounded wait (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import anyio
import anyio.abc
import uvicorn

from agent_backend.daemon.app import DaemonState, create_app
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.daemon.transport import (
    ConnectionGuard,
    ConnectionLimits,
    RefusalLog,
    watch_requests,
)
from agent_backend.dispatch import Dispatcher
from agent_backend.errors import ConfigError
from agent_backend.tokens import is_loopback

__all__ = ["DaemonServer", "bind_socket", "default_max_connections", "raise_open_files_limit"]

logger = logging.getLogger("agent_backend.daemon")

# How long cancelled request tasks may take to unwind (their processes are being killed).
_UNWIND_SECONDS = 15.0


# The soft limit asked for when the hard one is unlimited.
_UNLIMITED_NOFILE = 1 << 20
# What asyncio's accept loop logs when accept() fails for want of descriptors or memory.
_ACCEPT_FAILED = "socket.accept() out of system resource"


def raise_open_files_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` as far as the hard limit allows; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_NOFILE if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning(
                "could not raise the open-files limit from %d to %d: %s", soft, target, exc
            )
    if soft == resource.RLIM_INFINITY:
        soft = _UNLIMITED_NOFILE
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    logger.info("open-files limit: %d (hard limit %s)", soft, hard_text)
    return soft


def default_max_connections(open_files: int) -> int:
    """The connection cap for ``open_files`` descriptors: a quarter is left to the pools."""
    return max(16, open_files * 3 // 4)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (``port`` 0: a free one)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            key="port",
            expected="a free port",
        ) from None
    sock.set_inheritable(False)
    return sock


class _UvicornServer(uvicorn.Server):
    """uvicorn, with the signal handling this daemon wants (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, *, state: DaemonState, handle_signals: bool) -> None:
        super().__init__(config)
        self.daemon_state = state
        self.handle_signals = handle_signals
        self.on_started: Callable[[], None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
            # Not re-raised: the signal asked for a graceful exit and got it.

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.daemon_state.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()


class DaemonServer:
    """One daemon serving ``dispatcher`` (opened and closed by the caller) on one socket."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        settings: DaemonSettings,
        *,
        handle_signals: bool = True,
        token_explicit: bool = True,
        log_level: str = "warning",
    ) -> None:
        """
        Args:
            handle_signals: install SIGTERM/SIGINT handlers (main thread only).
            token_explicit: False when the token was generated just now; a non-loopback
                ``settings.host`` is then refused.
        """
        if not is_loopback(settings.host) and not token_explicit:
            raise ConfigError(
                f"refusing to listen on {settings.host} (not loopback) with a generated token: "
                "set AGENT_BACKEND_TOKEN, or pass --token-file with a token you made",
                key="host",
                expected="127.0.0.1, or a token given explicitly",
            )
        self.dispatcher = dispatcher
        self.settings = settings
        self.state = DaemonState()
        self.app = create_app(dispatcher, settings, state=self.state)
        config = uvicorn.Config(
            # The guarded protocol learns when a request's app is done (transport.py).
            watch_requests(self.app),
            lifespan="on",
            log_config=None,
            log_level=log_level,
            access_log=False,
            # uvicorn types these int but uses them as (float) delays.
            timeout_graceful_shutdown=settings.grace,  # type: ignore[arg-type]
            timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
            server_header=False,
        )
        self._server = _UvicornServer(config, state=self.state, handle_signals=handle_signals)
        self.refusals = RefusalLog()
        """Connections refused or cut before reaching the app, counted per reason."""
        self.port: int | None = None
        self.address: tuple[str, int] | None = None
        """The address the daemon listens on, once it does."""

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the daemon is not listening yet")
        host = self.settings.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (as SIGTERM does); safe from any thread."""
        self.state.draining = True
        self._server.should_exit = True

    def force_exit(self) -> None:
        """Skip the grace period: cancel what is in flight now."""
        self.request_shutdown()
        self._server.force_exit = True

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen until shut down; ``task_status.started(url)`` once accepting connections."""
        settings = self.settings
        open_files = raise_open_files_limit()
        limits = ConnectionLimits(
            max_head_bytes=settings.max_head_bytes,
            head_timeout=settings.head_timeout,
            body_timeout=settings.body_timeout,
            max_connections=settings.max_connections or default_max_connections(open_files),
            retry_after=settings.retry_after,
        )
        logger.info("at most %d open connections", limits.max_connections)
        guard = ConnectionGuard(limits, log=self.refusals)
        self._server.config.http = guard.protocol()
        sock = bind_socket(self.settings.host, self.settings.port)
        self.address = sock.getsockname()[:2]
        self.port = sock.getsockname()[1]
        started = False

        def on_started() -> None:
            nonlocal started
            started = True
            task_status.started(self.url)

        self._server.on_started = on_started
        try:
            with self._accept_failures_counted():
                await self._server.serve(sockets=[sock])
        finally:
            sock.close()
            self.refusals.close()
            await self._wait_request_tasks()
        if not started:
            raise ConfigError("the daemon did not start (see the log)", key="", expected="")

    @contextlib.contextmanager
    def _accept_failures_counted(self) -> Iterator[None]:
        """Count asyncio's accept failures (EMFILE...) in the refusal summary, not as tracebacks."""
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if context.get("message") == _ACCEPT_FAILED and isinstance(exc, OSError):
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                self.refusals.note(f"accept() failed: {name}, retried in 1 s")
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handle)
        try:
            yield
        finally:
            if loop.get_exception_handler() is handle:
                loop.set_exception_handler(previous)

    async def _wait_request_tasks(self) -> None:
        # uvicorn cancels them after the grace period but does not wait for them to end.
        tasks = set(self._server.server_state.tasks)
        if tasks:
            with anyio.CancelScope(shield=True):
                _, pending = await asyncio.wait(tasks, timeout=_UNWIND_SECONDS)
            if pending:
                logger.error("%d request task(s) still running after shutdown", len(pending))
