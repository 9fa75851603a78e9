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
import anyio.from_thread
import anyio.lowlevel

from agent_backend.daemon.server import DaemonServer
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.dispatch import Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pools
from agent_backend.tools import ToolRegistry

__all__ = ["BackgroundDaemon", "run_in_thread"]


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
    start_timeout: float | None = None,
    **dispatcher_options: Any,
) -> Iterator[BackgroundDaemon]:
    """Serve ``registry`` on ``pool`` (a pool file, a pool-set file, or a config) from a thread.

    The dispatcher takes ``settings.dispatcher_options()`` (``session_ttl``, the timeouts,
    ``output_limit``); ``dispatcher_options`` given here win over them.

    Starting waits for the pools' own start, which their settings bound
    (``start_timeout`` of a Ray pool, ``connect_timeout`` of an SSH host);
    ``start_timeout`` here adds an overall bound for callers that want one.
    """
    ready = threading.Event()
    holder: dict[str, Any] = {}
    lock = threading.Lock()

    async def main() -> None:
        with anyio.CancelScope() as starting:
            with lock:
                if holder.get("abandoned"):
                    return
                holder["cancel"] = (anyio.lowlevel.current_token(), starting.cancel)
            pools = load_pools(pool)
            async with (
                pools,
                Dispatcher(
                    registry,
                    **pools.dispatcher_options(),
                    **{**settings.dispatcher_options(), **dispatcher_options},
                ) as dispatcher,
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
    if not ready.wait(start_timeout):
        with lock:
            holder["abandoned"] = True
        _cancel_start(holder)
        thread.join()
        raise TimeoutError(f"the daemon did not start within {start_timeout:g} s")
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


def _cancel_start(holder: dict[str, Any]) -> None:
    """Cancel a start still under way on the daemon's thread (its pools close as on any
    cancellation); nothing to do if it has just finished."""
    cancel = holder.get("cancel")
    if cancel is None:
        return
    token, cancel_scope = cancel
    with contextlib.suppress(RuntimeError):  # the loop has already finished
        anyio.from_thread.run_sync(cancel_scope, token=token)
