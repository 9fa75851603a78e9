"""What the trainer adapters share: their tools, opened once on the event loop that uses them.

A trainer adapter's episodes run their tools through a
:class:`~agent_backend.Dispatcher`. It is given either *tools* (a registry,
default the built-ins) and a pool to run them on, or *a dispatcher*: open
(it stays the caller's) or not yet opened (the adapter opens it and its
pool). What holds connections (the pool, the dispatcher, and the policy or a
token policy's sampler when it is an async context manager) belongs to the
event loop that opened it, and its task groups to the task that entered it.
So:

* :func:`open_tools`: tools or a dispatcher, as one async context manager
  that opens what is not open yet and closes only that. TRL enters it on its
  own event loop (a blocking portal).
* :class:`HostedTools`: :func:`open_tools` entered once, by whichever task
  asks first, in a task of its own
  (:meth:`BackgroundTasks.hold <agent_backend.lifecycle.BackgroundTasks.hold>`):
  SkyRL calls ``generate()`` from several tasks at once. ``aclose()`` from
  any task of the loop closes it; if the loop ends first, ``asyncio.run``
  cancels that task, which closes it.
* :class:`PerLoop`: a :class:`HostedTools` per event loop and key (a
  :class:`ToolsSpec`: the tools and pool a config file names): verl
  instantiates an agent loop per row, in every worker process, and gives it
  no shutdown hook.

It imports no trainer. It must never close what the caller opened, nor open
a pool twice for one key and loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import weakref
from collections.abc import AsyncIterator, Callable, Hashable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeAlias, TypeVar

import anyio

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry, load_pool
from agent_backend.config import import_object
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import RolloutError
from agent_backend.lifecycle import AsyncResource, BackgroundTasks
from agent_backend.pool_file import PoolConfig
from agent_backend.rollout import TokenPolicy

__all__ = [
    "HostedTools",
    "PerLoop",
    "PoolSource",
    "ToolsSpec",
    "check_tools_or_dispatcher",
    "open_tools",
]

#: Where tools run: a pool file, or a pool config (such as ``DEFAULT_POOL``).
PoolSource: TypeAlias = str | os.PathLike[str] | PoolConfig

K = TypeVar("K", bound=Hashable)


def check_tools_or_dispatcher(tools: ToolRegistry | None, dispatcher: Dispatcher | None) -> None:
    if dispatcher is not None and tools is not None:
        raise ValueError("pass tools or a dispatcher (which has its registry), not both")


def _loop_bound(policy: Any) -> list[AbstractAsyncContextManager[Any]]:
    """What of ``policy`` holds connections: itself, or a token policy's sampler (an HTTP
    client), when an async context manager."""
    parts: tuple[Any, ...] = (policy, policy.sampler if isinstance(policy, TokenPolicy) else None)
    return [part for part in parts if hasattr(part, "__aenter__") and hasattr(part, "__aexit__")]


@contextlib.asynccontextmanager
async def open_tools(
    *,
    tools: ToolRegistry | None = None,
    pool: PoolSource = DEFAULT_POOL,
    dispatcher: Dispatcher | None = None,
    dispatcher_options: Mapping[str, Any] | None = None,
    policy: Any = None,
) -> AsyncIterator[Dispatcher]:
    """The dispatcher the tools run on, open while in the block; with ``policy``'s connections.

    Without ``dispatcher``: ``pool`` is loaded and started and a dispatcher
    (``dispatcher_options``) runs ``tools`` (default: the built-ins) there. A
    ``dispatcher`` not yet opened is opened with its pool; an open one is
    used as it is and stays open; a closed one is a ``ValueError``. Only what
    was opened here is closed on exit, last opened first.
    """
    async with contextlib.AsyncExitStack() as stack:
        if dispatcher is None:
            backend = await stack.enter_async_context(load_pool(pool))
            registry = tools if tools is not None else ToolRegistry(builtin_tools())
            dispatcher = await stack.enter_async_context(
                Dispatcher(registry, backend, **dict(dispatcher_options or {}))
            )
        elif dispatcher.statistics().state == "new":
            await stack.enter_async_context(dispatcher.pool)
            await stack.enter_async_context(dispatcher)
        elif dispatcher.statistics().state == "closed":
            raise ValueError("the dispatcher is closed")
        for part in _loop_bound(policy):
            await stack.enter_async_context(part)
        yield dispatcher


@dataclasses.dataclass(frozen=True, slots=True)
class ToolsSpec:
    """Where the tools come from and where they run, as a config file names them: a key of
    :class:`PerLoop`."""

    pool: str | None = None
    """A pool file (TOML); None: this machine (the default local pool)."""
    tools_dir: str | None = None
    """A folder of tool schema files, loaded into the registry."""
    registry: str | None = None
    """``module:attribute``: a :class:`~agent_backend.ToolRegistry`, or a function returning one."""
    dispatcher_options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of :class:`~agent_backend.Dispatcher` (``default_timeout``, ...)."""

    def build_registry(self) -> ToolRegistry:
        """The registry: ``registry``'s (else the built-in tools), with ``tools_dir`` loaded."""
        if self.registry is not None:
            found = import_object(self.registry)
            made = found() if callable(found) and not isinstance(found, ToolRegistry) else found
            if not isinstance(made, ToolRegistry):
                raise TypeError(
                    f"registry {self.registry!r} is a {type(made).__name__}, not a ToolRegistry"
                )
            registry = made
        else:
            registry = ToolRegistry([] if self.tools_dir is not None else builtin_tools())
        if self.tools_dir is not None:
            registry.load_dir(self.tools_dir)
        return registry

    def open(self) -> AbstractAsyncContextManager[Dispatcher]:
        """:func:`open_tools` for this spec."""
        return open_tools(
            tools=self.build_registry(),
            pool=self.pool if self.pool is not None else DEFAULT_POOL,
            dispatcher_options=dict(self.dispatcher_options),
        )


class HostedTools(AsyncResource):
    """:func:`open_tools` (or any opener of a dispatcher) entered at first use, in a task of its own.

    :meth:`dispatcher` opens it on the first call, from whichever task, and
    returns it to every later one; calls waiting on an opening that fails get
    its error, and the next call tries again. :meth:`aclose` closes what was
    opened (raising what closing raised), from any task, shielded; a later
    :meth:`dispatcher` raises :class:`~agent_backend.errors.RolloutError`.
    """

    def __init__(
        self, opener: Callable[[], AbstractAsyncContextManager[Dispatcher]], *, what: str
    ) -> None:
        self._opener = opener
        self._what = what
        self._lock = anyio.Lock()
        self._tasks: BackgroundTasks | None = None
        self._dispatcher: Dispatcher | None = None
        self._failures = 0
        self._error: Exception | None = None
        """What the last opening that failed raised; ``_failures`` counts them."""
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._dispatcher is not None else "new"
        return f"<HostedTools {self._what} {state}>"

    def is_closed(self) -> bool:
        return self._closed

    async def dispatcher(self) -> Dispatcher:
        """The open dispatcher, opened by the first call (the others wait for it)."""
        failures = self._failures
        async with self._lock:
            if self._closed:
                raise RolloutError(f"{self._what} is closed")
            if self._dispatcher is not None:
                return self._dispatcher
            if self._failures != failures and self._error is not None:
                raise self._error  # the opening this call waited for failed
            tasks = BackgroundTasks(f"agent_backend {self._what}")
            await tasks.open()
            try:
                self._dispatcher = await tasks.hold(self._opener())
            except BaseException as exc:
                if isinstance(exc, Exception):  # not a cancellation: the waiters share it
                    self._error = exc
                    self._failures += 1
                await tasks.aclose()
                raise
            self._tasks = tasks
            return self._dispatcher

    async def aclose(self) -> None:
        """Close what :meth:`dispatcher` opened (waiting for an opening under way); idempotent."""
        self._closed = True
        with anyio.CancelScope(shield=True):
            async with self._lock:
                self._dispatcher = None
            if self._tasks is not None:
                await self._tasks.aclose()


class PerLoop(Generic[K]):
    """A :class:`HostedTools` per event loop and key, opened by ``opener(key)`` at first use."""

    def __init__(self, opener: Callable[[K], AbstractAsyncContextManager[Dispatcher]]) -> None:
        self._opener = opener
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[K, HostedTools]] = (
            weakref.WeakKeyDictionary()
        )

    async def dispatcher(self, key: K) -> Dispatcher:
        """The open dispatcher for ``key`` in this event loop, opened on first use."""
        table = self._loops.setdefault(asyncio.get_running_loop(), {})
        hosted = table.get(key)
        if hosted is None:
            hosted = table[key] = HostedTools(
                lambda: self._opener(key), what=f"the dispatcher of {key}"
            )
        return await hosted.dispatcher()

    async def aclose(self) -> None:
        """Close the dispatchers this event loop opened (concurrently); a later call opens anew."""
        table = self._loops.pop(asyncio.get_running_loop(), {})
        async with anyio.create_task_group() as group:
            for hosted in table.values():
                group.start_soon(hosted.aclose)
