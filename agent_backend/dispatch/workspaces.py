"""A session's workspaces, one per pool, each made the first time a call needs it.

A :class:`~agent_backend.dispatch.Session` over several pools (an SSH pool
for shell tools, a Ray pool for a reward model) holds one
:class:`SessionWorkspaces`: the workspace on a host of pool ``cmd`` is made
at the first call routed to ``cmd``, so a session that only calls Ray tools
makes none. On the session's close every workspace is removed together,
shielded from cancellation, each bounded in time; one that fails to go is
logged and never keeps the others.

Also :func:`in_pool`: a pool's failures, raised as errors that name the pool
(a pool that is down, not started or closed, is
:class:`~agent_backend.errors.BackendUnavailable` with ``pool`` set).

This module must never leave a workspace it made unrecorded, nor one made
after the session closed in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import anyio
import anyio.lowlevel

from agent_backend.dispatch.backend import Backend, Host
from agent_backend.errors import BackendError, BackendUnavailable, PoolClosed, PoolError

__all__ = ["SessionWorkspaces", "Workspace", "in_pool"]

logger = logging.getLogger("agent_backend.dispatch")


@contextlib.contextmanager
def in_pool(name: str, backend: Backend) -> Iterator[None]:
    """Raise what ``backend`` raises inside as errors naming pool ``name``.

    A backend error gets ``pool`` set; a backend used while down (not
    started: ``PoolError``; closed: ``PoolClosed``; unreachable:
    ``BackendUnavailable``) becomes ``BackendUnavailable`` whose message
    names the pool. Wrap only calls into the backend: a session's own
    refusals are not a pool's.
    """
    try:
        yield
    except BackendUnavailable as exc:
        if exc.pool is not None:
            raise
        raise BackendUnavailable(
            f"pool {name!r} ({backend.kind}) is unavailable: {exc.message}",
            backend=exc.backend or backend.kind,
            host=exc.host,
            pool=name,
        ) from exc
    except BackendError as exc:
        if exc.pool is None:
            exc.pool = name
        raise
    except PoolError as exc:
        raise BackendUnavailable(
            f"pool {name!r} ({backend.kind}) is down: {exc.message}",
            backend=backend.kind,
            pool=name,
        ) from exc


@dataclasses.dataclass(slots=True)
class Workspace:
    """One workspace of a session: on ``host``, of pool ``pool``."""

    pool: str
    host: Host
    made: str
    """What ``make_workspace`` returned: what is removed."""
    path: str | None = None
    """Its path on the host (``made``, a real path) once it is ready; calls run here."""


class SessionWorkspaces:
    """The workspaces of one session by pool name; made on first use, removed together."""

    def __init__(self, owner: str, *, timeout: float) -> None:
        self._owner = owner
        self._timeout = timeout
        self._made: dict[str, Workspace] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._closed = False

    def __repr__(self) -> str:
        return " ".join(f"{w.host.name}:{w.path}" for w in self.ready())

    def ready(self) -> list[Workspace]:
        """The workspaces calls can run in now."""
        return [w for w in self._made.values() if w.path is not None]

    def get(self, pool: str) -> Workspace | None:
        """The ready workspace on pool ``pool``, if one was made."""
        workspace = self._made.get(pool)
        return workspace if workspace is not None and workspace.path is not None else None

    async def ensure(self, pool: str, backend: Backend) -> Workspace:
        """The workspace on pool ``pool``, made on its least-loaded host if there is none yet."""
        ready = self.get(pool)
        if ready is not None:
            return ready
        # One make per pool. fast_acquire: a free lock is taken without a trip through the
        # event loop, which beside a busy server cost an episode's open tens of ms.
        async with self._locks.setdefault(pool, anyio.Lock(fast_acquire=True)):
            ready = self.get(pool)
            if ready is not None:
                return ready
            if self._closed:
                raise PoolClosed(f"session {self._owner} is closed")
            with in_pool(pool, backend):
                return await self._make(pool, backend)

    async def _make(self, pool: str, backend: Backend) -> Workspace:
        host = backend.pick_host()
        # Shielded, so that a cancellation cannot lose a workspace the host made;
        # bounded, so that a host that does not answer cannot hold us forever.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self._timeout) as limit:
                made = await host.make_workspace()
            if limit.cancelled_caught:
                raise BackendUnavailable(
                    f"{host.name} did not create a workspace within {self._timeout:g} s",
                    backend=backend.kind,
                    host=host.name,
                )
            workspace = Workspace(pool, host, made)
            self._made[pool] = workspace
            if self._closed:  # closed while the host made it: it goes at once
                await self._remove(workspace)
                raise PoolClosed(f"session {self._owner} was closed while its workspace was made")
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove(workspace)
            raise
        workspace.path = made  # already real: make_workspace returns a symlink-free path
        return workspace

    def adopt(self, pool: str, host: Host, path: str) -> None:
        """Take ``path``, a ready workspace ``host`` made (a fork), as this session's on
        ``pool``: removed with the others. Synchronous; before the session's first call."""
        if pool in self._made:
            raise PoolError(f"session {self._owner} has a workspace on pool {pool!r} already")
        self._made[pool] = Workspace(pool, host, path, path)

    def close(self) -> None:
        """Make no workspace from now on (synchronous; :meth:`remove_all` does the I/O)."""
        self._closed = True

    async def remove_all(self) -> None:
        """Remove every workspace, concurrently, shielded; failures are logged, never raised."""
        self._closed = True
        workspaces = list(self._made.values())
        with anyio.CancelScope(shield=True):
            if len(workspaces) == 1:  # the common case: no task to start and wait for
                await self._remove(workspaces[0])
                return
            async with anyio.create_task_group() as group:
                for workspace in workspaces:
                    group.start_soon(self._remove, workspace)

    async def _remove(self, workspace: Workspace) -> None:
        if self._made.get(workspace.pool) is not workspace:
            return  # removed already
        del self._made[workspace.pool]
        try:
            with anyio.move_on_after(self._timeout) as limit:
                await workspace.host.remove_workspace(workspace.made)
            if limit.cancelled_caught:
                logger.warning(
                    "%s: removing workspace %s timed out", workspace.host.name, workspace.made
                )
        except Exception:
            # Never raised: closing goes on for the other workspaces and sessions.
            logger.warning(
                "session %s: removing its workspace on %s failed",
                self._owner,
                workspace.host.name,
                exc_info=True,
            )
