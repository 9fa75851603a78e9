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
A second SIGINT skips the wait. This module must never return while a
request task it started is still running, unless that task ignores
cancellation past a bounded wait (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import anyio
import anyio.abc
import uvicorn

from agent_backend.daemon.app import DaemonState, create_app
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.daemon.transport import CoalescingHTTPProtocol
from agent_backend.dispatch import Dispatcher
from agent_backend.errors import ConfigError
from agent_backend.tokens import is_loopback

__all__ = ["DaemonServer", "bind_socket"]

logger = logging.getLogger("agent_backend.daemon")

# How long cancelled request tasks may take to unwind (their processes are being killed).
_UNWIND_SECONDS = 15.0


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
            self.app,
            lifespan="on",
            log_config=None,
            log_level=log_level,
            access_log=False,
            # uvicorn types it int but uses it as asyncio.wait_for's (float) timeout.
            timeout_graceful_shutdown=settings.grace,  # type: ignore[arg-type]
            server_header=False,
            http=CoalescingHTTPProtocol,
        )
        self._server = _UvicornServer(config, state=self.state, handle_signals=handle_signals)
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
            await self._server.serve(sockets=[sock])
        finally:
            sock.close()
            await self._wait_request_tasks()
        if not started:
            raise ConfigError("the daemon did not start (see the log)", key="", expected="")

    async def _wait_request_tasks(self) -> None:
        # uvicorn cancels them after the grace period but does not wait for them to end.
        tasks = set(self._server.server_state.tasks)
        if tasks:
            with anyio.CancelScope(shield=True):
                _, pending = await asyncio.wait(tasks, timeout=_UNWIND_SECONDS)
            if pending:
                logger.error("%d request task(s) still running after shutdown", len(pending))
