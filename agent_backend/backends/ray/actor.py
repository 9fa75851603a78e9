"""What runs inside each Ray actor of a pool: tools loaded once, calls run, errors made portable.

:class:`ToolActor` imports the pool's tools (``module:function``) when the
actor starts and runs calls on them: arguments checked against the tool's
schema (payload arguments as stand-ins, then resolved here, in the actor),
sync tools in threads, async ones on the actor's event loop. The first of
its two return objects is always a small :data:`Outcome`; the second is
the result itself when it is large enough to stay in the object store.

Errors come back as values, never raised through Ray: the project's own
errors when they pickle, everything else as
:class:`~agent_backend.errors.ToolFailed` built from strings and an int
(type, message, HTTP status, traceback). So an exception that holds a lock,
a socket or aiohttp's header proxies can never fail to unpickle on the other side.

This module must never hold driver state or import the driver's modules
itself (``backend``, ``supervisor``): it is what Ray imports on every node.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import anyio
import anyio.to_thread
import ray

from agent_backend.backends.ray.frames import decode, encode
from agent_backend.backends.ray.payload import (
    describe_payload,
    payload_size,
    restore_payloads,
    split_payloads,
)
from agent_backend.config import import_object
from agent_backend.errors import (
    AgentBackendError,
    ConfigError,
    ToolFailed,
    UnknownToolError,
    clip,
)
from agent_backend.tools.functions import tool_from_function
from agent_backend.tools.invoke import run_prepared
from agent_backend.tools.tool import Tool

__all__ = [
    "ERROR",
    "PAYLOAD",
    "VALUE",
    "Outcome",
    "Request",
    "ToolActor",
    "import_function",
    "portable_error",
    "tool_failure",
]


def tool_failure(exc: BaseException, *, tool: str | None) -> ToolFailed:
    """A :class:`ToolFailed` carrying ``exc``'s type, message, HTTP status and traceback.

    Built from strings and an int only, so it pickles whatever ``exc`` held
    (locks, sockets, aiohttp's header proxies).
    """
    kind = type(exc)
    error_type = kind.__qualname__
    if kind.__module__ != "builtins":
        error_type = f"{kind.__module__}.{error_type}"
    try:
        text = str(exc)
    except Exception:
        text = ""
    formatted = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    return ToolFailed(
        clip(f"{error_type}: {text}" if text else error_type, 2000),
        tool=tool,
        error_type=error_type,
        status=_http_status(exc),
        traceback=clip(formatted, 4000),
    )


def _http_status(exc: BaseException) -> int | None:
    """An HTTP status on ``exc`` or its causes: ``status`` (aiohttp, urllib), ``status_code``,
    or ``response.status_code``/``response.status`` (httpx, requests)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        holders = [current]
        with contextlib.suppress(Exception):
            response = getattr(current, "response", None)
            if response is not None:
                holders.append(response)
        for holder in holders:
            for attribute in ("status", "status_code"):
                try:
                    value = getattr(holder, attribute, None)
                except Exception:
                    continue
                if type(value) is int and 100 <= value <= 599:
                    return value
        current = current.__cause__ or current.__context__
    return None


def portable_error(exc: Exception, *, tool: str | None) -> AgentBackendError:
    """``exc`` as an error that crosses the actor boundary with its fields."""
    if isinstance(exc, AgentBackendError):
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            pass
        else:
            return exc
    return tool_failure(exc, tool=tool)


def import_function(path: str) -> Callable[..., Any]:
    """``package.module:function`` (or ``module:Class.method``), imported."""
    target = import_object(path)
    if not callable(target):
        raise TypeError(f"{path} is a {type(target).__name__}, not a function")
    return target  # type: ignore[no-any-return]


#: What :meth:`ToolActor.run` sends back first, always small: ``(VALUE, the result)``,
#: ``(PAYLOAD, its PayloadInfo)`` or ``(ERROR, a portable error)``. A value outcome is
#: pickled by the actor itself where it can be (``frames.py``: bytes cost Ray almost
#: nothing to carry; the hot path).
Outcome = tuple[int, Any]
VALUE, PAYLOAD, ERROR = 0, 1, 2
#: What :meth:`ToolActor.run` takes: (tool name, arguments, whether they hold payloads).
#: Arguments without payloads were prepared by the pool, in the driver, with the schema the
#: actors described: the actor runs them as they are. Arguments with payloads hold stand-ins
#: for them, prepared here before the payloads are restored. One argument rather than three:
#: each task argument costs Ray a little per call. (Python work in an actor is dear: Ray runs
#: its workers at nice 15, so on a busy node they get the CPU last.)
Request = tuple[str, Mapping[str, Any], bool]


class ToolActor:
    """The code that runs inside each Ray actor of a pool (one process).

    Public so that Ray can import it by name on any node; not meant to be
    used directly.
    """

    def __init__(
        self, name: str, tools: Sequence[tuple[str, str | None]], inline_limit: int
    ) -> None:
        self.name = name
        self.inline_limit = inline_limit
        self.tools: dict[str, Tool] = {}
        self.load_error: ConfigError | None = None
        for index, (path, tool_name) in enumerate(tools):
            try:
                tool = tool_from_function(import_function(path), name=tool_name)
            except Exception as exc:
                self.load_error = ConfigError(
                    f"tools.{index}: cannot load {path!r} in actor {name}: "
                    f"{type(exc).__name__}: {clip(str(exc), 500)}",
                    key=f"tools.{index}.function",
                    expected="an importable module:function whose signature can be described",
                )
                return
            if tool.name in self.tools:
                self.load_error = ConfigError(
                    f"tools.{index}: a second tool named {tool.name!r}",
                    key=f"tools.{index}.name",
                    expected="a tool name used once in the pool",
                )
                return
            self.tools[tool.name] = tool

    async def describe(self) -> dict[str, Any]:
        """Who and where this actor is, and its tools (or why they did not load)."""
        return {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "tools": [
                {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": dict(tool.parameters),
                    "source": tool.source,
                }
                for tool in self.tools.values()
            ],
            "load_error": self.load_error,
        }

    async def wait_closed(self) -> None:
        """Never returns: its reference fails the moment the actor dies (the pool's sentinel)."""
        await anyio.Event().wait()

    async def run(self, request: Request | bytes) -> tuple[Outcome | bytes, Any]:
        """Run one call: (outcome, the result when it stays in the object store, else None).

        A request without payloads comes pickled (``frames.py``), and a value outcome goes
        back pickled unless it holds what only Ray's serializer may carry."""
        call = cast(Request, decode(request)) if isinstance(request, bytes) else request
        tool_name, arguments, has_payloads = call
        try:
            tool = self.tools.get(tool_name)
            if tool is None:
                raise UnknownToolError(tool_name, available=list(self.tools))
            if has_payloads:
                jsonable, payloads = split_payloads(arguments)
                prepared = await restore_payloads(tool.prepare(jsonable), payloads)
            else:
                prepared = dict(arguments)  # prepared by the pool (see Request)
            # Tool.invoke minus its prepare(): payload arguments were validated as stand-ins.
            # Not abandoned when cancelled: the pool keeps this actor's slot until the
            # function really returns, so a sync tool never runs beside the next call.
            value = await run_prepared(tool, prepared, abandon_on_cancel=False)
        except Exception as exc:
            return (ERROR, portable_error(exc, tool=tool_name)), None
        size = payload_size(value)
        if size >= self.inline_limit:
            # The checksum reads every byte (~0.5 s per GB): off the event loop.
            info = await anyio.to_thread.run_sync(
                functools.partial(describe_payload, value, size=size)
            )
            return (PAYLOAD, info), value
        outcome: Outcome = (VALUE, value)
        return encode(outcome) or outcome, None
