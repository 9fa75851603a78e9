"""One host's connection pool: the lease/reap/reconnect state machine.

The bookkeeping is a :class:`~agent_backend.dispatch.leases.LeaseTable`
(capacity = channels per connection): every call holds a lease on the
connection its channel runs on (the busiest connection that has room: packing
measured ~9% more calls/s than spreading at 8 callers, and lets surplus
connections go idle and be reaped), and the reaper closes only connections the
table hands back, which by construction hold no lease, have been idle past
``idle_ttl`` since their *last lease ended*, and are still the very object
registered. Every state change is synchronous (one event loop, no awaits in
between); connection I/O happens after, through the :class:`Connector`,
shielded from cancellation (the httpcore shape).

::

    callers ──► lease() ──► LeaseTable.acquire()  ── lease ──► the caller's channel
                   │ none free
                   ▼
              FIFO waiters ◄── _assign() on every release, connection added or lost
                   │
                   ▼
        demand > connecting x capacity and open + connecting < max_connections
                   │
                   ▼
              connector task ──► HandshakeRamp (≤ max_concurrent_handshakes, handshake_interval,
                                 backoff after failures) ──► Connector.connect()
                   │ ok: LeaseTable.add()             │ failed, nothing open: waiters get
                   ▼                                  ▼ BackendUnavailable; after
              waiters served                            down_after_failures: host down, probed

Reconnects are single-flight by accounting: callers that find a connection dead
(it leaves the table once, in :meth:`ConnectionPool._on_connection_lost`) queue
as waiters, and connectors are started only for demand that connections already
being opened will not cover. The one connector started without demand is the
recheck after the *last* connection was lost: until it reconnects or the host is
marked down, the host is suspect (:meth:`ConnectionPool.is_suspect`) and placement
prefers other hosts, so that a host whose network went silent is found out by the
pool rather than by the next calls sent to it.

This module knows no SSH: it must never do transport I/O itself (only through
its connector), close a connection that holds a lease, add a connection after
stop began, or hand out a connection that left the table.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Literal, Protocol, TypeVar

import anyio

from agent_backend.backends._errors import describe
from agent_backend.backends.ssh.background import Background
from agent_backend.backends.ssh.config import SSHHostSettings
from agent_backend.backends.ssh.ramp import HandshakeRamp
from agent_backend.dispatch.leases import Lease, LeaseTable
from agent_backend.errors import BackendUnavailable, PoolClosed, PoolError
from agent_backend.lifecycle import TaskStarter

__all__ = ["CAPACITY_COOLDOWN", "ConnectionPool", "Connector", "PooledConnection"]

logger = logging.getLogger("agent_backend.backends.ssh")

CAPACITY_COOLDOWN = 10.0
"""Seconds a capacity lowered after a channel refusal stays lowered."""


class PooledConnection:
    """What the pool knows of one connection; its identity is its key in the lease table.

    The transport (an asyncssh connection, or a test's stand-in) lives in a subclass,
    which reports its death through the callback given to :meth:`watch`.
    """

    __slots__ = ("lost", "open_channels", "refused_in_a_row", "restore_at", "serial")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.lost = False
        """The pool saw it die (it left the table)."""
        self.open_channels = 0
        self.refused_in_a_row = 0
        """Channel opens refused since the last one that succeeded."""
        self.restore_at: float | None = None
        """When a capacity lowered after a channel refusal goes back up."""

    def watch(self, on_lost: Callable[[Exception | None], None] | None) -> None:
        """Call ``on_lost`` (synchronously) when the transport dies; None stops watching."""
        raise NotImplementedError

    def has_died(self) -> bool:
        """The transport died already (perhaps before it was watched)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        state = "lost" if self.lost else "open"
        return f"<SSHConnection #{self.serial} {state}, {self.open_channels} channels>"


C = TypeVar("C", bound=PooledConnection)


class Connector(Protocol[C]):
    """The pool's only way to do connection I/O."""

    async def connect(self) -> C:
        """One handshake, not retried; raises :class:`BackendUnavailable`."""
        ...

    async def close(self, connection: C) -> None:
        """Close a connection that left the table (bounded; the pool shields it)."""
        ...

    def is_fatal(self, exc: BackendUnavailable) -> bool:
        """A failed handshake that retrying cannot fix (host key, authentication)."""
        ...


class _Waiter(Generic[C]):
    __slots__ = ("error", "event", "lease", "owner")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.event = anyio.Event()
        self.lease: Lease[C] | None = None
        self.error: Exception | None = None


class ConnectionPool(Generic[C]):
    """Connections to one host, leased per call. Driven by its host."""

    def __init__(
        self,
        name: str,
        settings: SSHHostSettings,
        connector: Connector[C],
        *,
        on_added: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.settings = settings
        self.connector = connector
        """Public so that tests can watch what the pool closes."""
        self.capacity = settings.max_channels_per_connection
        self.state: Literal["new", "open", "closing", "closed"] = "new"
        self.closing = anyio.Event()
        """Set when stop begins: wakes calls sleeping in a retry backoff."""
        self._on_added = on_added
        self._clock = clock
        self._table: LeaseTable[C] = LeaseTable(idle_ttl=settings.idle_ttl or None, clock=clock)
        self._waiters: deque[_Waiter[C]] = deque()
        self.connecting = 0
        """Connector tasks started and not finished."""
        self.background = Background(name, self.is_open)
        """Where the pool's (and its host's) background work starts."""
        self._ramp = HandshakeRamp(name, settings)
        self._to_close: list[C] = []
        self.down = False
        self.lost_last = False
        """The last open connection was lost, and none has been opened since."""
        self._rechecking = False
        self.consecutive_failures = 0
        self.last_error = ""
        self.connections_lost = 0
        self.connections_reaped = 0
        self.channel_refusals = 0

    # -- predicates ---------------------------------------------------------------------------

    @property
    def table(self) -> LeaseTable[C]:
        """The lease table (read it; change it only through the pool)."""
        return self._table

    def is_open(self) -> bool:
        return self.state == "open"

    def queued(self) -> int:
        return len(self._waiters)

    def is_suspect(self) -> bool:
        """Not marked down, but nothing is open and the last connection died or the last
        handshake failed: placement prefers other hosts until this one answers again."""
        return (
            not self.down and not self._table and (self.lost_last or self.consecutive_failures > 0)
        )

    def check_usable(self) -> None:
        if self.state in ("closing", "closed"):
            raise PoolClosed(f"{self.name} is closed")
        if self.state == "new":
            raise PoolError(f"{self.name} is not started: use the backend in `async with` first")
        if self.down:
            raise BackendUnavailable(
                f"{self.name} is down after {self.consecutive_failures} failed connection attempts"
                f" ({self.last_error}); probing every {self.settings.probe_interval:g} s",
                backend="ssh",
                host=self.name,
            )

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, tasks: TaskStarter) -> None:
        if self.state != "new":
            raise PoolClosed(f"{self.name} was closed while starting")
        self.state = "open"
        self.background.attach(tasks)
        if self._table.idle_ttl is not None:
            self.background.spawn(self._reap_forever, "reaper")

    def begin_close(self) -> None:
        """Synchronously: refuse new leases and connections, fail waiters."""
        self.state = "closing"
        self._to_close.extend(self._table.close())
        self.closing.set()
        self._fail_waiters(lambda: PoolClosed(f"{self.name} is closing"))

    def take_all(self) -> list[C]:
        """After background work ended: unregister and return every connection to close."""
        connections = [*self._to_close, *self._table.drained()]
        self._to_close = []
        for connection in self._table.resources():  # calls that would not end in time
            self._table.remove(connection)
            connections.append(connection)
        for connection in connections:
            connection.watch(None)
        self.connecting = 0  # no connector runs any more
        return connections

    # -- leases -------------------------------------------------------------------------------

    def try_acquire(self, owner: object) -> Lease[C] | None:
        """A free slot at once, unless someone is queued (FIFO: nobody overtakes)."""
        return None if self._waiters else self._table.acquire(owner, pack=True)

    async def lease(self, owner: object) -> Lease[C]:
        self.check_usable()
        lease = self.try_acquire(owner)
        if lease is not None:
            return lease
        waiter: _Waiter[C] = _Waiter(owner)
        self._waiters.append(waiter)
        self._assign()
        try:
            await waiter.event.wait()
        except BaseException:
            # Cancelled or timed out while queued: leave the queue (or give back a
            # slot granted in the meantime) and rebalance before re-raising.
            if waiter.lease is not None:
                self.release(waiter.lease)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        if waiter.error is not None:
            raise waiter.error
        assert waiter.lease is not None
        return waiter.lease

    def release(self, lease: Lease[C]) -> None:
        """End a lease; a stale or foreign one raises LeaseError and changes nothing."""
        self._table.release(lease)
        connection = lease.resource
        if connection.restore_at is not None and self._clock() >= connection.restore_at:
            connection.restore_at = None
            if self._table.is_registered(connection):
                self._table.set_capacity(connection, self.capacity)
        if self.state == "open":
            self._assign()

    def channel_opened(self, connection: C) -> None:
        """A channel opened on ``connection``: its refusals so far were transient."""
        connection.refused_in_a_row = 0

    def channel_refused(self, connection: C, reason: str) -> None:
        """The host refused a channel: after a second refusal in a row, carry at most the
        channels open now, for a while.

        Either sshd's MaxSessions is below max_channels_per_connection, or sshd has
        not yet freed sessions that were just closed (it frees them lazily). The
        latter is transient and common under load (a few in a thousand opens at 64
        callers); lowering the capacity for it cost a slot per refusal for
        :data:`CAPACITY_COOLDOWN` seconds, about a tenth of the throughput. So one
        refusal only makes the call retry; a limit that is real refuses the retry
        too, and the second refusal in a row (with no open in between) lowers the
        capacity. It is restored after the cooldown; if the limit is real, the next
        refusals lower it again.
        """
        self.channel_refusals += 1
        connection.refused_in_a_row += 1
        open_now = connection.open_channels
        if not self._table.is_registered(connection) or open_now < 1:
            return
        if connection.refused_in_a_row < 2:
            return
        capacity = self._table.capacity_of(connection)
        connection.restore_at = self._clock() + CAPACITY_COOLDOWN
        if open_now < capacity:
            self._table.set_capacity(connection, open_now)
            logger.info(
                "%s: sshd refused a channel with %d open (%s); connection #%d carries at most %d"
                " for %g s (if this repeats, max_channels_per_connection is above sshd's MaxSessions)",
                self.name,
                open_now,
                reason,
                connection.serial,
                open_now,
                CAPACITY_COOLDOWN,
            )

    def _assign(self) -> None:
        """Hand free slots to waiters in order; start connectors for the demand left over."""
        waiters = self._waiters
        if self._table.closed:
            return
        while waiters:
            lease = self._table.acquire(waiters[0].owner, pack=True)
            if lease is None:
                break
            waiter = waiters.popleft()
            waiter.lease = lease
            waiter.event.set()
        if not waiters or self.state != "open" or self.down or not self.background.is_attached():
            return
        demand = len(waiters) - self.connecting * self.capacity
        room = self.settings.max_connections - len(self._table) - self.connecting
        while demand > 0 and room > 0:
            self.connecting += 1
            demand -= self.capacity
            room -= 1
            self.background.spawn(self._connector, "connector")

    def _fail_waiters(self, make_error: Callable[[], Exception]) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.error = make_error()
            waiter.event.set()

    # -- background work ----------------------------------------------------------------------

    async def _connector(self) -> None:
        """Open one connection for queued demand (never raises: it runs in the task group)."""
        try:
            try:
                connection = await self._ramp.connect(
                    self.connector.connect, is_fatal=self.connector.is_fatal, is_open=self.is_open
                )
            finally:
                self.connecting -= 1
        except PoolClosed:
            return
        except BackendUnavailable as exc:
            self._on_connect_failure(exc)
            return
        except Exception as exc:  # a bug must not take the task group (and the pool) down
            logger.exception("%s: connector failed", self.name)
            self._on_connect_failure(
                BackendUnavailable(describe(exc), backend="ssh", host=self.name)
            )
            return
        await self._adopt(connection)

    async def _adopt(self, connection: C) -> None:
        if self.state != "open":  # stop began during the handshake: never add it
            with anyio.CancelScope(shield=True):
                await self.connector.close(connection)
            return
        self._table.add(connection, capacity=self.capacity)
        connection.watch(functools.partial(self._on_connection_lost, connection))
        self.consecutive_failures = 0
        self.lost_last = False
        self._ramp.succeeded()
        if connection.has_died():
            self._on_connection_lost(connection, None)
        self._assign()
        self._on_added()

    def _on_connect_failure(self, exc: BackendUnavailable) -> None:
        self.consecutive_failures += 1
        self.last_error = exc.message
        if self.state != "open":
            return
        nothing_open = not self._table and self.connecting == 0
        if nothing_open and self.consecutive_failures >= self.settings.down_after_failures:
            self._mark_down()
        elif nothing_open:
            self._fail_waiters(
                lambda: BackendUnavailable(exc.message, backend="ssh", host=self.name)
            )
            self._recheck_if_unattended()
        else:
            self._assign()

    def _mark_down(self) -> None:
        self.down = True
        logger.warning(
            "%s: marked down after %d failed connection attempts (%s); probing every %g s",
            self.name,
            self.consecutive_failures,
            self.last_error,
            self.settings.probe_interval,
        )
        self._fail_waiters(
            lambda: BackendUnavailable(
                f"{self.name} is down: {self.last_error}", backend="ssh", host=self.name
            )
        )
        self.background.spawn(self._probe_until_up, "probe")

    async def _probe_until_up(self) -> None:
        # Probes start probe_interval apart (start to start): a probe that hangs until its
        # connect timeout on a silent network does not push the next one back, so a host
        # whose network returns is up within probe_interval plus one handshake.
        next_probe = self._clock() + self.settings.probe_interval
        while self.is_open() and self.down:
            await anyio.sleep(max(0.0, next_probe - self._clock()))
            next_probe = self._clock() + self.settings.probe_interval
            if not self.is_open():
                return
            try:
                connection = await self.connector.connect()
            except BackendUnavailable as exc:
                self.last_error = exc.message
                continue
            except Exception:
                logger.exception("%s: probe failed", self.name)
                continue
            self.down = False
            logger.warning("%s: reachable again, marked up", self.name)
            await self._adopt(connection)
            return

    def _on_connection_lost(self, connection: C, exc: Exception | None) -> None:
        connection.lost = True
        # Only the registered object leaves the table, once: a stale callback of an
        # old connection can never remove (or close) a newer one.
        if self._table.remove(connection):
            self.connections_lost += 1
            logger.info("%s: connection #%d lost: %s", self.name, connection.serial, exc)
            if self.state == "open":
                if not self._table:
                    self.lost_last = True
                self._assign()
                self._recheck_if_unattended()

    def _recheck_if_unattended(self) -> None:
        """The last connection died and nobody is reconnecting: find out whether the host is
        still there now, rather than when the next call has to (which could be never: a host
        that nothing reaches would stay up, and a call sent there would wait a handshake)."""
        if (
            self.lost_last
            and not self._table
            and self.connecting == 0
            and not self.down
            and not self._rechecking
            and self.background.is_attached()
        ):
            self._rechecking = True
            self.background.spawn(self._recheck, "recheck")

    async def _recheck(self) -> None:
        """Reconnect after a loss until a connection is open or the host is marked down."""
        try:
            while self.is_open() and not self.down and self.lost_last and not self._table:
                if self.connecting:  # connectors for queued calls are on it already
                    return
                self.connecting += 1
                await self._connector()
        finally:
            self._rechecking = False

    async def reap_idle(self) -> int:
        """Close the connections idle past ``idle_ttl`` (only unleased, still-registered ones)."""
        reaped = self._table.reap()
        for connection in reaped:
            self.connections_reaped += 1
            logger.debug("%s: closing idle connection #%d", self.name, connection.serial)
            with anyio.CancelScope(shield=True):
                await self.connector.close(connection)
        return len(reaped)

    async def _reap_forever(self) -> None:
        ttl = self._table.idle_ttl
        assert ttl is not None
        while True:
            expiry = self._table.next_expiry()
            delay = ttl / 2 if expiry is None else min(ttl / 2, expiry - self._clock())
            await anyio.sleep(max(delay, 0.005))
            await self.reap_idle()
