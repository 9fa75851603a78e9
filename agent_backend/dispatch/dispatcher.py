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
import itertools
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from agent_backend.dispatch.backend import Backend, Host
from agent_backend.dispatch.leases import LeaseTable
from agent_backend.dispatch.result import ToolResult
from agent_backend.dispatch.routes import DEFAULT_POOL_NAME, PoolShape, Route, read_spec, route
from agent_backend.dispatch.running import Job, gather, run_function, run_hosted, run_on_host
from agent_backend.dispatch.spec import ExecutionSpec
from agent_backend.dispatch.workspaces import SessionWorkspaces, in_pool
from agent_backend.errors import (
    ConfigError,
    ModelFacingError,
    PoolClosed,
    PoolError,
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
    route: Route
    spec: ExecutionSpec


@dataclasses.dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    state: Literal["new", "open", "closed"]
    sessions_open: int
    """Sessions with a workspace now."""
    sessions_reaped: int
    """Sessions closed by the idle reaper since the dispatcher opened."""
    calls_in_flight: int


class Dispatcher:
    """Runs tool calls from ``registry`` on its pools' hosts and workers; opens :class:`Session`\\ s.

    ``Dispatcher(registry, pool)`` drives one pool (named ``"default"``);
    ``Dispatcher(registry, pools={"cmd": ssh, "gpu": ray}, default="cmd")``
    several, each tool routed to one of them (:mod:`agent_backend.dispatch.routes`;
    ``default``: the first pool if not given). Pools are
    :class:`~agent_backend.dispatch.backend.Backend`\\ s, normally open; the
    dispatcher uses them and never closes them. A call routed to a pool that
    is down raises :class:`BackendUnavailable` naming it, and the other pools
    keep serving. Plain calls work on a new dispatcher; sessions (and their
    reaper) need it open: ``async with Dispatcher(...) as dispatcher``.

    Every tool of ``registry`` must be runnable on one of the pools (checked
    here, :class:`ConfigError` naming the tool file otherwise); tools added to
    the registry later are checked at their first call.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        pool: Backend | None = None,
        *,
        pools: Mapping[str, Backend] | None = None,
        default: str | None = None,
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
        if (pool is None) == (pools is None):
            raise TypeError("give a Dispatcher either one pool or pools={name: backend, ...}")
        named = {DEFAULT_POOL_NAME: pool} if pool is not None else dict(pools or {})
        if not named:
            raise ValueError("pools must name at least one pool")
        default = next(iter(named)) if default is None else default
        if default not in named:
            raise ValueError(f"default pool {default!r} is not one of {', '.join(named)}")
        self.registry = registry
        self.pools: Mapping[str, Backend] = named
        """The pools by name (one, ``"default"``, for ``Dispatcher(registry, pool)``)."""
        self.default = default
        """The name of the pool host tools go to unless a route says otherwise."""
        self.pool = named[default]
        """The default pool."""
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
        self._hosted: dict[str, tuple[str, Tool]] = {}
        self._shapes: dict[str, PoolShape] = {}
        for name, backend in named.items():
            try:
                hosted: Sequence[Tool] | None = backend.hosted_tools()
            except PoolError:
                if pool is not None:
                    raise
                hosted = None  # not open: its tools are unknown, its calls fail naming it
            self._shapes[name] = PoolShape(
                name,
                backend.kind,
                bool(backend.hosts),
                None if hosted is None else frozenset(tool.name for tool in hosted),
            )
            for tool in hosted or ():
                self._adopt(name, tool)
        for tool in registry:
            self._plan(tool)

    def _adopt(self, pool: str, tool: Tool) -> None:
        """Add a tool pool ``pool`` hosts to the registry (the same object on a second look).

        A registry tool of that name stays if it routes itself there
        (``x-agent-backend.pool``): it declares the hosted tool.
        """
        kind = self.pools[pool].kind
        other = self._hosted.get(tool.name)
        if other is not None and other[0] != pool:
            raise ConfigError(
                f"{tool.source or 'a pool'}: tool {tool.name!r} is hosted by pools "
                f"{other[0]!r} and {pool!r}; rename one",
                file=tool.source,
                key="name",
                expected="a name one pool hosts",
            )
        if tool.name in self.registry:
            existing = self.registry.get(tool.name)
            if existing is not tool and read_spec(existing)[1] != pool:
                raise ConfigError(
                    f"{existing.source or 'the registry'}: tool {tool.name!r} is also hosted by "
                    f"the {kind} pool {pool!r} ({tool.source or 'its workers'}); rename one, or "
                    f"route it there (x-agent-backend.pool = {pool!r})",
                    file=existing.source,
                    key="name",
                    expected=f"a name the {kind} pool's tools do not use",
                )
        else:
            self.registry.add(tool)
        self._hosted[tool.name] = (pool, tool)

    def __repr__(self) -> str:
        pools = (
            f"pool={self.pool.kind}"
            if len(self.pools) == 1
            else "pools=" + ",".join(f"{name}:{b.kind}" for name, b in self.pools.items())
        )
        return (
            f"<Dispatcher tools={len(self.registry)} {pools}"
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
        return await self._dispatch(as_tool_call(call), timeout=timeout, session=None)

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
        return await gather(
            [
                functools.partial(self._dispatch, item, timeout=timeout, session=None)
                for item in items
            ]
        )

    def _check_own(self, session: Session) -> None:
        if session.dispatcher is not self:
            raise PoolError(f"session {session.id} belongs to another dispatcher")

    def _plan(self, tool: Tool) -> _Plan:
        plan = self._plans.get(tool)
        if plan is None:
            hosted = self._hosted.get(tool.name)
            hosted_by = hosted[0] if hosted is not None and hosted[1] is tool else None
            where = route(tool, self._shapes, self.default, hosted_by=hosted_by)
            plan = _Plan(where, read_spec(tool)[0])
            self._plans[tool] = plan
        return plan

    def _timeout(self, plan: _Plan, arguments: dict[str, Any], timeout: float | None) -> float:
        """The call's timeout: the caller's, else the tool's, else the default; ``exec``'s own
        ``timeout`` argument may choose, up to the caller's or ``max_timeout``."""
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be positive")
        asked = arguments.get("timeout") if plan.spec.builtin == "exec" else None
        if isinstance(asked, (int, float)) and math.isfinite(asked) and asked > 0:
            return float(min(asked, timeout or self.max_timeout))
        return timeout or plan.spec.timeout or self.default_timeout

    async def _dispatch(
        self,
        call: ToolCall,
        *,
        timeout: float | None,  # noqa: ASYNC109 - the tool's limit, as in call()
        session: Session | None,
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
                    call.arguments if plan.route.kind == "hosted" else tool.prepare(call.arguments)
                )
            except ModelFacingError as exc:
                return ToolResult.from_error(
                    exc, call_id=call.id, tool=call.name, duration=time.monotonic() - started
                )
            job = Job(
                call,
                tool,
                arguments,
                self._timeout(plan, arguments, timeout),
                plan.spec.output_limit or self.output_limit,
            )
            if plan.route.kind == "function":
                result = await run_function(job)
            else:
                result = await self._run_in_pool(job, plan, session)
            return result.model_copy(update={"duration": time.monotonic() - started})
        finally:
            self._in_flight -= 1

    async def _run_in_pool(self, job: Job, plan: _Plan, session: Session | None) -> ToolResult:
        name = plan.route.pool
        assert name is not None  # routes: only a function runs outside a pool
        backend = self.pools[name]
        host: Host | None = None
        workspace: str | None = None
        if plan.route.kind != "hosted":
            if session is not None:
                made = await session._workspaces.ensure(name, backend)
                host, workspace = made.host, made.path
            else:
                with in_pool(name, backend):
                    host = backend.pick_host()
        where = backend.kind if host is None else host.name
        with in_pool(name, backend):
            with anyio.move_on_after(job.timeout + self.backstop_grace) as backstop:
                if host is None:
                    result = await run_hosted(backend, job)
                else:
                    result = await run_on_host(job, plan.spec, host, workspace)
            if backstop.cancelled_caught:
                raise ToolTimeout(
                    f"tool {job.call.name!r} on {where}: the backend did not return within "
                    f"{job.timeout:g} s + {self.backstop_grace:g} s grace",
                    timeout=job.timeout,
                    backend=backend.kind,
                    host=where,
                )
        return result


class Session(AsyncResource):
    """A private workspace per pool it uses; every call of the session runs in its pool's.

    ``async with dispatcher.session() as session``: on a dispatcher of one
    pool the workspace is made on entry (on the pool's least-loaded host); on
    one of several, a workspace on a host of a pool is made the first time a
    tool routed to that pool runs (a session that only calls Ray tools makes
    none). Every workspace is removed on exit, together, on error and on
    cancellation. Closed or reaped, a session refuses calls with
    :class:`~agent_backend.errors.PoolClosed`. A pool without hosts (a Ray
    pool, whose workers run their own tools) gives no workspace: the session
    still groups its calls, is reaped and closes the same way.
    """

    def __init__(self, dispatcher: Dispatcher, session_id: str) -> None:
        self.dispatcher = dispatcher
        self.id = session_id
        self._state: Literal["new", "open", "closed"] = "new"
        self._reason = ""
        self._workspaces = SessionWorkspaces(session_id, timeout=dispatcher.default_timeout)
        self._calls: set[anyio.CancelScope] = set()
        self._calls_done: anyio.Event | None = None
        self._closed = anyio.Event()

    @property
    def host(self) -> Host | None:
        """The host of the session's workspace on the default pool; None before one is made."""
        made = self._workspaces.get(self.dispatcher.default)
        return made.host if made is not None else None

    @property
    def workspace(self) -> str | None:
        """The real path of the session's workspace on the default pool (on :attr:`host`)."""
        made = self._workspaces.get(self.dispatcher.default)
        return made.path if made is not None else None

    def workspaces(self) -> dict[str, tuple[str, str]]:
        """The workspaces made so far: pool name -> (host name, real path)."""
        return {w.pool: (w.host.name, w.path or "") for w in self._workspaces.ready()}

    def __repr__(self) -> str:
        where = f" {self._workspaces!r}" if self._workspaces.ready() else ""
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
        """Register the session for reaping (and, with one pool of hosts, make its workspace)."""
        if self._state != "new":
            raise PoolError(f"session {self.id} can be opened once (it is {self._state})")
        dispatcher = self.dispatcher
        dispatcher._check_usable()
        if len(dispatcher.pools) == 1 and dispatcher.pool.hosts:
            try:
                await self._workspaces.ensure(dispatcher.default, dispatcher.pool)
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
        self._workspaces.close()
        self.dispatcher._sessions.discard(self)
        self.dispatcher._table.remove(self)
        for scope in self._calls:
            scope.cancel()

    async def _finish_close(self) -> None:
        """Wait (bounded) for cancelled calls to end, then remove the workspaces; shielded."""
        with anyio.CancelScope(shield=True):
            try:
                if self._calls:
                    self._calls_done = anyio.Event()
                    with anyio.move_on_after(self.dispatcher.backstop_grace + _CLOSE_WAIT):
                        await self._calls_done.wait()
            finally:
                try:
                    await self._workspaces.remove_all()  # logs its failures, raises none
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
        return await gather([functools.partial(self._call, item, timeout) for item in items])

    async def _call(
        self,
        call: ToolCall,
        timeout: float | None,  # noqa: ASYNC109 - the tool's limit, as in Dispatcher.call
    ) -> ToolResult:
        if self._state != "open":
            raise self._refusal()
        owner = object()
        lease = self.dispatcher._table.acquire_on(self, owner)
        try:
            with anyio.CancelScope() as scope:
                self._calls.add(scope)
                try:
                    return await self.dispatcher._dispatch(call, timeout=timeout, session=self)
                finally:
                    self._calls.discard(scope)
                    if not self._calls and self._calls_done is not None:
                        self._calls_done.set()
            raise PoolClosed(
                f"session {self.id} was closed while call {call.id!r} ran ({self._reason})"
            )
        finally:
            self.dispatcher._table.release(lease)
