"""How the project's long-lived objects open and close, and where their background work runs.

* :class:`AsyncResource` / :class:`SyncResource`: closed by ``aclose()`` /
  ``close()`` or at the end of ``async with obj`` / ``with obj``; every
  subclass keeps its close idempotent.
* :class:`BackgroundTasks`: the one task group every long-lived owner of
  background work runs it in (the dispatcher's session reaper, an SSH pool's
  connectors and probes, a Ray pool's actor watchers, a trainer adapter's
  pool and dispatcher). It belongs to a task of its own, so the owner may be
  opened in one task and closed in another, under any cancel scope.

This module must never leave a task running after ``aclose()`` returned, nor
let a background task's failure pass unreported. No ``__del__`` anywhere:
what is not closed explicitly or by scope is a bug to find, not to paper over.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar, TypeVarTuple, Unpack

import anyio
import anyio.abc

__all__ = ["AsyncResource", "BackgroundTasks", "SyncResource", "TaskStarter"]

logger = logging.getLogger("agent_backend.lifecycle")

T = TypeVar("T")
PosArgsT = TypeVarTuple("PosArgsT")


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


class TaskStarter(Protocol):
    """What background work is started in: a :class:`BackgroundTasks` (or, in a unit test of
    one part, a plain anyio task group)."""

    def start_soon(
        self,
        func: Callable[[Unpack[PosArgsT]], Coroutine[Any, Any, Any]],
        /,
        *args: *PosArgsT,
        name: object = None,
    ) -> object: ...


class BackgroundTasks(AsyncResource):
    """The task group of one owner's background work, in a task of its own.

    ::

        async def __aenter__(self):
            await self._tasks.open()                  # or: async with BackgroundTasks(name)
            self._tasks.start_soon(self._reap_forever)
            return self

        async def aclose(self):
            ...                                      # the owner's own shutdown first
            await self._tasks.aclose()               # then its background work

    * :meth:`open` starts the group in an owner task; :meth:`start_soon`
      starts a task in it, from any task of the loop; :meth:`hold` keeps an
      async context manager entered there until close.
    * :meth:`aclose` cancels the tasks, exits what is held and waits until
      every task has ended: idempotent (a concurrent call waits for the
      first), shielded from the caller's cancellation, and callable from any
      task under any cancel scope, since the group is not the caller's (a
      pool set closes each pool in a task of its own). A task started just
      before ``aclose()`` still begins (anyio cancels a task only once it
      runs), so its own ``try``/``finally`` bookkeeping runs. Nothing
      outlives ``aclose()``.
    * **A background task that fails** (raises anything but a cancellation)
      ends the group at once: the other tasks are cancelled and what is held
      is exited, as at close (no task is left doing half of a job whose
      partner died); the failure is logged at ERROR when it happens;
      :meth:`start_soon` raises ``RuntimeError`` from then on; and the first
      :meth:`aclose` raises the failure itself (an ``ExceptionGroup`` when
      several tasks failed together). Work that must survive one bad pass (a
      reaper) catches its own errors.

    If the event loop ends first (``asyncio.run`` cancels the tasks left),
    the owner task is cancelled and the group ends the same way.
    """

    __slots__ = ("_failure", "_group", "_name", "_owner", "_running", "_state", "_stop")

    def __init__(self, name: str) -> None:
        self._name = name
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._owner: asyncio.Task[None] | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._failure: BaseException | None = None
        self._running = 0

    def __repr__(self) -> str:
        failed = " failed" if self._failure is not None else ""
        return f"<BackgroundTasks {self._name!r} [tasks: {self._running}] {self._state}{failed}>"

    def is_open(self) -> bool:
        """Open, and no task has failed: :meth:`start_soon` starts tasks."""
        return self._state == "open" and self._owner is not None and not self._owner.done()

    def is_closed(self) -> bool:
        return self._state in ("closing", "closed")

    def failure(self) -> BaseException | None:
        """What a failed background task raised (the group has ended), else None."""
        return self._failure

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def open(self) -> None:
        """Start the group (once); a cancelled open leaves nothing behind."""
        if self._state != "new":
            raise RuntimeError(f"{self._name}: background tasks can be opened once")
        self._state = "open"
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._stop = anyio.Event()
        self._owner = loop.create_task(self._own(ready, self._stop), name=self._name)
        try:
            await asyncio.shield(ready)
        except BaseException:
            await self.aclose()
            raise

    async def _own(self, ready: asyncio.Future[None], stop: anyio.Event) -> None:
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                ready.set_result(None)
                await stop.wait()
                group.cancel_scope.cancel()
        except ExceptionGroup as failed:
            self._failure = failed.exceptions[0] if len(failed.exceptions) == 1 else failed
            if not stop.is_set():
                logger.error(
                    "%s: a background task failed; the others were stopped",
                    self._name,
                    exc_info=self._failure,
                )
        finally:
            if not ready.done():
                ready.cancel()

    def _open_group(self) -> anyio.abc.TaskGroup:
        if self._failure is not None:
            raise RuntimeError(f"{self._name}: a background task failed") from self._failure
        if self._state == "new" or self._group is None:
            raise RuntimeError(f"{self._name}: the background tasks are not open")
        if self._owner is None or self._owner.done():
            raise RuntimeError(f"{self._name}: the background tasks are closed")
        return self._group

    def start_soon(
        self,
        func: Callable[[Unpack[PosArgsT]], Awaitable[Any]],
        /,
        *args: *PosArgsT,
        name: object = None,
    ) -> None:
        """Start ``func(*args)`` in the group (anyio's ``TaskGroup.start_soon``).

        Raises ``RuntimeError`` before :meth:`open`, once the group ended, or
        after a task failed. Started while closing, it runs to its first
        checkpoint and is cancelled there.
        """
        group = self._open_group()
        if name is None:
            name = f"{self._name}: {getattr(func, '__qualname__', func)!s}"
        group.start_soon(self._run, func, args, name=name)

    async def _run(self, func: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        self._running += 1
        try:
            await func(*args)
        finally:
            self._running -= 1

    async def hold(self, resource: AbstractAsyncContextManager[T], *, name: str | None = None) -> T:
        """Enter ``resource`` in a task of the group and return what entering gave.

        It stays entered until the group ends (:meth:`aclose`, or a failure),
        when it is exited as on a normal exit, shielded: ``__aexit__(None, None, None)``;
        what the exit raises is a failure, raised by :meth:`aclose`. What
        entering raises is raised here and the group goes on; cancelling the
        caller cancels the entering. Several held resources exit concurrently:
        hold one ``AsyncExitStack`` when their order matters.
        """
        group = self._open_group()
        value: T = await group.start(
            self._hold, resource, name=name or f"{self._name}: holds {type(resource).__name__}"
        )
        return value

    async def _hold(
        self,
        resource: AbstractAsyncContextManager[T],
        *,
        task_status: anyio.abc.TaskStatus[T] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        async with contextlib.AsyncExitStack() as stack:
            value = await stack.enter_async_context(resource)
            try:
                task_status.started(value)
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await stack.aclose()

    async def aclose(self) -> None:
        """Cancel the tasks, exit what is held, wait for all to end (shielded); idempotent.

        The first call raises what a failed task raised (the class docstring).
        """
        owner = self._owner
        if self._state == "new" or owner is None:
            self._state = "closed"
            return
        first = self._state == "open"
        if first:
            self._state = "closing"
        with anyio.CancelScope(shield=True):
            if self._stop is not None:
                self._stop.set()
            await asyncio.wait({owner})
        if not first:
            return
        self._state = "closed"
        if self._failure is not None:
            raise self._failure
        if not owner.cancelled() and owner.exception() is not None:
            raise owner.exception()  # type: ignore[misc]  # a BaseException (KeyboardInterrupt)
