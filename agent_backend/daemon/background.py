"""A daemon on a thread of this process: for notebooks, examples and tests.

``with run_in_thread(registry, settings) as daemon`` starts a pool, a
:class:`Dispatcher` and a real uvicorn server on a thread with its own event
loop, and returns once the server accepts connections; leaving the block
shuts it down gracefully and joins the thread. An error on the daemon's
thread is raised in the caller's.

This module must never leave the thread, the pool or a process running
after the ``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import anyio

from agent_backend.daemon.server import DaemonServer
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.dispatch import Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pools
from agent_backend.tools import ToolRegistry

__all__ = ["BackgroundDaemon", "run_in_thread"]

_START_TIMEOUT = 30.0


@dataclasses.dataclass
class BackgroundDaemon:
    url: str
    token: str = dataclasses.field(repr=False)
    server: DaemonServer

    @property
    def dispatcher(self) -> Dispatcher:
        """The daemon's dispatcher; it lives on the daemon's thread (read statistics only)."""
        return self.server.dispatcher


@contextlib.contextmanager
def run_in_thread(
    registry: ToolRegistry,
    settings: DaemonSettings,
    *,
    pool: Any = DEFAULT_POOL,
    **dispatcher_options: Any,
) -> Iterator[BackgroundDaemon]:
    """Serve ``registry`` on ``pool`` (a pool file, a pool-set file, or a config) from a thread."""
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        pools = load_pools(pool)
        async with (
            pools,
            Dispatcher(registry, **pools.dispatcher_options(), **dispatcher_options) as dispatcher,
        ):
            server = DaemonServer(dispatcher, settings, handle_signals=False)
            holder["server"] = server
            async with anyio.create_task_group() as group:
                holder["url"] = await group.start(server.serve)
                ready.set()

    def target() -> None:
        try:
            anyio.run(main)
        except BaseException as exc:  # handed to the caller's thread
            holder["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=target, name="agent-backend daemon", daemon=True)
    thread.start()
    if not ready.wait(_START_TIMEOUT):
        raise TimeoutError(f"the daemon did not start within {_START_TIMEOUT:g} s")
    if "error" in holder:
        thread.join()
        raise holder["error"]
    server: DaemonServer = holder["server"]
    try:
        yield BackgroundDaemon(holder["url"], settings.tokens[0], server)
    finally:
        server.request_shutdown()
        thread.join()
        if "error" in holder:
            raise holder["error"]
