"""Run a Python function with arguments already prepared: the one way, for every caller.

:meth:`Tool.invoke`, the dispatcher's in-process tools, the tools of a Ray
pool's actors and a rollout's reward function all run their function here,
so a function behaves the same wherever it runs:

* a coroutine function (also behind ``functools.partial``, or an instance
  whose ``__call__`` is ``async def``) is awaited on the caller's event
  loop; cancellation cancels it;
* anything else runs in a worker thread, so it cannot block the loop; when
  it hands back an awaitable (a wrapper that lost the ``async`` marker),
  that is awaited on the loop;
* a thread cannot be killed, so on cancellation (a caller's timeout) a
  synchronous call is **abandoned** by default: it ends at once and the
  thread runs on until the function returns, its result dropped.
  ``abandon_on_cancel=False`` waits for the thread instead, for a caller
  that must not start another call while this one still runs (a Ray actor,
  whose concurrency slot stays taken until its task really ends).

This module must never check arguments (callers prepare them) and never run
a synchronous function on the event loop.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread

if TYPE_CHECKING:
    from agent_backend.tools.tool import Tool

__all__ = ["call_function", "is_async_callable", "run_prepared"]


def is_async_callable(function: Callable[..., Any]) -> bool:
    """True when calling ``function`` gives a coroutine: an ``async def`` function, a
    ``functools.partial`` of one, or an instance whose ``__call__`` is ``async def``."""
    while isinstance(function, functools.partial):
        function = function.func
    if inspect.iscoroutinefunction(function):
        return True
    call = getattr(type(function), "__call__", None)  # noqa: B004 - callable instances
    return call is not None and inspect.iscoroutinefunction(call)


async def call_function(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    abandon_on_cancel: bool = True,
) -> Any:
    """``function(*args, **kwargs)``: awaited if async, else in a worker thread (module docstring)."""
    bound = functools.partial(function, *args, **(kwargs or {}))
    if is_async_callable(function):
        return await bound()
    result = await anyio.to_thread.run_sync(bound, abandon_on_cancel=abandon_on_cancel)
    if inspect.isawaitable(result):
        return await result
    return result


async def run_prepared(
    tool: Tool, prepared: dict[str, Any], *, abandon_on_cancel: bool = True
) -> Any:
    """Run ``tool.function`` with arguments that passed ``tool.prepare``.

    ``tool.bind_arguments`` (when set) turns them into the function's keyword
    arguments first. :class:`TypeError` for a tool without a Python function.
    """
    function = tool.function
    if function is None:
        raise TypeError(f"tool {tool.name!r} has no Python function; run it through a backend")
    kwargs = tool.bind_arguments(prepared) if tool.bind_arguments else prepared
    if tool.is_async:  # call_function's first case, known once per tool (the hot path)
        return await function(**kwargs)
    return await call_function(function, kwargs=kwargs, abandon_on_cancel=abandon_on_cancel)
