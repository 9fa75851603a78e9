"""Background work of one SSH host, started from a task or from a transport callback.

asyncssh reports a dead connection from a loop callback, outside any task,
where anyio cannot start a task; such work is queued and started by a
long-running spawner task instead. ``unstarted`` counts tasks spawned but not
yet running: the backend's supervisor lets them start before it cancels the
task group, so that no coroutine is dropped unstarted (its cleanup, such as a
connector's accounting, runs).

This module must never start work once its owner stopped being open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio.abc

__all__ = ["Background"]

Work = Callable[[], Awaitable[None]]


class Background:
    """Starts one host's background work in the backend's task group."""

    def __init__(self, name: str, is_open: Callable[[], bool]) -> None:
        self._name = name
        self._is_open = is_open
        self._tg: anyio.abc.TaskGroup | None = None
        self._deferred: list[tuple[Work, str]] = []
        self._deferred_ready = asyncio.Event()
        self.unstarted = 0
        """Tasks spawned and not yet running."""

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """Use ``tg`` from now on, and start the spawner of deferred work in it."""
        self._tg = tg
        self.spawn(self._spawn_deferred_forever, "spawner")

    def is_attached(self) -> bool:
        return self._tg is not None

    def spawn(self, work: Work, what: str) -> None:
        assert self._tg is not None
        if asyncio.current_task() is None:  # a transport callback: no task to start from
            self._deferred.append((work, what))
            self._deferred_ready.set()
            return
        self.unstarted += 1
        self._tg.start_soon(self._started, work, name=f"ssh {what} {self._name}")

    async def _spawn_deferred_forever(self) -> None:
        while True:
            await self._deferred_ready.wait()
            self._deferred_ready.clear()
            deferred, self._deferred = self._deferred, []
            if self._is_open():  # else: closing, and the owner settles the accounting
                for work, what in deferred:
                    self.spawn(work, what)

    async def _started(self, work: Work) -> None:
        self.unstarted -= 1
        await work()
