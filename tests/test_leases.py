"""The pure lease table: ownership-checked release, idle time from the end of the last lease."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from agent_backend.dispatch.leases import Lease, LeaseStats, LeaseTable
from agent_backend.errors import LeaseError, PoolBusy, PoolClosed, PoolError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Res:
    """A resource; deliberately unhashable-by-value (identity is the key)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:  # equal names must not confuse the table
        return isinstance(other, Res) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Res({self.name})"


def make(ttl: float | None = 10.0) -> tuple[LeaseTable[Res], Clock]:
    clock = Clock()
    return LeaseTable(idle_ttl=ttl, clock=clock), clock


def test_acquire_prefers_least_loaded_then_oldest() -> None:
    table, _ = make()
    a, b = Res("a"), Res("b")
    table.add(a, capacity=2)
    table.add(b, capacity=2)
    owners = [object() for _ in range(5)]
    got = [table.acquire(owner) for owner in owners]
    assert [lease.resource if lease else None for lease in got] == [a, b, a, b, None]
    assert table.statistics() == LeaseStats(
        resources=2, active_leases=4, idle=0, full=2, free_slots=0, draining=0, closed=False
    )


def test_pack_fills_the_busiest_resource_with_room_first() -> None:
    table, _ = make()
    a, b, c = Res("a"), Res("b"), Res("c")
    for r in (a, b, c):
        table.add(r, capacity=2)
    first = table.acquire_on(b, object())
    got = [table.acquire(object(), pack=True) for _ in range(5)]
    assert [lease.resource if lease else None for lease in got] == [b, a, a, c, c]
    table.release(first)
    lease = table.acquire(object(), pack=True)
    assert lease is not None
    assert lease.resource is b  # the only one with room


def test_identity_not_equality_is_the_key() -> None:
    table, _ = make()
    a1, a2 = Res("a"), Res("a")
    table.add(a1, capacity=1)
    table.add(a2, capacity=1)  # equal but distinct: both registered
    assert table.statistics().resources == 2
    with pytest.raises(PoolError):
        table.add(a1, capacity=1)
    assert table.remove(a2)
    assert table.is_registered(a1)
    assert not table.is_registered(a2)


def test_tokens_are_unique_and_never_reused() -> None:
    table, _ = make()
    a = Res("a")
    table.add(a, capacity=1)
    seen = set()
    for _ in range(50):
        lease = table.acquire(object())
        assert lease is not None
        assert lease.token not in seen
        seen.add(lease.token)
        table.release(lease)


def test_release_stale_double_and_foreign_raise_and_change_nothing() -> None:
    table, _ = make()
    a = Res("a")
    table.add(a, capacity=2)
    owner = object()
    lease = table.acquire(owner)
    assert lease is not None
    before = table.statistics()
    with pytest.raises(LeaseError):
        table.release(Lease(a, lease.token, object()))  # foreign owner, right token
    with pytest.raises(LeaseError):
        table.release(Lease(Res("a"), lease.token, owner))  # equal-looking resource, not the same
    with pytest.raises(LeaseError):
        table.release(Lease(a, lease.token + 10_000, owner))  # never granted
    assert table.statistics() == before
    table.release(lease)
    with pytest.raises(LeaseError):
        table.release(lease)  # double release
    assert table.leases_of(a) == 0


def test_lease_from_another_table_is_foreign() -> None:
    one, _ = make()
    two, _ = make()
    a = Res("a")
    one.add(a, capacity=1)
    two.add(a, capacity=1)
    lease = one.acquire(object())
    assert lease is not None
    with pytest.raises(LeaseError):
        two.release(lease)
    assert one.leases_of(a) == 1


def test_idle_clock_starts_at_end_of_last_lease() -> None:
    """A lease longer than the TTL is never reaped, nor right after it ends (its sandbox would vanish)."""
    table, clock = make(ttl=10)
    a = Res("a")
    table.add(a, capacity=2)
    first = table.acquire(object())
    assert first is not None
    clock.advance(100)  # a call ten times longer than the TTL
    assert table.reap() == []
    assert not table.has_expired(a)
    second = table.acquire(object())
    assert second is not None
    table.release(first)
    clock.advance(100)
    assert table.reap() == []  # still held by the second lease
    table.release(second)
    clock.advance(9.99)
    assert table.reap() == []
    assert table.next_expiry() == pytest.approx(clock.now + 0.01)
    clock.advance(0.01)
    assert table.has_expired(a)
    assert table.reap() == [a]
    assert not table.is_registered(a)


def test_idle_since_add_and_no_ttl() -> None:
    table, clock = make(ttl=5)
    a = Res("a")
    table.add(a, capacity=1)
    clock.advance(5)
    assert table.reap() == [a]
    forever, clock2 = make(ttl=None)
    forever.add(a, capacity=1)
    clock2.advance(1e9)
    assert forever.reap() == []
    assert forever.next_expiry() is None
    assert not forever.has_expired(a)


def test_remove_keeps_outstanding_leases_releasable() -> None:
    table, _ = make()
    a = Res("a")
    table.add(a, capacity=2)
    lease = table.acquire(object())
    assert lease is not None
    assert table.remove(a) is True
    assert table.remove(a) is False  # only one caller gets to close it
    assert table.leases_of(a) == 1
    assert table.acquire(object()) is None
    table.release(lease)  # the holder's release is not an error
    assert table.leases_of(a) == 0
    assert table.reap() == []
    with pytest.raises(PoolError):
        table.acquire_on(a, object())


def test_acquire_on_pins_and_respects_capacity() -> None:
    table, _ = make()
    a, b = Res("a"), Res("b")
    table.add(a, capacity=1)
    table.add(b, capacity=1)
    lease = table.acquire_on(b, object())
    assert lease.resource is b
    with pytest.raises(PoolBusy) as busy:  # overload, not misuse: a caller may retry
        table.acquire_on(b, object())
    assert busy.value.limit == 1
    with pytest.raises(PoolError) as missing:
        table.acquire_on(Res("c"), object())
    # What callers see names no resource's repr (a session's holds its workspace path).
    for error in (busy.value, missing.value):
        assert "Res(" not in str(error)


def test_set_capacity_lowers_future_grants() -> None:
    table, _ = make()
    a = Res("a")
    table.add(a, capacity=4)
    leases = [table.acquire(object()) for _ in range(3)]
    table.set_capacity(a, 2)
    assert table.capacity_of(a) == 2
    assert table.acquire(object()) is None
    for lease in leases[:2]:
        assert lease is not None
        table.release(lease)
    assert table.acquire(object()) is not None
    with pytest.raises(ValueError, match="capacity"):
        table.set_capacity(a, 0)


def test_close_returns_idle_then_drains_leased() -> None:
    table, _ = make()
    a, b, c = Res("a"), Res("b"), Res("c")
    for r in (a, b, c):
        table.add(r, capacity=2)
    la = table.acquire_on(a, object())
    lb1 = table.acquire_on(b, object())
    lb2 = table.acquire_on(b, object())
    assert table.close() == [c]
    assert table.statistics().draining == 2
    with pytest.raises(PoolClosed):
        table.acquire(object())
    with pytest.raises(PoolClosed):
        table.acquire_on(a, object())
    with pytest.raises(PoolClosed):
        table.add(Res("d"), capacity=1)
    table.release(lb1)
    assert table.drained() == []  # b still leased
    table.release(lb2)
    table.release(la)
    assert table.drained() == [b, a]
    assert table.drained() == []
    assert table.statistics().resources == 0
    assert table.close() == []  # idempotent


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="idle_ttl"):
        LeaseTable[Res](idle_ttl=-1)
    table, _ = make()
    with pytest.raises(ValueError, match="capacity"):
        table.add(Res("a"), capacity=0)
    assert "LeaseTable open" in repr(table)


class LeaseTableMachine(RuleBasedStateMachine):
    """Random add/acquire/release/reap/remove/close/clock-advance against a model."""

    resources = Bundle("resources")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.ttl = 5.0
        self.table: LeaseTable[Res] = LeaseTable(idle_ttl=self.ttl, clock=self.clock)
        self.registered: dict[int, Res] = {}
        self.capacity: dict[int, int] = {}
        self.active: dict[int, Lease[Res]] = {}  # token -> lease
        self.released: list[Lease[Res]] = []
        self.idle_since: dict[int, float] = {}
        self.closed_or_reaped: list[Res] = []  # everything the table handed back for closing
        self.closed = False
        self.count = 0

    def held(self, resource: Res) -> int:
        return sum(1 for lease in self.active.values() if lease.resource is resource)

    @precondition(lambda self: not self.closed)
    @rule(target=resources, capacity=st.integers(1, 3))
    def add(self, capacity: int) -> Res:
        self.count += 1
        resource = Res(f"r{self.count}")
        self.table.add(resource, capacity=capacity)
        self.registered[id(resource)] = resource
        self.capacity[id(resource)] = capacity
        self.idle_since[id(resource)] = self.clock.now
        return resource

    @rule(target=leases, pack=st.booleans())
    def acquire(self, pack: bool) -> Lease[Res] | None:
        if self.closed:
            with pytest.raises(PoolClosed):
                self.table.acquire(object(), pack=pack)
            return None
        lease = self.table.acquire(object(), pack=pack)
        free = [r for r in self.registered.values() if self.held(r) < self.capacity[id(r)]]
        if lease is None:
            assert free == []
            return None
        assert any(lease.resource is r for r in free)
        pick = max if pack else min
        expected = pick(self.held(r) for r in free)
        assert self.held(lease.resource) == expected
        # ties go to the oldest resource
        assert lease.resource is next(r for r in free if self.held(r) == expected)
        self.active[lease.token] = lease
        return lease

    @rule(target=leases, resource=resources)
    def acquire_on(self, resource: Res) -> Lease[Res] | None:
        registered = id(resource) in self.registered
        if self.closed:
            with pytest.raises(PoolClosed):
                self.table.acquire_on(resource, object())
            return None
        if not registered or self.held(resource) >= self.capacity[id(resource)]:
            with pytest.raises(PoolError):
                self.table.acquire_on(resource, object())
            return None
        lease = self.table.acquire_on(resource, object())
        self.active[lease.token] = lease
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease: Lease[Res] | None) -> None:
        if lease is None:
            return
        self.table.release(lease)
        del self.active[lease.token]
        self.released.append(lease)
        resource = lease.resource
        if self.held(resource) == 0:
            self.idle_since[id(resource)] = self.clock.now
            if self.closed and id(resource) in self.registered:
                del self.registered[id(resource)]
                drained = self.table.drained()
                assert len(drained) == 1
                assert drained[0] is resource
                self.closed_or_reaped.extend(drained)

    @rule(data=st.data())
    def release_wrong_token(self, data: st.DataObject) -> None:
        """A foreign or stale release raises and changes nothing."""
        before = self.table.statistics()
        choices: list[Lease[Res]] = list(self.released)
        for lease in self.active.values():
            choices.append(Lease(lease.resource, lease.token, object()))  # foreign owner
        if not choices:
            return
        bad = data.draw(st.sampled_from(choices))
        with pytest.raises(LeaseError):
            self.table.release(bad)
        assert self.table.statistics() == before

    @rule(seconds=st.sampled_from([0.0, 1.0, 4.99, 5.0, 7.5, 50.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def reap(self) -> None:
        reaped = self.table.reap()
        expected = [
            r
            for r in self.registered.values()
            if self.held(r) == 0 and self.clock.now - self.idle_since[id(r)] >= self.ttl
        ]
        assert [id(r) for r in reaped] == [id(r) for r in expected]
        for r in reaped:
            assert self.held(r) == 0, "reaped a leased resource"
            del self.registered[id(r)]
        self.closed_or_reaped.extend(reaped)

    @rule(resource=resources)
    def remove(self, resource: Res) -> None:
        was = id(resource) in self.registered and self.registered[id(resource)] is resource
        assert self.table.remove(resource) is was
        self.registered.pop(id(resource), None)

    @rule()
    def close(self) -> None:
        idle = self.table.close()
        expected = [r for r in self.registered.values() if self.held(r) == 0]
        assert [id(r) for r in idle] == [id(r) for r in expected]
        for r in idle:
            assert self.held(r) == 0, "close returned a leased resource"
            del self.registered[id(r)]
        self.closed_or_reaped.extend(idle)
        self.closed = True

    @invariant()
    def table_matches_model(self) -> None:
        stats = self.table.statistics()
        assert stats.resources == len(self.registered)
        assert stats.active_leases == len(self.active)
        assert stats.closed == self.closed
        for r in self.registered.values():
            assert self.table.leases_of(r) == self.held(r)
            assert self.table.leases_of(r) <= self.capacity[id(r)]
            assert self.table.is_idle(r) == (self.held(r) == 0)

    @invariant()
    def nothing_handed_back_is_leased_or_registered(self) -> None:
        for r in self.closed_or_reaped:
            assert not self.table.is_registered(r)
        # A leased resource is never handed back while leased: every active lease
        # is on a resource that is still registered or was removed by its owner.
        handed_back = {id(r) for r in self.closed_or_reaped}
        for lease in self.active.values():
            assert id(lease.resource) not in handed_back


TestLeaseTableMachine = LeaseTableMachine.TestCase
TestLeaseTableMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
