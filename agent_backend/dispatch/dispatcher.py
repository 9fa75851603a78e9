"""Run tool calls: :class:`Dispatcher`, over one pool or several, and the sessions it opens.

The pipeline of one call (docs/dispatch.md):

1. **prepare**: ``registry.prepare_call`` checks the name and the arguments;
   a model-facing error becomes a failed :class:`ToolResult`, nothing runs.
2. **route** by the tool's pool key or execution kind (:mod:`~agent_backend.dispatch.routes`):
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

A session (:mod:`agent_backend.dispatch.session`) is a private workspace per
pool; every call of the session runs there. The dispatcher keeps its
sessions in a :class:`~agent_backend.dispatch.leases.LeaseTable`, which each
session uses through the :class:`~agent_backend.dispatch.session.SessionSupport`
handed to it, and reaps those idle past ``session_ttl``: a session with a
call in flight holds a lease and is never reaped, and idle time counts from
the end of its last call. State changes are synchronous; the workspace
removal that follows runs afterwards, shielded from cancellation.

This module must never run a call whose arguments did not pass the tool's
schema, never leave a workspace behind on exit, error or cancellation, and
never start a background task outside the dispatcher's own
:class:`~agent_backend.lifecycle.BackgroundTasks`.
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
from typing import Any, Literal, Self

import anyio

from agent_backend.dispatch.backend import Backend, Host
from agent_backend.dispatch.leases import LeaseTable
from agent_backend.dispatch.result import ToolResult
from agent_backend.dispatch.routes import DEFAULT_POOL_NAME, Plan, PoolShape, Router
from agent_backend.dispatch.running import (
    CallLike,
    Job,
    as_tool_call,
    gather,
    run_function,
    run_hosted,
    run_on_host,
)
from agent_backend.dispatch.session import Session, SessionSupport, close_sessions
from agent_backend.dispatch.workspaces import SessionWorkspaces, in_pool
from agent_backend.errors import ModelFacingError, PoolClosed, PoolError, ToolTimeout
from agent_backend.lifecycle import AsyncResource, BackgroundTasks
from agent_backend.tools import Tool, ToolCall, ToolRegistry

__all__ = ["CallLike", "Dispatcher", "DispatcherStatistics", "Session", "as_tool_call"]

logger = logging.getLogger("agent_backend.dispatch")

# How long closing a session may wait for its calls to end, beyond the backstop grace.
_CLOSE_WAIT = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class DispatcherStatistics:
    state: Literal["new", "open", "closed"]
    sessions_open: int
    """Sessions with a workspace now."""
    sessions_reaped: int
    """Sessions closed by the idle reaper since the dispatcher opened."""
    calls_in_flight: int


class Dispatcher(AsyncResource):
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
        self._sessions: LeaseTable[Session] = LeaseTable(idle_ttl=session_ttl, clock=clock)
        self._support = SessionSupport(
            sessions=self._sessions,
            run=self._dispatch,
            check_usable=self._check_usable,
            pools=named,
            default_pool=default,
            workspace_timeout=default_timeout,
            close_wait=backstop_grace + _CLOSE_WAIT,
        )
        self._session_ids = itertools.count(1)
        self._reaped = 0
        self._in_flight = 0
        self._state: Literal["new", "open", "closed"] = "new"
        self._background = BackgroundTasks("agent_backend dispatcher")
        self._closed = anyio.Event()
        self._router = Router(registry, default)
        for name, backend in named.items():
            try:
                hosted: Sequence[Tool] | None = backend.hosted_tools()
            except PoolError:
                if pool is not None:
                    raise
                hosted = None  # not open: its tools are unknown, its calls fail naming it
            known = None if hosted is None else frozenset(tool.name for tool in hosted)
            shape = PoolShape(name, backend.kind, bool(backend.hosts), known)
            self._router.add_pool(shape, hosted or ())
        for tool in registry:
            self._router.plan(tool)

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
        """Open: start the session reaper (in background tasks of its own: the dispatcher
        may be closed from any task)."""
        if self._state != "new":
            raise PoolError(f"a dispatcher can be opened once (it is {self._state})")
        await self._background.open()
        self._state = "open"
        if self.session_ttl is not None:
            self._background.start_soon(self._reap_forever, name="agent_backend session reaper")
        return self

    async def aclose(self) -> None:
        """Close every open session (ending its calls) and stop the reaper; idempotent."""
        if self._state == "closed":
            await self._closed.wait()
            return
        self._state = "closed"
        try:
            await close_sessions(self._sessions.resources(), "the dispatcher was closed")
            self._sessions.close()
        finally:
            try:
                await self._background.aclose()
            finally:
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
        session_id = f"s{next(self._session_ids)}-{secrets.token_hex(8)}"
        return Session(self, session_id, self._support)

    async def reap_idle_sessions(self) -> list[Session]:
        """Close the sessions idle past the TTL now; the reaper calls this periodically."""
        expired = self._sessions.reap()  # empty without a TTL
        if expired:
            self._reaped += len(expired)
            # At once, before any await: no call can slip into a session being reaped.
            await close_sessions(expired, f"reaped after {self.session_ttl:g} s without a call")
        return expired

    async def _reap_forever(self) -> None:
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
        return await self._dispatch(as_tool_call(call), timeout)

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
        return await gather([functools.partial(self._dispatch, item, timeout) for item in items])

    def _check_own(self, session: Session) -> None:
        if session.dispatcher is not self:
            raise PoolError(f"session {session.id} belongs to another dispatcher")

    def _timeout(self, plan: Plan, arguments: dict[str, Any], timeout: float | None) -> float:
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
        timeout: float | None,  # noqa: ASYNC109 - the tool's limit, as in call()
        workspaces: SessionWorkspaces | None = None,
    ) -> ToolResult:
        """The pipeline of one call (module docstring); in ``workspaces``: a session's call."""
        self._check_usable()
        started = time.monotonic()
        self._in_flight += 1
        try:
            try:
                tool = self.registry.resolve(call)
                plan = self._router.plan(tool)
                # A hosted tool's pool checks the arguments against the schema it described.
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
                result = await self._run_in_pool(job, plan, workspaces)
            return result.model_copy(update={"duration": time.monotonic() - started})
        finally:
            self._in_flight -= 1

    async def _run_in_pool(
        self, job: Job, plan: Plan, workspaces: SessionWorkspaces | None
    ) -> ToolResult:
        """A built-in, a command or a hosted tool in its pool, bounded by the backstop."""
        name = plan.route.pool
        assert name is not None  # routes: only a function runs outside a pool
        backend = self.pools[name]
        host: Host | None = None
        workspace: str | None = None
        if plan.route.kind != "hosted":
            if workspaces is not None:
                made = await workspaces.ensure(name, backend)
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
