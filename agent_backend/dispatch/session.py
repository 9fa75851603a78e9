"""A :class:`Session`: private workspaces, one per pool it uses, and every call of it run there.

A session is opened by ``dispatcher.session()`` and uses its dispatcher only
through the :class:`SessionSupport` the dispatcher hands it: the lease table
of the dispatcher's sessions (registering, unregistering, one lease per call
in flight), the dispatcher's pipeline to run a call in the session's
workspaces, and whether the dispatcher may still be used. So a session with
a call in flight holds a lease and is never reaped, and its idle time counts
from the end of its last call: a call longer than the idle TTL is not cut
off underneath, and every kind of call (command, file tool, function) counts
as activity.

Closing is two steps, the dispatcher's and the reaper's too
(:func:`close_sessions`): synchronously, refuse new calls and cancel those
in flight; then, shielded from cancellation and bounded in time, wait for
them to end and remove the workspaces.

This module must never run a call of a session that is not open, never keep
a workspace after the session closed, and never touch the dispatcher beyond
its :class:`SessionSupport`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Self

import anyio

from agent_backend.dispatch.backend import Backend, Host
from agent_backend.dispatch.leases import LeaseTable
from agent_backend.dispatch.result import ToolResult
from agent_backend.dispatch.running import CallLike, as_tool_call, gather
from agent_backend.dispatch.snapshot import Snapshot
from agent_backend.dispatch.workspaces import SessionWorkspaces
from agent_backend.errors import PoolBusy, PoolClosed, PoolError
from agent_backend.lifecycle import AsyncResource
from agent_backend.tools import ToolCall

if TYPE_CHECKING:
    from agent_backend.dispatch.dispatcher import Dispatcher

__all__ = ["Session", "SessionSupport", "close_sessions"]

# Calls one session may have in flight at once (a guard, not a tuning knob). Past it a call
# is refused with PoolBusy, which asks the caller to retry after this many seconds.
_SESSION_CAPACITY = 1024
_BUSY_RETRY_AFTER = 1.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SessionSupport:
    """All a :class:`Session` uses of its dispatcher; the dispatcher makes one for its sessions."""

    sessions: LeaseTable[Session]
    """The dispatcher's open sessions; each call holds a lease on its own (the reaper
    takes only sessions that hold none)."""
    run: Callable[[ToolCall, float | None, SessionWorkspaces], Awaitable[ToolResult]]
    """Run one call (with the caller's timeout, or None) in these workspaces."""
    check_usable: Callable[[], None]
    """Raise :class:`PoolClosed` once the dispatcher is closed."""
    pools: Mapping[str, Backend]
    default_pool: str
    workspace_timeout: float
    """Seconds making or removing one workspace may take."""
    close_wait: float
    """Seconds closing waits for the session's cancelled calls to end."""


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

    def __init__(self, dispatcher: Dispatcher, session_id: str, support: SessionSupport) -> None:
        self.dispatcher = dispatcher
        self.id = session_id
        self._support = support
        self._state: Literal["new", "open", "closed"] = "new"
        self._reason = ""
        self._workspaces = SessionWorkspaces(session_id, timeout=support.workspace_timeout)
        self._calls: set[anyio.CancelScope] = set()
        self._calls_done: anyio.Event | None = None
        self._closed = anyio.Event()

    @property
    def host(self) -> Host | None:
        """The host of the session's workspace on the default pool; None before one is made."""
        made = self._workspaces.get(self._support.default_pool)
        return made.host if made is not None else None

    @property
    def workspace(self) -> str | None:
        """The real path of the session's workspace on the default pool (on :attr:`host`)."""
        made = self._workspaces.get(self._support.default_pool)
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
        """Open the session; one open already (a fork) is entered as it is, to be closed on exit."""
        if self._state != "open":
            await self.open()
        return self

    async def open(self) -> None:
        """Register the session for reaping (and, with one pool of hosts, make its workspace)."""
        if self._state != "new":
            raise PoolError(f"session {self.id} can be opened once (it is {self._state})")
        support = self._support
        support.check_usable()
        pool = support.pools[support.default_pool]
        if len(support.pools) == 1 and pool.hosts:
            try:
                await self._workspaces.ensure(support.default_pool, pool)
                support.check_usable()
            except BaseException:
                self._mark_closed("failed to open")
                await self._finish_close()
                raise
        support.sessions.add(self, capacity=_SESSION_CAPACITY)
        self._state = "open"

    def _mark_closed(self, reason: str) -> None:
        """Refuse new calls and end the ones in flight; synchronous (the I/O is in _finish_close)."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._reason = reason
        self._workspaces.close()
        self._support.sessions.remove(self)
        for scope in self._calls:
            scope.cancel()

    async def _finish_close(self) -> None:
        """Wait (bounded) for cancelled calls to end, then remove the workspaces; shielded."""
        with anyio.CancelScope(shield=True):
            try:
                if self._calls:
                    self._calls_done = anyio.Event()
                    with anyio.move_on_after(self._support.close_wait):
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

    # -- forks and snapshots ----------------------------------------------------------------------

    def _between_calls(self, what: str) -> None:
        if self._state != "open":
            raise self._refusal()
        if self._calls:
            raise PoolError(
                f"session {self.id} has {len(self._calls)} call(s) in flight: {what} it between "
                "calls"
            )

    async def fork(self, n: int) -> list[Session]:
        """``n`` new open sessions whose workspaces start as copies of this session's, made
        between calls (the host's :meth:`~agent_backend.dispatch.backend.Host.fork_workspace`:
        copy-on-write where it can, in the same time whatever the workspace's size).

        Every workspace the session has made so far is forked (one per pool); a
        fork makes the others on first use, as any session does. From then on
        each is independent: writes in one reach neither the others nor this
        session, which goes on. Each fork is a session of the same dispatcher,
        reaped and closed as any other; close them (``async with`` each, or
        ``aclose()``). A rollout group starts its episodes from one prepared
        workspace this way. Raises :class:`~agent_backend.errors.PoolError`
        while a call is in flight, what the host raises where it cannot fork.
        """
        if not 1 <= n <= _SESSION_CAPACITY:
            raise ValueError(f"n must be between 1 and {_SESSION_CAPACITY}, not {n}")
        self._between_calls("fork")
        children = [self.dispatcher.session() for _ in range(n)]
        try:
            # Shielded: a cancellation cannot lose workspaces the hosts made.
            with anyio.CancelScope(shield=True):
                for workspace in self._workspaces.ready():
                    assert workspace.path is not None
                    paths = await workspace.host.fork_workspace(workspace.path, n)
                    for child, path in zip(children, paths, strict=True):
                        child._workspaces.adopt(workspace.pool, workspace.host, path)
            for child in children:
                await child.open()
        except BaseException:
            with anyio.CancelScope(shield=True):
                for child in children:
                    if child._state == "new":
                        child._state, child._reason = "closed", "its fork failed"
                        await child._workspaces.remove_all()
                    else:
                        await child.aclose()
            raise
        return children

    async def snapshot(self, *, pool: str | None = None) -> Snapshot:
        """The session's workspace on ``pool`` (None: the default pool) frozen as it is now,
        for grading: :meth:`Snapshot.run` runs a grader on it with private assets
        (:mod:`agent_backend.dispatch.snapshot`). Taken between calls; the session goes on.
        """
        self._between_calls("snapshot")
        name = pool if pool is not None else self._support.default_pool
        workspace = self._workspaces.get(name)
        if workspace is None or workspace.path is None:
            raise PoolError(f"session {self.id} has no workspace on pool {name!r} to snapshot")
        with anyio.CancelScope(shield=True):
            handle = await workspace.host.snapshot_workspace(workspace.path)
        return Snapshot(workspace.host, handle, session=self.id)

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
        """Run one call in this session's workspace, on its host.

        Raises :class:`~agent_backend.errors.PoolBusy` (nothing run) when the session
        already has 1024 calls in flight; retry after its ``retry_after``.
        """
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
        sessions = self._support.sessions
        try:
            lease = sessions.acquire_on(self, object())
        except PoolBusy as full:
            # What the caller (and, over MCP, the model) reads: no repr, no workspace path.
            raise PoolBusy(
                f"this session already has {full.limit} calls in flight, the most one session "
                f"may hold; nothing was run: retry in {_BUSY_RETRY_AFTER:g} s, when some have "
                "finished",
                limit=full.limit,
                retry_after=_BUSY_RETRY_AFTER,
            ) from None
        try:
            with anyio.CancelScope() as scope:
                self._calls.add(scope)
                try:
                    return await self._support.run(call, timeout, self._workspaces)
                finally:
                    self._calls.discard(scope)
                    if not self._calls and self._calls_done is not None:
                        self._calls_done.set()
            raise PoolClosed(
                f"session {self.id} was closed while call {call.id!r} ran ({self._reason})"
            )
        finally:
            sessions.release(lease)


async def close_sessions(sessions: Sequence[Session], reason: str) -> None:
    """Close ``sessions`` for ``reason``: all refuse calls at once, then close together, shielded.

    The refusing is done before this coroutine first awaits: called right
    after the sessions were taken from the table, no call can slip in.
    """
    for session in sessions:
        session._mark_closed(reason)
    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as closing:
            for session in sessions:
                closing.start_soon(session._finish_close)
