"""The SSH backend: a pool of SSH hosts, their lifecycle, their background work in one group.

Every host's background work (connectors, reaper, probes, the owner lock)
runs in the backend's :class:`~agent_backend.lifecycle.BackgroundTasks`.
Stopping (:meth:`SSHBackend.aclose`) first marks every host closing (no
connector starts, a connector that finishes closes its connection instead of
adding it), ends the calls in flight (their remote processes are killed),
cancels background work and waits for it, then closes every connection, once. The one
connection it may still open is a single short one per host to remove
workspaces and kill orphans when no pooled connection is left.

This module must never leave background work running after ``aclose()``, nor
start a pool connection after stop began.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

import anyio

from agent_backend.backends.ssh.config import (
    SSHHostConfig,
    SSHPoolConfig,
    SSHStatistics,
    walls_differ,
)
from agent_backend.backends.ssh.host import SSHHost
from agent_backend.backends.ssh.walls import ssh_guarantees
from agent_backend.dispatch.backend import Backend
from agent_backend.errors import BackendUnavailable, ConfigError, PoolClosed, PoolError
from agent_backend.lifecycle import BackgroundTasks
from agent_backend.sandbox import Guarantees

__all__ = ["SSHBackend"]


class SSHBackend(Backend):
    """A pool of SSH hosts: ``async with SSHBackend.from_config(cfg) as backend:``."""

    kind: ClassVar[str] = "ssh"

    def __init__(self, hosts: Sequence[SSHHostConfig], *, close_timeout: float = 10.0) -> None:
        if not hosts:
            raise ConfigError(
                "an SSH pool needs at least one host", key="hosts", expected="one or more hosts"
            )
        different = walls_differ(hosts)
        if different is not None:
            raise ConfigError(
                different, key="isolation", expected="the same isolation and limits on every host"
            )
        self._hosts = tuple(SSHHost(config) for config in hosts)
        self._close_timeout = close_timeout
        self._state: Literal["new", "starting", "open", "closing", "closed"] = "new"
        self._closed = anyio.Event()
        self._background = BackgroundTasks("agent-backend ssh pool")

    @classmethod
    def from_config(cls, config: SSHPoolConfig) -> SSHBackend:
        return cls(config.hosts, close_timeout=config.close_timeout)

    @property
    def hosts(self) -> Sequence[SSHHost]:
        return self._hosts

    def is_closed(self) -> bool:
        return self._state in ("closing", "closed")

    def statistics(self) -> SSHStatistics:
        return SSHStatistics(
            hosts=tuple(h.statistics() for h in self._hosts),
            closed=self.is_closed(),
            guarantees=self._guarantees(),
        )

    def _guarantees(self) -> Guarantees:
        config = self._hosts[0].config  # every host has the same walls (checked at __init__)
        return ssh_guarantees(config.isolation, config.limits)

    def guarantees(self) -> list[str]:
        return self._guarantees().lines()

    def __repr__(self) -> str:
        s = self.statistics()
        state = " closed" if s.closed else ""
        return (
            f"<SSHBackend {len(self._hosts)} hosts [leases: {s.leases_active} active,"
            f" {s.leases_queued} queued | conns: {s.connections_open} open, {s.connections_idle} idle]{state}>"
        )

    def pick_host(self) -> SSHHost:
        """The least-loaded host that is up, preferring hosts not suspect.

        A host that just lost its connections, or whose last handshake failed, is still up
        (it may come back at once) but would make a call wait a handshake that may time out;
        while another host is healthy, calls go there. Least-loaded alone would even prefer
        it: calls to a broken host fail fast, so it always looks idle.
        """
        up = [host for host in self._hosts if host.is_up()]
        if not up:
            raise BackendUnavailable(f"no {self.kind} host is up", backend=self.kind)
        healthy = [host for host in up if not host.is_suspect()] or up
        return min(healthy, key=lambda host: host.calls_in_flight())

    async def start(self) -> None:
        if self._state != "new":
            if self.is_closed():
                raise PoolClosed("the SSH backend is closed")
            raise PoolError("the SSH backend is already started")
        self._state = "starting"
        # Not the caller's task group: aclose() may be called from any task and any cancel
        # scope; it stops the background work and waits for it: nothing outlives it.
        await self._background.open()
        for host in self._hosts:
            await host._start(self._background)
        if self._state == "starting":
            self._state = "open"

    async def aclose(self) -> None:
        """End calls in flight, stop background work, close every connection; idempotent."""
        if self._state == "closed":
            return
        if self._state == "closing":
            await self._closed.wait()
            return
        self._state = "closing"
        failure: BaseException | None = None
        try:
            with anyio.CancelScope(shield=True):
                for host in self._hosts:
                    host._begin_close()
                with anyio.move_on_after(self._close_timeout):
                    for host in self._hosts:
                        await host._wait_calls()
                try:
                    await self._background.aclose()
                except BaseException as exc:  # a background task failed: raised once all is closed
                    failure = exc
                async with anyio.create_task_group() as closers:
                    for host in self._hosts:
                        closers.start_soon(host._shutdown)
        finally:
            self._state = "closed"
            self._closed.set()
        if failure is not None:
            raise failure
