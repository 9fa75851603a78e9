"""Run tool calls: :class:`Dispatcher` and its :class:`Session`\\ s.

The pipeline of one call (docs/dispatch.md):

1. **prepare**: ``registry.prepare_call`` checks the name and the arguments;
   a model-facing error becomes a failed :class:`ToolResult`, nothing runs.
2. **route** by the tool's execution kind (:mod:`agent_backend.dispatch.spec`):
   a Python function runs in this process; a built-in or a command runs on a
   host: the session's, or the pool's least-loaded one; a tool the pool hosts
   (a Ray pool's Python tools) runs on the pool's least-loaded worker, which
   checks its arguments there (so they may carry payload handles).
3. **bound in time**: the host kills the process group at the timeout and
   says so (a ``Timeout`` result); an outer deadline of timeout + grace is a
   backstop for a backend that does not come back, and *that* raises
   :class:`~agent_backend.errors.ToolTimeout`, an infrastructure failure.
4. **bound in size**: output keeps its head and tail within ``output_limit``.

What the model caused comes back as a result it can act on; what the
infrastructure caused is raised (``BackendUnavailable``, ``WorkerLost``,
``ToolTimeout``, ``PoolClosed``). A call never ends in an empty success.

A :class:`Session` is a private workspace on one host; every call of the
session runs there. Sessions idle past ``session_ttl`` are reaped through a
:class:`~agent_backend.dispatch.leases.LeaseTable`: each call holds a lease
on its session, so a session with a call in flight is never reaped, and idle
time counts from the end of the last call (PITFALLS 9, 10, 15). State
changes are synchronous; the workspace removal that follows runs afterwards,
shielded from cancellation.

This module must never run a call whose arguments did not pass the tool's
schema, never leave a workspace behind on exit, error or cancellation, and
never start a background task outside the dispatcher's task group.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import orjson
import pydantic_core

from agent_backend.dispatch.backend import Backend, Command, Host, HostedResult
from agent_backend.dispatch.builtin import BuiltinContext, run_builtin
from agent_backend.dispatch.leases import LeaseTable
from agent_backend.dispatch.output import head_tail
from agent_backend.dispatch.result import ToolResult, command_result
from agent_backend.dispatch.spec import ExecutionKind, ExecutionSpec, execution_kind, execution_spec
from agent_backend.errors import (
    AgentBackendError,
    BackendUnavailable,
    ConfigError,
    ModelFacingError,
    PoolClosed,
    PoolError,
    ToolFailed,
    ToolTimeout,
    clip,
)
from agent_backend.lifecycle import AsyncResource
from agent_backend.tools import Tool, ToolCall, ToolRegistry

__all__ = ["CallLike", "Dispatcher", "DispatcherStatistics", "Session", "as_tool_call"]

logger = logging.getLogger("agent_backend.dispatch")

#: What :meth:`Dispatcher.call` accepts: a :class:`ToolCall`, a ``(name,
#: arguments)`` pair, or a ``{"name", "arguments"[, "id"]}`` mapping.
CallLike = ToolCall | tuple[str, Any] | Mapping[str, Any]

# Calls one session may have in flight at once (a guard, not a tuning knob).
_SESSION_CAPACITY = 1024
# How long closing a session may wait for its calls to end, beyond the backstop grace.
_CLOSE_WAIT = 5.0


def as_tool_call(call: CallLike, index: int = 0) -> ToolCall:
    """``call`` as a :class:`ToolCall`; id ``call_<index>`` unless it has one."""
    if isinstance(call, ToolCall):
        return call
    if isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], str):
        name, arguments = call
        return ToolCall(f"call_{index}", name, arguments, "mcp")
    if isinstance(call, Mapping) and isinstance(call.get("name"), str):
        raw_id = call.get("id")
        call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
        return ToolCall(call_id, call["name"], call.get("arguments", {}), "mcp")
    raise TypeError(
        "a call is a ToolCall, a (name, arguments) pair or a {'name', 'arguments'} mapping, "
        f"not {clip(repr(call), 80)}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    kind: ExecutionKind
    spec: ExecutionSpec


@dataclasses.dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    state: Literal["new", "open", "closed"]
    sessions_open: int
    """Sessions with a workspace now."""
    sessions_reaped: int
    """Sessions closed by the idle reaper since the dispatcher opened."""
    calls_in_flight: int


def _jsonable(value: Any) -> bytes:
    # NaN/Infinity become strings: never write a non-finite number into JSON (PITFALLS 21).
    return pydantic_core.to_json(value, fallback=repr, inf_nan_mode="strings")


def _unwrap(function: Callable[..., Any]) -> Callable[..., Any]:
    while isinstance(function, functools.partial):
        function = function.func
    return function


def _is_async(function: Callable[..., Any]) -> bool:
    target = _unwrap(function)
    if inspect.iscoroutinefunction(target):
        return True
    call = getattr(type(target), "__call__", None)  # noqa: B004 - callable instances
    return call is not None and inspect.iscoroutinefunction(call)


async def _call_function(tool: Tool, arguments: dict[str, Any]) -> Any:
    """Run ``tool.function`` with prepared arguments, as ``Tool.invoke`` does.

    The difference: a synchronous function runs in a worker thread that a
    timeout *abandons* (a thread cannot be killed), so the call returns at
    its timeout instead of when the function chooses to.
    """
    function = tool.function
    assert function is not None
    kwargs = tool.bind_arguments(arguments) if tool.bind_arguments else arguments
    if _is_async(function):
        return await function(**kwargs)
    result = await anyio.to_thread.run_sync(
        functools.partial(function, **kwargs), abandon_on_cancel=True
    )
    if inspect.isawaitable(result):
        return await result
    return result


class Dispatcher:
    """Runs tool calls from ``registry`` on ``pool``'s hosts; opens :class:`Session`\\ s.

    ``pool`` is an open :class:`~agent_backend.dispatch.backend.Backend`; the
    dispatcher uses it and never closes it. Plain calls work on a new
    dispatcher; sessions (and their reaper) need it open: ``async with
    Dispatcher(...) as dispatcher``.

    Every tool of ``registry`` must be runnable on ``pool`` (checked here,
    :class:`ConfigError` naming the tool file otherwise); tools added to the
    registry later are checked at their first call.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        pool: Backend,
        *,
        default_timeout: float = 60.0,
        max_timeout: float = 600.0,
        output_limit: int = 16384,
        session_ttl: float | None = 600.0,
        reap_interval: float | None = None,
        backstop_grace: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            default_timeout: seconds a call may take, unless the tool file or the call says.
            max_timeout: the most a model may ask for with ``exec``'s ``timeout`` argument.
            output_limit: bytes of output kept for the model (head and tail).
            session_ttl: seconds a session may sit idle before it is reaped; None: never.
            reap_interval: seconds between reaper passes; default: a quarter of the TTL.
            backstop_grace: seconds past a call's timeout before the dispatcher stops
                waiting for the backend and raises ToolTimeout.
            clock: the idle clock (for tests).
        """
        if not default_timeout > 0 or not max_timeout >= default_timeout:
            raise ValueError("need 0 < default_timeout <= max_timeout")
        if output_limit < 64:
            raise ValueError("output_limit must be at least 64 bytes")
        if session_ttl is not None and not session_ttl > 0:
            raise ValueError("session_ttl must be positive (or None: never reap)")
        if not backstop_grace > 0:
            raise ValueError("backstop_grace must be positive")
        self.registry = registry
        self.pool = pool
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.output_limit = output_limit
        self.session_ttl = session_ttl
        if reap_interval is None:
            reap_interval = min(max((session_ttl or 60.0) / 4, 0.05), 30.0)
        self.reap_interval = reap_interval
        self.backstop_grace = backstop_grace
        self._plans: dict[Tool, _Plan] = {}
        self._table: LeaseTable[Session] = LeaseTable(idle_ttl=session_ttl, clock=clock)
        self._sessions: set[Session] = set()
        self._session_ids = itertools.count(1)
        self._reaped = 0
        self._in_flight = 0
        self._state: Literal["new", "open", "closed"] = "new"
        self._task_group: anyio.abc.TaskGroup | None = None
        # The reaper's own scope: the task group's encloses the body of
        # `async with dispatcher`, which aclose() must not cancel.
        self._reaper_scope: anyio.CancelScope | None = None
        self._closed = anyio.Event()
        self._hosted: dict[str, Tool] = {}
        for tool in pool.hosted_tools():
            self._adopt(tool)
        for tool in registry:
            self._plan(tool)

    def _adopt(self, tool: Tool) -> None:
        """Add a tool the pool hosts to the registry (it is the same object on a second look)."""
        if tool.name in self.registry:
            existing = self.registry.get(tool.name)
            if existing is not tool:
                raise ConfigError(
                    f"{existing.source or 'the registry'}: tool {tool.name!r} is also hosted by "
                    f"the {self.pool.kind} pool ({tool.source or 'its workers'}); rename one",
                    file=existing.source,
                    key="name",
                    expected=f"a name the {self.pool.kind} pool's tools do not use",
                )
        else:
            self.registry.add(tool)
        self._hosted[tool.name] = tool

    def __repr__(self) -> str:
        return (
            f"<Dispatcher tools={len(self.registry)} pool={self.pool.kind}"
            f" [sessions: {len(self._sessions)} open | calls: {self._in_flight} in flight]"
            f" {self._state}>"
        )

    def statistics(self) -> DispatcherStatistics:
        return DispatcherStatistics(
            state=self._state,
            sessions_open=len(self._sessions),
            sessions_reaped=self._reaped,
            calls_in_flight=self._in_flight,
        )

    def is_closed(self) -> bool:
        return self._state == "closed"

    # -- lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise PoolError(f"a dispatcher can be opened once (it is {self._state})")
        self._reaper_scope = anyio.CancelScope()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        self._state = "open"
        if self.session_ttl is not None:
            task_group.start_soon(
                self._reap_forever, self._reaper_scope, name="agent_backend session reaper"
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            task_group, self._task_group = self._task_group, None
            if task_group is not None:
                if self._reaper_scope is not None:
                    self._reaper_scope.cancel()
                await task_group.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close every open session (ending its calls) and stop the reaper; idempotent."""
        if self._state == "closed":
            await self._closed.wait()
            return
        self._state = "closed"
        try:
            sessions = list(self._sessions)
            for session in sessions:
                session._mark_closed("the dispatcher was closed")
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as closing:
                    for session in sessions:
                        closing.start_soon(session._finish_close)
            self._table.close()
        finally:
            if self._reaper_scope is not None:
                self._reaper_scope.cancel()
            self._closed.set()

    def _check_usable(self) -> None:
        if self._state == "closed":
            raise PoolClosed("the dispatcher is closed")

    # -- sessions ---------------------------------------------------------------------------------

    def session(self) -> Session:
        """A new :class:`Session`; use it as ``async with dispatcher.session() as session``."""
        self._check_usable()
        if self._state != "open":
            raise PoolError(
                "sessions need an open dispatcher: `async with Dispatcher(...) as dispatcher`"
            )
        # Numbered for people reading logs, random so an id names nothing guessable.
        return Session(self, f"s{next(self._session_ids)}-{secrets.token_hex(8)}")

    async def reap_idle_sessions(self) -> list[Session]:
        """Close the sessions idle past the TTL now; the reaper calls this periodically."""
        expired = self._table.reap()
        for session in expired:  # synchronously, before any await: no call can slip in
            session._mark_closed(f"reaped after {self.session_ttl:g} s without a call")
        self._reaped += len(expired)
        async with anyio.create_task_group() as closing:
            for session in expired:
                closing.start_soon(session._finish_close)
        return expired

    async def _reap_forever(self, scope: anyio.CancelScope) -> None:
        with scope:
            while True:
                await anyio.sleep(self.reap_interval)
                try:
                    await self.reap_idle_sessions()
                except Exception:  # the reaper must outlive any one failure
                    logger.exception("session reaper pass failed")

    # -- calls ------------------------------------------------------------------------------------

    async def call(
        self,
        call: CallLike,
        *,
        # The tool's time limit, enforced where the tool runs (the host kills the
        # process group and reports a Timeout result); not a wait that a caller's
        # fail_after could replace.
        timeout: float | None = None,  # noqa: ASYNC109
        session: Session | None = None,
    ) -> ToolResult:
        """Run one call; model-caused problems are results, infrastructure failures raise.

        ``timeout`` overrides the tool's (``x-agent-backend.timeout``) and the
        dispatcher's default; ``session`` runs the call in that session.
        """
        if session is not None:
            self._check_own(session)
            return await session.call(call, timeout=timeout)
        return await self._dispatch(as_tool_call(call), call_timeout=timeout, session=None)

    async def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, as in call()
        session: Session | None = None,
    ) -> list[ToolResult]:
        """Run independent calls concurrently; results in call order.

        A call that fails never cancels the others. If some raised
        (infrastructure failures), the first of them in call order is raised
        once every call has ended.
        """
        if session is not None:
            self._check_own(session)
            return await session.call_many(calls, timeout=timeout)
        items = [as_tool_call(call, index) for index, call in enumerate(calls)]
        return await _gather(
            [
                functools.partial(self._dispatch, item, call_timeout=timeout, session=None)
                for item in items
            ]
        )

    def _check_own(self, session: Session) -> None:
        if session.dispatcher is not self:
            raise PoolError(f"session {session.id} belongs to another dispatcher")

    def _plan(self, tool: Tool) -> _Plan:
        plan = self._plans.get(tool)
        if plan is None:
            spec = execution_spec(tool)
            if self._hosted.get(tool.name) is tool:
                plan = _Plan("hosted", spec)
            else:
                plan = _Plan(execution_kind(tool, spec), spec)
                self._check_runnable(tool, plan)
            self._plans[tool] = plan
        return plan

    def _check_runnable(self, tool: Tool, plan: _Plan) -> None:
        where = tool.source or tool.name
        if plan.kind != "function" and plan.spec.backend not in (None, self.pool.kind):
            raise ConfigError(
                f"{where}: tool {tool.name!r} must run on a "
                f"{plan.spec.backend!r} pool, and this one is {self.pool.kind!r}",
                file=tool.source,
                key="x-agent-backend.backend",
                expected=repr(self.pool.kind),
            )
        if plan.kind in ("builtin", "command") and not self.pool.hosts:
            hosted = ", ".join(self._hosted) or "none"
            raise ConfigError(
                f"{where}: tool {tool.name!r} runs a {plan.kind} on a host, and the "
                f"{self.pool.kind} pool has no hosts (it runs its own tools: {hosted}); "
                "give this dispatcher a registry without it, or a local or ssh pool",
                file=tool.source,
                key="x-agent-backend",
                expected=f"a tool the {self.pool.kind} pool can run",
            )

    def _timeout(self, plan: _Plan, arguments: dict[str, Any], timeout: float | None) -> float:
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be positive")
        base = timeout or plan.spec.timeout or self.default_timeout
        asked = arguments.get("timeout") if plan.spec.builtin == "exec" else None
        if isinstance(asked, (int, float)) and math.isfinite(asked) and asked > 0:
            # The model may choose its own timeout, up to the caller's or max_timeout.
            return float(min(asked, timeout or self.max_timeout))
        return base

    async def _dispatch(
        self, call: ToolCall, *, call_timeout: float | None, session: Session | None
    ) -> ToolResult:
        self._check_usable()
        started = time.monotonic()
        self._in_flight += 1
        try:
            try:
                tool = self.registry.resolve(call)
                plan = self._plan(tool)
                # A hosted tool's worker checks the arguments against the same schema.
                arguments: Any = (
                    call.arguments if plan.kind == "hosted" else tool.prepare(call.arguments)
                )
            except ModelFacingError as exc:
                return ToolResult.from_error(
                    exc, call_id=call.id, tool=call.name, duration=time.monotonic() - started
                )
            limit = plan.spec.output_limit or self.output_limit
            seconds = self._timeout(plan, arguments, call_timeout)
            if plan.kind == "function":
                result = await self._run_function(tool, arguments, call, seconds, limit)
            else:
                host: Host | None = None
                if plan.kind != "hosted":
                    host = session.host if session is not None else self.pool.pick_host()
                    assert (
                        host is not None
                    )  # _check_runnable: a pool without hosts runs no commands
                where = self.pool.kind if host is None else host.name
                with anyio.move_on_after(seconds + self.backstop_grace) as backstop:
                    if host is None:
                        result = await self._run_hosted(tool, arguments, call, seconds, limit)
                    else:
                        workspace = session.workspace if session is not None else None
                        result = await self._run_on_host(
                            plan, arguments, call, host, workspace, seconds, limit
                        )
                if backstop.cancelled_caught:
                    raise ToolTimeout(
                        f"tool {call.name!r} on {where}: the backend did not return within "
                        f"{seconds:g} s + {self.backstop_grace:g} s grace",
                        timeout=seconds,
                        backend=self.pool.kind,
                        host=where,
                    )
            return result.model_copy(update={"duration": time.monotonic() - started})
        finally:
            self._in_flight -= 1

    async def _run_on_host(
        self,
        plan: _Plan,
        arguments: dict[str, Any],
        call: ToolCall,
        host: Host,
        workspace: str | None,
        seconds: float,
        limit: int,
    ) -> ToolResult:
        if plan.spec.builtin is not None:
            context = BuiltinContext(
                call_id=call.id,
                tool=call.name,
                host=host,
                workspace=workspace,
                timeout=seconds,
                output_limit=limit,
                env=dict(plan.spec.env),
            )
            return await run_builtin(plan.spec.builtin, arguments, context)
        assert plan.spec.command is not None
        command = Command(
            argv=plan.spec.command,
            cwd=workspace,
            env=dict(plan.spec.env),
            stdin=orjson.dumps(arguments),
            timeout=seconds,
            output_limit=limit,
        )
        outcome = await host.run(command)
        return command_result(
            outcome,
            call_id=call.id,
            tool=call.name,
            timeout=seconds,
            limit=limit,
            captured_limit=limit,
        )

    async def _run_hosted(
        self, tool: Tool, arguments: Any, call: ToolCall, seconds: float, limit: int
    ) -> ToolResult:
        try:
            hosted: HostedResult = await self.pool.call_hosted(
                tool.name, arguments, timeout=seconds
            )
        except ModelFacingError as exc:
            return ToolResult.from_error(exc, call_id=call.id, tool=call.name)
        except ToolFailed as exc:
            return _tool_failed(call, exc)
        except ToolTimeout as exc:  # the backend stopped the tool at its limit: like a kill
            return ToolResult.failure(
                call_id=call.id,
                tool=call.name,
                error=f"the tool did not finish within {seconds:g} s and was stopped",
                error_type="Timeout",
                host=exc.host,
            )
        shown = hosted.value if hosted.summary is None else hosted.summary
        return _value_result(call, shown, limit, host=hosted.worker).with_value(hosted.value)

    async def _run_function(
        self, tool: Tool, arguments: dict[str, Any], call: ToolCall, seconds: float, limit: int
    ) -> ToolResult:
        with anyio.move_on_after(seconds) as deadline:
            try:
                value = await _call_function(tool, arguments)
            except ModelFacingError as exc:
                return ToolResult.from_error(exc, call_id=call.id, tool=call.name)
            except ToolFailed as exc:  # a tool's own failure, already carried as data
                return _tool_failed(call, exc)
            except AgentBackendError:
                raise  # infrastructure or misuse, not the model's doing
            except Exception as exc:
                # Like a command that exits non-zero: the model sees why, the log the traceback.
                logger.warning("tool %r raised", tool.name, exc_info=True)
                return ToolResult.failure(
                    call_id=call.id,
                    tool=call.name,
                    error=f"the tool raised {type(exc).__name__}: {exc}",
                    error_type="ToolFailed",
                )
        if deadline.cancelled_caught:
            return ToolResult.failure(
                call_id=call.id,
                tool=call.name,
                error=f"the tool did not finish within {seconds:g} s and was stopped",
                error_type="Timeout",
            )
        return _value_result(call, value, limit).with_value(value)


def _tool_failed(call: ToolCall, exc: ToolFailed) -> ToolResult:
    """The result of a tool that raised: its failure, already carried as data."""
    return ToolResult.failure(
        call_id=call.id,
        tool=call.name,
        error=f"the tool raised {exc.error_type or 'an error'}: {exc.message}",
        error_type="ToolFailed",
    )


def _value_result(call: ToolCall, value: Any, limit: int, *, host: str | None = None) -> ToolResult:
    """A successful result showing ``value``: a string as is, anything else as JSON."""
    raw = value.encode() if isinstance(value, str) else _jsonable(value)
    bounded = head_tail(raw, limit)
    return ToolResult(
        call_id=call.id,
        tool=call.name,
        ok=True,
        output=bounded.text(),
        truncated=bounded.truncated,
        output_bytes=len(raw),
        host=host,
    )


async def _gather(jobs: Sequence[Callable[[], Awaitable[ToolResult]]]) -> list[ToolResult]:
    """Run ``jobs`` concurrently; their results in order, or the first error once all ended."""
    results: list[ToolResult | None] = [None] * len(jobs)
    errors: dict[int, Exception] = {}

    async def run(index: int) -> None:
        try:
            results[index] = await jobs[index]()
        except Exception as exc:  # kept, so that one failure cancels nothing
            errors[index] = exc

    async with anyio.create_task_group() as group:
        for index in range(len(jobs)):
            group.start_soon(run, index)
    if errors:
        first = errors[min(errors)]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more call(s) of this batch failed too")
        raise first
    return [result for result in results if result is not None]


class Session(AsyncResource):
    """A private workspace on one host; every call of the session runs there.

    ``async with dispatcher.session() as session``: the workspace is made on
    entry (on the pool's least-loaded host) and removed on exit, on error and
    on cancellation. Closed or reaped, a session refuses calls with
    :class:`~agent_backend.errors.PoolClosed`. On a pool without hosts (a Ray
    pool, whose workers run their own tools) a session has no workspace: it
    still groups calls, is reaped and closes the same way.
    """

    host: Host | None = None
    """The host every call of the session runs on (set on entry); None on a pool without hosts."""
    workspace: str | None = None
    """The workspace's real path on :attr:`host` (set on entry); None without a host."""

    def __init__(self, dispatcher: Dispatcher, session_id: str) -> None:
        self.dispatcher = dispatcher
        self.id = session_id
        self._state: Literal["new", "open", "closed"] = "new"
        self._reason = ""
        self._made: str | None = None  # what make_workspace returned, to remove
        self._calls: set[anyio.CancelScope] = set()
        self._calls_done: anyio.Event | None = None
        self._closed = anyio.Event()

    def __repr__(self) -> str:
        where = (
            f" {self.host.name}:{self.workspace}"
            if self._made is not None and self.host is not None
            else ""
        )
        reason = f" ({self._reason})" if self._reason else ""
        return (
            f"<Session {self.id}{where} [calls: {len(self._calls)} active] {self._state}{reason}>"
        )

    def is_open(self) -> bool:
        return self._state == "open"

    def is_closed(self) -> bool:
        return self._state == "closed"

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def open(self) -> None:
        """Make the workspace and register the session for reaping."""
        if self._state != "new":
            raise PoolError(f"session {self.id} can be opened once (it is {self._state})")
        dispatcher = self.dispatcher
        dispatcher._check_usable()
        if not dispatcher.pool.hosts:  # the pool's workers run its tools: no workspace to make
            self._register()
            return
        host = dispatcher.pool.pick_host()
        # Shielded, so that a cancellation cannot lose a workspace the host made;
        # bounded, so that a host that does not answer cannot hold us forever.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(dispatcher.default_timeout) as limit:
                made = await host.make_workspace()
            if limit.cancelled_caught:
                raise BackendUnavailable(
                    f"{host.name} did not create a workspace within {dispatcher.default_timeout:g} s",
                    backend=dispatcher.pool.kind,
                    host=host.name,
                )
        self.host = host
        self._made = made
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            self.workspace = await host.realpath(made)
            dispatcher._check_usable()
        except BaseException:
            self._mark_closed("failed to open")
            await self._finish_close()
            raise
        self._register()

    def _register(self) -> None:
        self._state = "open"
        self.dispatcher._sessions.add(self)
        self.dispatcher._table.add(self, capacity=_SESSION_CAPACITY)

    def _mark_closed(self, reason: str) -> None:
        """Refuse new calls and end the ones in flight; synchronous (the I/O is in _finish_close)."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._reason = reason
        self.dispatcher._sessions.discard(self)
        self.dispatcher._table.remove(self)
        for scope in self._calls:
            scope.cancel()

    async def _finish_close(self) -> None:
        """Wait (bounded) for cancelled calls to end, then remove the workspace; shielded."""
        with anyio.CancelScope(shield=True):
            try:
                if self._calls:
                    self._calls_done = anyio.Event()
                    with anyio.move_on_after(self.dispatcher.backstop_grace + _CLOSE_WAIT):
                        await self._calls_done.wait()
                made, self._made = self._made, None
                if made is not None and self.host is not None:
                    with anyio.move_on_after(self.dispatcher.default_timeout) as limit:
                        await self.host.remove_workspace(made)
                    if limit.cancelled_caught:
                        logger.warning("%s: removing workspace %s timed out", self.host.name, made)
            except Exception:
                # Never raised: closing must go on for the other sessions (a reaper
                # pass, the dispatcher's aclose), and the caller cannot fix it.
                logger.warning(
                    "session %s: removing its workspace on %s failed",
                    self.id,
                    self.host.name if self.host is not None else "?",
                    exc_info=True,
                )
            finally:
                self._closed.set()

    async def aclose(self) -> None:
        """End the session: calls in flight are ended, the workspace removed; idempotent."""
        if self._state == "closed":
            await self._closed.wait()
            return
        if self._state == "new":
            self._state = "closed"
            self._reason = "closed before it was opened"
            self._closed.set()
            return
        self._mark_closed("closed")
        await self._finish_close()

    def _refusal(self) -> PoolClosed:
        if self._state == "new":
            return PoolClosed(
                f"session {self.id} is not open: use `async with dispatcher.session()`"
            )
        return PoolClosed(f"session {self.id} is closed ({self._reason}); open a new session")

    async def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's limit, as in Dispatcher.call
    ) -> ToolResult:
        """Run one call in this session's workspace, on its host."""
        return await self._call(as_tool_call(call), timeout)

    async def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, as in Dispatcher.call
    ) -> list[ToolResult]:
        """Run independent calls of this session concurrently; results in call order."""
        items = [as_tool_call(call, index) for index, call in enumerate(calls)]
        return await _gather([functools.partial(self._call, item, timeout) for item in items])

    async def _call(self, call: ToolCall, call_timeout: float | None) -> ToolResult:
        if self._state != "open":
            raise self._refusal()
        owner = object()
        lease = self.dispatcher._table.acquire_on(self, owner)
        try:
            with anyio.CancelScope() as scope:
                self._calls.add(scope)
                try:
                    return await self.dispatcher._dispatch(
                        call, call_timeout=call_timeout, session=self
                    )
                finally:
                    self._calls.discard(scope)
                    if not self._calls and self._calls_done is not None:
                        self._calls_done.set()
            raise PoolClosed(
                f"session {self.id} was closed while call {call.id!r} ran ({self._reason})"
            )
        finally:
            self.dispatcher._table.release(lease)
