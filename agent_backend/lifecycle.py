"""Base classes for the project's closeable objects: ``async with obj`` / ``with obj``.

Entering returns the object (a subclass whose entry does work, such as
opening a session or starting a pool, overrides ``__aenter__``); leaving
calls ``aclose()`` (or ``close()``), which every subclass keeps idempotent.
No ``__del__`` anywhere: what is not closed explicitly or by scope is a bug
to find, not to paper over.
"""

from __future__ import annotations

import abc
import asyncio
from types import TracebackType
from typing import Self

import anyio
import anyio.abc

__all__ = ["AsyncResource", "BackgroundTasks", "SyncResource"]


class AsyncResource(abc.ABC):
    """Closed by ``await obj.aclose()`` or at the end of ``async with obj``."""

    __slots__ = ()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release everything the object holds; idempotent."""


class SyncResource(abc.ABC):
    """Closed by ``obj.close()`` or at the end of ``with obj``."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the object holds; idempotent."""


class BackgroundTasks:
    """A task group that belongs to no caller's task, for an object's background work.

    ``group = await tasks.open(name)`` starts it in a task of its own; tasks
    are started in ``group`` as usual. ``await tasks.aclose()`` cancels them and
    waits until they have ended, from any task and under any cancel scope (a
    pool set closes each of its pools in a task of its own; a task group
    entered in the starting task could not be exited there). A background
    task's own failure ends the group and is raised by ``aclose()``.
    """

    __slots__ = ("_group", "_owner", "_stop")

    def __init__(self) -> None:
        self._owner: asyncio.Task[None] | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._stop: anyio.Event | None = None

    async def open(self, name: str) -> anyio.abc.TaskGroup:
        """Start the group; once only."""
        if self._owner is not None:
            raise RuntimeError("the background tasks were already opened")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[anyio.abc.TaskGroup] = loop.create_future()
        self._stop = anyio.Event()
        self._owner = loop.create_task(self._own(ready, self._stop), name=name)
        try:
            return await asyncio.shield(ready)
        except BaseException:
            await self.aclose()
            raise

    async def _own(self, ready: asyncio.Future[anyio.abc.TaskGroup], stop: anyio.Event) -> None:
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                ready.set_result(group)
                await stop.wait()
                group.cancel_scope.cancel()
        finally:
            if not ready.done():
                ready.cancel()

    async def aclose(self) -> None:
        """Cancel the tasks and wait for them (shielded); idempotent."""
        owner = self._owner
        if owner is None:
            return
        with anyio.CancelScope(shield=True):
            if self._stop is not None:
                self._stop.set()
            if self._group is not None:
                self._group.cancel_scope.cancel()
            await asyncio.wait({owner})
        if not owner.cancelled() and owner.exception() is not None:
            raise owner.exception()  # type: ignore[misc]
