"""A pure lease table: who holds which pooled resource, and which resources may be closed.

Pools (SSH connections, session workspaces) keep their bookkeeping here and
nowhere else. Every use of a resource is a :class:`Lease` with a unique token
and an owner; a resource is handed back for closing (by :meth:`LeaseTable.reap`,
:meth:`LeaseTable.close` or :meth:`LeaseTable.drained`) only when, at that
moment, it holds no lease and is still the very object registered under that
identity. The idle clock starts when the *last* lease ends, so a use longer
than the idle TTL is never reaped underneath its holder, and a resource a
sibling still uses is never closed under it.

This module must never do I/O, await, sleep, lock or close anything: it is
synchronous and called from one event loop, so each method is atomic. The
caller closes the resources it returns, outside the table and shielded from
cancellation (the httpcore shape: state change here, I/O after).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from agent_backend.errors import LeaseError, PoolBusy, PoolClosed, PoolError

__all__ = ["Lease", "LeaseStats", "LeaseTable"]

R = TypeVar("R")

# One counter for every table in the process: a token is never reused, so a
# lease from another table (or an old one) can never be mistaken for a live one.
_tokens = itertools.count(1)


@dataclasses.dataclass(frozen=True, slots=True)
class Lease(Generic[R]):
    """The right to use ``resource`` until released; held by ``owner``."""

    resource: R
    token: int
    """Unique per lease in this process, never reused."""
    owner: object


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseStats:
    """The table at one instant."""

    resources: int
    """Registered resources (leased or not)."""
    active_leases: int
    """Leases not yet released, including those on resources removed since."""
    idle: int
    """Registered resources holding no lease."""
    full: int
    """Registered resources with no free capacity."""
    free_slots: int
    """Leases that could be granted now without adding a resource."""
    draining: int
    """After :meth:`LeaseTable.close`: registered resources still leased."""
    closed: bool


class _Entry(Generic[R]):
    __slots__ = ("capacity", "idle_since", "leases", "registered", "resource")

    def __init__(self, resource: R, capacity: int, now: float) -> None:
        self.resource = resource
        self.capacity = capacity
        self.leases = 0
        self.idle_since = now
        self.registered = True


class LeaseTable(Generic[R]):
    """Resources keyed by identity, each with a capacity of concurrent leases.

    ``idle_ttl=None`` disables reaping. ``clock`` is injectable for tests.
    """

    def __init__(
        self, *, idle_ttl: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if idle_ttl is not None and idle_ttl < 0:
            raise ValueError("idle_ttl must be >= 0 or None")
        self._idle_ttl = idle_ttl
        self._clock = clock
        # Insertion order breaks load ties: the oldest resource is preferred, so
        # the newest ones go idle first and are reaped first when load falls.
        self._entries: dict[int, _Entry[R]] = {}
        self._leases: dict[int, tuple[Lease[R], _Entry[R]]] = {}
        self._drained: list[R] = []
        self._closed = False

    @property
    def idle_ttl(self) -> float | None:
        return self._idle_ttl

    @property
    def closed(self) -> bool:
        return self._closed

    # -- registration --------------------------------------------------------

    def add(self, resource: R, *, capacity: int) -> None:
        """Register ``resource``; its idle clock starts now."""
        if self._closed:
            raise PoolClosed("lease table is closed: no resource can be added")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if id(resource) in self._entries:
            raise PoolError(f"{resource!r} is already registered")
        self._entries[id(resource)] = _Entry(resource, capacity, self._clock())

    def remove(self, resource: R) -> bool:
        """Unregister ``resource`` (it died). Its outstanding leases stay valid to release.

        True if it was registered, so exactly one of several callers noticing
        the same death gets True and closes it.
        """
        entry = self._entries.pop(id(resource), None)
        if entry is None:
            return False
        entry.registered = False
        return True

    def set_capacity(self, resource: R, capacity: int) -> None:
        """Change how many leases ``resource`` may hold (leases beyond it stay until released)."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._registered(resource).capacity = capacity

    # -- leasing -------------------------------------------------------------

    def acquire(self, owner: object, *, pack: bool = False) -> Lease[R] | None:
        """A lease on the least-loaded registered resource with free capacity, else None.

        With ``pack``, the *most*-loaded one that still has room: resources fill up
        before load spreads, so that surplus ones go idle (and are reaped). Ties go
        to the oldest resource either way.
        """
        if self._closed:
            raise PoolClosed("lease table is closed")
        best: _Entry[R] | None = None
        for entry in self._entries.values():
            if entry.leases >= entry.capacity:
                continue
            if best is None or (entry.leases > best.leases if pack else entry.leases < best.leases):
                best = entry
                if not pack and entry.leases == 0:
                    break
        if best is None:
            return None
        return self._grant(best, owner)

    def acquire_on(self, resource: R, owner: object) -> Lease[R]:
        """A lease on this very resource (a session pins its host or workspace).

        Raises :class:`PoolBusy` when it holds ``capacity`` leases already.
        """
        if self._closed:
            raise PoolClosed("lease table is closed")
        entry = self._registered(resource)
        if entry.leases >= entry.capacity:
            # No repr: what a caller sees of it must not show the resource's internals (paths).
            raise PoolBusy(
                f"it holds {entry.capacity} leases, the most it may", limit=entry.capacity
            )
        return self._grant(entry, owner)

    def _grant(self, entry: _Entry[R], owner: object) -> Lease[R]:
        lease = Lease(entry.resource, next(_tokens), owner)
        entry.leases += 1
        self._leases[lease.token] = (lease, entry)
        return lease

    def release(self, lease: Lease[R]) -> None:
        """End ``lease``. A stale, foreign or repeated release raises and changes nothing."""
        found = self._leases.get(lease.token)
        if found is None:
            raise LeaseError(
                f"lease {lease.token} on a {type(lease.resource).__name__} is not active "
                "(already released, or never granted by this table)"
            )
        held, entry = found
        if held.resource is not lease.resource or held.owner is not lease.owner:
            raise LeaseError(f"lease {lease.token} is held by another owner or on another resource")
        del self._leases[lease.token]
        entry.leases -= 1
        if entry.leases == 0:
            # Idle time counts from the end of the last lease, never from its start.
            entry.idle_since = self._clock()
            if self._closed and entry.registered:
                del self._entries[id(entry.resource)]
                entry.registered = False
                self._drained.append(entry.resource)

    # -- closing -------------------------------------------------------------

    def reap(self) -> list[R]:
        """Unregister and return the resources idle for at least ``idle_ttl``."""
        if self._idle_ttl is None:
            return []
        deadline = self._clock() - self._idle_ttl
        expired = [
            entry
            for entry in self._entries.values()
            if entry.leases == 0 and entry.idle_since <= deadline
        ]
        for entry in expired:
            del self._entries[id(entry.resource)]
            entry.registered = False
        return [entry.resource for entry in expired]

    def close(self) -> list[R]:
        """Refuse new leases; unregister and return every resource holding none.

        Resources still leased are returned by :meth:`drained` once their last
        lease is released.
        """
        self._closed = True
        idle = [entry for entry in self._entries.values() if entry.leases == 0]
        for entry in idle:
            del self._entries[id(entry.resource)]
            entry.registered = False
        return [entry.resource for entry in idle]

    def drained(self) -> list[R]:
        """After :meth:`close`: resources whose last lease ended since the previous call."""
        drained, self._drained = self._drained, []
        return drained

    # -- predicates ----------------------------------------------------------

    def is_registered(self, resource: R) -> bool:
        entry = self._entries.get(id(resource))
        return entry is not None and entry.resource is resource

    def __len__(self) -> int:
        """Registered resources."""
        return len(self._entries)

    def active_leases(self) -> int:
        """Leases not yet released (on registered or removed resources)."""
        return len(self._leases)

    def resources(self) -> list[R]:
        """Registered resources, oldest first."""
        return [entry.resource for entry in self._entries.values()]

    def leases_of(self, resource: R) -> int:
        """Active leases on ``resource``, registered or removed since."""
        entry = self._entries.get(id(resource))
        if entry is not None and entry.resource is resource:
            return entry.leases
        return sum(1 for lease, _ in self._leases.values() if lease.resource is resource)

    def capacity_of(self, resource: R) -> int:
        return self._registered(resource).capacity

    def is_idle(self, resource: R) -> bool:
        """Registered and holding no lease."""
        entry = self._entries.get(id(resource))
        return entry is not None and entry.resource is resource and entry.leases == 0

    def has_expired(self, resource: R) -> bool:
        """Idle for at least ``idle_ttl`` since its last lease ended (or since it was added)."""
        if self._idle_ttl is None or not self.is_idle(resource):
            return False
        return self._clock() - self._entries[id(resource)].idle_since >= self._idle_ttl

    def next_expiry(self) -> float | None:
        """The clock time at which the next idle resource expires (None: none idle, or no TTL)."""
        if self._idle_ttl is None:
            return None
        times = [entry.idle_since for entry in self._entries.values() if entry.leases == 0]
        return min(times) + self._idle_ttl if times else None

    def statistics(self) -> LeaseStats:
        entries = self._entries.values()
        return LeaseStats(
            resources=len(self._entries),
            active_leases=len(self._leases),
            idle=sum(1 for entry in entries if entry.leases == 0),
            full=sum(1 for entry in entries if entry.leases >= entry.capacity),
            free_slots=sum(max(0, entry.capacity - entry.leases) for entry in entries),
            draining=sum(1 for entry in entries if entry.leases > 0) if self._closed else 0,
            closed=self._closed,
        )

    def _registered(self, resource: R) -> _Entry[R]:
        entry = self._entries.get(id(resource))
        if entry is None or entry.resource is not resource:
            raise PoolError(
                f"this {type(resource).__name__} is not registered (removed, or never added)"
            )
        return entry

    def __repr__(self) -> str:
        stats = self.statistics()
        state = "closed" if stats.closed else "open"
        return (
            f"<LeaseTable {state} [resources: {stats.resources}, {stats.idle} idle | "
            f"leases: {stats.active_leases} active]>"
        )
