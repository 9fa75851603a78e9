"""Background work of one SSH host, started from a task or from a transport callback.

asyncssh reports a dead connection from a loop callback, outside any task,
where anyio cannot start a task; such work is queued and started by a
long-running spawner task instead. Everything runs in the backend's
:class:`~agent_backend.lifecycle.BackgroundTasks`, which lets a task
started just before close begin before it is cancelled (so its cleanup,
such as a connector's accounting, runs).

This module must never start work once its owner stopped being open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from agent_backend.lifecycle import TaskStarter

__all__ = ["Background"]

Work = Callable[[], Coroutine[Any, Any, None]]


class Background:
    """Starts one host's background work in the backend's background tasks."""

    def __init__(self, name: str, is_open: Callable[[], bool]) -> None:
        self._name = name
        self._is_open = is_open
        self._tasks: TaskStarter | None = None
        self._deferred: list[tuple[Work, str]] = []
        self._deferred_ready = asyncio.Event()

    def attach(self, tasks: TaskStarter) -> None:
        """Use ``tasks`` from now on, and start the spawner of deferred work in it."""
        self._tasks = tasks
        self.spawn(self._spawn_deferred_forever, "spawner")

    def is_attached(self) -> bool:
        return self._tasks is not None

    def spawn(self, work: Work, what: str) -> None:
        assert self._tasks is not None
        if asyncio.current_task() is None:  # a transport callback: no task to start from
            self._deferred.append((work, what))
            self._deferred_ready.set()
            return
        self._tasks.start_soon(work, name=f"ssh {what} {self._name}")

    async def _spawn_deferred_forever(self) -> None:
        while True:
            await self._deferred_ready.wait()
            self._deferred_ready.clear()
            deferred, self._deferred = self._deferred, []
            if self._is_open():  # else: closing, and the owner settles the accounting
                for work, what in deferred:
                    self.spawn(work, what)
