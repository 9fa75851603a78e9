"""A :class:`Snapshot`: a session's workspace frozen for grading, and graders run on it.

``snapshot = await session.snapshot()`` freezes the workspace as it is (the
host's :meth:`~agent_backend.dispatch.backend.Host.snapshot_workspace`); the
session goes on, and nothing it does afterwards reaches the snapshot.
``await snapshot.run(command, assets=[...])`` runs a grader in a fresh
workspace made from the snapshot, with private assets (hidden tests) shown
read-only that the session's own sandbox never saw
(:meth:`~agent_backend.dispatch.backend.Host.run_on_snapshot`). A snapshot
outlives its session (grade after the episode has closed) and is removed by
``aclose()``, or with its backend.

This module must never touch a session: it holds the host and the handle only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio

from agent_backend.dispatch.backend import Command, CommandResult, Host
from agent_backend.errors import PoolClosed
from agent_backend.lifecycle import AsyncResource

__all__ = ["Snapshot"]


class Snapshot(AsyncResource):
    """A frozen copy of a workspace on ``host``; ``async with`` it, or ``aclose()`` it."""

    def __init__(self, host: Host, handle: str, *, session: str) -> None:
        self.host = host
        self.handle = handle
        """The host's name for it (a path on the host)."""
        self.session = session
        """The id of the session it was taken from."""
        self._closed = False

    def __repr__(self) -> str:
        state = " removed" if self._closed else ""
        return f"<Snapshot of {self.session} on {self.host.name}{state}>"

    def is_closed(self) -> bool:
        return self._closed

    async def run(
        self,
        command: str | Sequence[str],
        *,
        assets: Sequence[str] = (),
        timeout: float = 600.0,  # noqa: ASYNC109 - the grader's limit, enforced by the host
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        output_limit: int = 65536,
    ) -> CommandResult:
        """Run a grader on the snapshot: ``command`` (a shell line, or an argv) in a fresh
        workspace that starts as the snapshot, with the host paths ``assets`` read-only in
        ``$GRADER_ASSETS``. Its writes reach neither the snapshot nor the session."""
        if self._closed:
            raise PoolClosed(f"the snapshot of session {self.session} was removed")
        shell, argv = (command, None) if isinstance(command, str) else (None, tuple(command))
        spec = Command(
            argv=argv,
            shell=shell,
            env=dict(env or {}),
            stdin=stdin,
            timeout=timeout,
            output_limit=output_limit,
        )
        return await self.host.run_on_snapshot(self.handle, spec, assets=tuple(assets))

    async def aclose(self) -> None:
        """Remove the snapshot from its host; idempotent, shielded."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.host.remove_snapshot(self.handle)
