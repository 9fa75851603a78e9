"""ConnectionPool, the HTTP/1.1 transport's state machine, without a network.

Connections are stand-ins (no stream); "the server closed it" is a byte left
in its buffer, which makes it readable. A hypothesis state machine drives
requests, connects that succeed or fail, releases, cancellations, closes by
the server and the clock, and checks the bounds and the accounting after
every step.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from agent_backend.http11 import ConnectionPool, _Connection, _Waiter

A = ("a.test", 80)
B = ("b.test", 80)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_pool(clock: Clock | None = None, **options: Any) -> ConnectionPool:
    options = {
        "max_connections": 2,
        "max_keepalive_connections": 2,
        "keepalive_expiry": 5.0,
    } | options
    return ConnectionPool(clock=clock or Clock(), **options)


def connect(waiter: _Waiter) -> _Connection:
    """What the transport does with a slot: open a connection (here, a stand-in)."""
    assert waiter.slot
    waiter.slot = False
    return _Connection(waiter.origin, stream=None, sock=None)  # type: ignore[arg-type]


def test_a_released_connection_is_reused_most_recent_first() -> None:
    pool = make_pool()
    first, second = _Waiter(A), _Waiter(A)
    assert pool.assign(first) == pool.assign(second) == []
    one, two = connect(first), connect(second)
    pool.release(one, reusable=True)
    pool.release(two, reusable=True)
    assert repr(pool) == "<ConnectionPool [requests: 0 active, 0 queued | conns: 2 open, 2 idle]>"
    again = _Waiter(A)
    pool.assign(again)
    assert again.connection is two
    assert two.state == "active"


def test_a_full_pool_queues_and_hands_over_in_order() -> None:
    pool = make_pool(max_connections=1)
    holder, queued, later = _Waiter(A), _Waiter(A), _Waiter(A)
    pool.assign(holder)
    connection = connect(holder)
    pool.assign(queued)
    pool.assign(later)
    assert not queued.is_assigned()
    assert pool.statistics().requests_queued == 2
    assert pool.release(connection, reusable=True) == []
    assert queued.connection is connection, "handed over directly, first come first served"
    assert not later.is_assigned()
    assert pool.release(connection, reusable=False) == [connection]
    assert later.slot, "the slot of a closed connection goes to the next in line"


def test_a_cancelled_waiter_hands_on_what_it_was_given() -> None:
    pool = make_pool(max_connections=1)
    holder, cancelled, next_one = _Waiter(A), _Waiter(A), _Waiter(A)
    pool.assign(holder)
    connection = connect(holder)
    pool.assign(cancelled)
    pool.assign(next_one)
    pool.release(connection, reusable=True)
    assert cancelled.connection is connection
    pool.discard(cancelled)  # cancelled between the hand-over and its wake-up
    assert next_one.connection is connection
    pool.discard(_Waiter(A))  # never queued: nothing happens
    assert pool.statistics().requests_queued == 0


def test_idle_connections_to_other_origins_make_room() -> None:
    pool = make_pool(max_connections=1)
    to_a = _Waiter(A)
    pool.assign(to_a)
    pool.release(connect(to_a), reusable=True)
    to_b = _Waiter(B)
    closed = pool.assign(to_b)
    assert len(closed) == 1
    assert closed[0].origin == A
    assert closed[0].is_closed()
    assert to_b.slot


def test_expired_and_readable_connections_are_not_reused() -> None:
    clock = Clock()
    pool = make_pool(clock)
    waiters = [_Waiter(A), _Waiter(A)]
    connections = []
    for waiter in waiters:
        pool.assign(waiter)
        connections.append(connect(waiter))
    pool.release(connections[0], reusable=True)
    clock.now = 10.0
    pool.release(connections[1], reusable=True)
    connections[1].buffer += b"x"  # the server closed it (or sent junk) while it was idle
    fresh = _Waiter(A)
    closed = pool.assign(fresh)
    assert set(map(id, closed)) == set(map(id, connections))
    assert fresh.slot
    assert pool.statistics().connections_open == 1


def test_keepalive_bound_and_close() -> None:
    pool = make_pool(max_connections=3, max_keepalive_connections=1)
    waiters = [_Waiter(A) for _ in range(3)]
    for waiter in waiters:
        pool.assign(waiter)
    connections = [connect(w) for w in waiters]
    assert pool.release(connections[0], reusable=True) == []
    assert pool.release(connections[1], reusable=True) == [connections[0]], "oldest idle goes"
    pool.assign(queued := _Waiter(A))
    assert queued.connection is connections[1]
    assert pool.close() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.assign(_Waiter(A))
    assert pool.release(connections[2], reusable=True) == [connections[2]]
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(connections[2], reusable=True)


class PoolMachine(RuleBasedStateMachine):
    """Random traffic against one pool; the model is the set of things each party holds."""

    waiting = Bundle("waiting")
    slots = Bundle("slots")
    active = Bundle("active")

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = ConnectionPool(
            max_connections=3, max_keepalive_connections=2, keepalive_expiry=5.0, clock=self.clock
        )
        self.queued: list[_Waiter] = []
        self.holding_slot = 0
        self.in_use: set[int] = set()
        self.idle: list[_Connection] = []

    def _closed(self, connections: list[_Connection]) -> None:
        for connection in connections:
            assert id(connection) not in self.in_use, "a connection in use was closed"
            assert connection.is_closed()

    def _settle(self) -> list[Any]:
        """Waiters the pool served since the last step: now holders of a slot or a connection."""
        served: list[Any] = []
        for waiter in list(self.queued):
            if waiter.is_assigned():
                self.queued.remove(waiter)
                served.append(waiter)
        return served

    @rule(target=waiting, origin=st.sampled_from([A, B]))
    def request(self, origin: tuple[str, int]) -> Any:
        waiter = _Waiter(origin)
        self._closed(self.pool.assign(waiter))
        self.queued.append(waiter)
        return multiple(*self._assigned())

    @rule(target=active, origin=st.sampled_from([A, B]))
    def request_an_idle_one(self, origin: tuple[str, int]) -> Any:
        """The fast path: an idle connection, taken only when nobody waits."""
        queued_before = len(self.queued)
        connection, to_close = self.pool.take_idle(origin)
        self._closed(to_close)
        if connection is None:
            return multiple()
        assert queued_before == 0
        assert connection.origin == origin
        self.in_use.add(id(connection))
        return connection

    def _assigned(self) -> list[_Waiter]:
        served = self._settle()
        for waiter in served:
            if waiter.connection is not None:
                self.in_use.add(id(waiter.connection))
            else:
                self.holding_slot += 1
        return served

    @rule(target=active, waiter=consumes(waiting))
    def start(self, waiter: _Waiter) -> Any:
        """A served waiter takes its connection, or opens one with its slot."""
        if waiter.connection is not None:
            connection, waiter.connection = waiter.connection, None
            return connection
        self.holding_slot -= 1
        connection = connect(waiter)
        self.in_use.add(id(connection))
        return connection

    @rule(target=waiting, waiter=consumes(waiting))
    def fail_to_connect(self, waiter: _Waiter) -> Any:
        if waiter.connection is not None:  # a waiter cancelled after being served
            self.in_use.discard(id(waiter.connection))
            self._closed(self.pool.discard(waiter))
        else:
            self.holding_slot -= 1
            waiter.slot = False
            self._closed(self.pool.release_slot())
        return multiple(*self._assigned())

    @rule(target=waiting, connection=consumes(active), reusable=st.booleans())
    def finish(self, connection: _Connection, reusable: bool) -> Any:
        self.in_use.discard(id(connection))
        self._closed(self.pool.release(connection, reusable=reusable))
        return multiple(*self._assigned())

    @precondition(lambda self: bool(self.queued))
    @rule(target=waiting, index=st.integers(0, 10))
    def cancel_queued(self, index: int) -> Any:
        waiter = self.queued.pop(index % len(self.queued))
        self._closed(self.pool.discard(waiter))
        return multiple(*self._assigned())

    @rule()
    def server_closes_an_idle_one(self) -> None:
        for connections in self.pool._idle.values():
            connections[0].buffer += b"\0"
            return

    @rule(seconds=st.floats(0, 10))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def bounds_and_accounting(self) -> None:
        stats = self.pool.statistics()
        assert stats.connections_open <= 3
        assert stats.connections_idle <= 2
        assert stats.requests_queued == len(self.queued)
        assert (
            stats.connections_open == stats.connections_idle + len(self.in_use) + self.holding_slot
        )
        if self.queued:  # nobody waits while something could be given
            assert (stats.connections_open, stats.connections_idle) == (3, 0)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
