"""A hypothesis state machine over the SSH pool, against a real sshd.

Rules interleave calls of mixed lengths and timeouts, the passage of time
(so the reaper runs: idle_ttl is short), connection deaths (an abort, as
from a network failure), bursts after a total failure, and stop. After every
step and at the end it asserts:

* the reaper never closes a leased connection: a call is lost only on a
  connection this machine killed, and every connection the pool closes holds
  no lease at that moment;
* one reconnect per failure burst (exactly one handshake serves a burst of at
  most ``capacity`` calls after every connection died);
* no call outlives its timeout (plus the bounded kill path);
* every call ends with a result or a typed error;
* after ``aclose()`` nothing is open: no connection, channel, sshd session
  process or remote command.

Each example runs on its own event loop (``asyncio.Runner``): background
call tasks advance whenever a rule runs the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from ssh_helpers import backend_for, kill_leftovers, processes_matching, unique_duration
from sshd import SSHServer

from agent_backend.backends.ssh import SSHBackend, SSHHost
from agent_backend.backends.ssh.channel import SSHConnection
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import AgentBackendError, PoolClosed, WorkerLost

CAPACITY = 2
KILL_GRACE = 0.1
# The kill path is bounded by kill_grace + marker wait + KILL wait; calls may end that much late.
SLACK = KILL_GRACE + 3.0


class Outcome:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.value: object = None
        self.elapsed = 0.0


class SSHPoolMachine(RuleBasedStateMachine):
    def __init__(self, server: SSHServer) -> None:
        super().__init__()
        self.server = server
        self.runner = asyncio.Runner()
        self.backend: SSHBackend = backend_for(
            server,
            max_connections=2,
            max_channels_per_connection=CAPACITY,
            idle_ttl=0.15,
            kill_grace=KILL_GRACE,
            keepalive_interval=0,
            connect_retries=1,
            retry_backoff=0.02,
            down_after_failures=1000,
        )
        self.host: SSHHost = self.backend.hosts[0]
        self.marker = unique_duration(0)  # e.g. 0.1230001: a sleep only this machine runs
        self.tasks: list[asyncio.Task[None]] = []
        self.outcomes: list[Outcome] = []
        self.killed: set[int] = set()
        self.closed_while_leased: list[int] = []
        self.stopped = False
        self._watch_closes()
        self.run(self.backend.start())

    # -- plumbing -------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.runner.run(coro)

    def advance(self, seconds: float) -> None:
        self.run(asyncio.sleep(seconds))

    def _watch_closes(self) -> None:
        host = self.host
        original: Callable[[SSHConnection], Coroutine[Any, Any, None]] = host.pool.connector.close

        async def checked_close(connection: SSHConnection) -> None:
            if host.pool.table.leases_of(connection) != 0:
                self.closed_while_leased.append(connection.serial)
            await original(connection)

        host.pool.connector.close = checked_close  # type: ignore[method-assign]

    def _start_call(self, seconds: float, timeout: float) -> None:
        outcome = Outcome(timeout)
        self.outcomes.append(outcome)
        duration = f"{seconds:.1f}{self.marker[2:]}"  # 0.3 -> 0.31230001: unique, about as long
        command = Command(argv=("sleep", duration), timeout=timeout)

        async def call() -> None:
            started = time.monotonic()
            try:
                outcome.value = await self.host.run(command)
            except AgentBackendError as exc:
                outcome.value = exc
            except BaseException as exc:  # recorded, then asserted on: never expected
                outcome.value = exc
            finally:
                outcome.elapsed = time.monotonic() - started

        async def spawn() -> None:
            self.tasks.append(asyncio.get_running_loop().create_task(call()))
            await asyncio.sleep(0)

        self.run(spawn())

    # -- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: not self.stopped)
    @rule(
        seconds=st.sampled_from([0.0, 0.1, 0.3]),
        timeout=st.sampled_from([0.2, 3.0]),
        count=st.integers(1, 3),
    )
    def start_calls(self, seconds: float, timeout: float, count: int) -> None:
        for _ in range(count):
            self._start_call(seconds, timeout)

    @rule(seconds=st.sampled_from([0.01, 0.1, 0.3]))
    def wait(self, seconds: float) -> None:
        self.advance(seconds)

    @precondition(lambda self: not self.stopped)
    @rule(data=st.data())
    def kill_a_connection(self, data: st.DataObject) -> None:
        connections = self.host.connections()
        if not connections:
            return
        victim = data.draw(st.sampled_from(connections))
        self.killed.add(victim.serial)
        victim.conn.abort()
        self.advance(0.01)

    @precondition(lambda self: not self.stopped)
    @rule(size=st.integers(1, CAPACITY))
    def kill_everything_then_burst(self, size: int) -> None:
        """After every connection dies, one handshake serves a burst that fits one connection."""
        self.advance(0)
        self.run(self._settle())
        for connection in self.host.connections():
            self.killed.add(connection.serial)
            connection.conn.abort()
        self.advance(0.01)
        assert self.host.connections() == []
        before = self.host.statistics().handshakes
        start = len(self.outcomes)
        for _ in range(size):
            self._start_call(0.0, 3.0)
        self.run(self._settle())
        burst = self.outcomes[start:]
        assert all(isinstance(o.value, CommandResult) for o in burst), [o.value for o in burst]
        assert self.host.statistics().handshakes - before == 1

    async def _settle(self) -> None:
        """Wait (bounded) for every call in flight to end."""
        with anyio.fail_after(15):
            for task in list(self.tasks):
                await asyncio.wait({task})

    @precondition(lambda self: not self.stopped)
    @rule()
    def stop(self) -> None:
        self.run(self._stop())
        self.stopped = True
        self._assert_nothing_open()

    async def _stop(self) -> None:
        with anyio.fail_after(20):
            await self.backend.aclose()
            await self._settle()
        with pytest.raises(PoolClosed):
            await self.host.run(Command(argv=("true",), timeout=1))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def reaper_never_closed_a_leased_connection(self) -> None:
        assert self.closed_while_leased == []

    @invariant()
    def calls_end_typed_in_time_and_lost_only_where_killed(self) -> None:
        for outcome in self.outcomes:
            if outcome.value is None:
                continue
            assert isinstance(outcome.value, CommandResult | AgentBackendError), repr(outcome.value)
            assert outcome.elapsed <= outcome.timeout + SLACK, (outcome.elapsed, outcome.timeout)
            if isinstance(outcome.value, WorkerLost):
                serial = int(str(outcome.value.worker).rsplit("#", 1)[1])
                assert serial in self.killed, f"connection #{serial} was lost but never killed"
            if isinstance(outcome.value, CommandResult) and not outcome.value.timed_out:
                assert outcome.value.exit_status == 0

    @invariant()
    def pool_within_its_limits(self) -> None:
        stats = self.host.statistics()
        assert stats.connections_open + stats.connections_connecting <= 2
        for connection in self.host.connections():
            assert self.host.pool.table.leases_of(connection) <= CAPACITY
            assert not connection.lost

    def _assert_nothing_open(self) -> None:
        stats = self.backend.statistics()
        assert stats.closed
        assert stats.connections_open == 0
        assert stats.leases_active == 0
        assert stats.leases_queued == 0
        assert all(h.channels_open == 0 and h.connections_connecting == 0 for h in stats.hosts)
        deadline = time.monotonic() + 5
        while self.server.session_processes() or processes_matching(f"sleep 0..{self.marker[2:]}"):
            assert time.monotonic() < deadline, "sshd sessions or remote commands outlived aclose()"
            time.sleep(0.05)

    def teardown(self) -> None:
        try:
            if not self.stopped:
                self.run(self._stop())
                self._assert_nothing_open()
            self.calls_end_typed_in_time_and_lost_only_where_killed()
        finally:
            for task in self.tasks:
                task.cancel()
            self.runner.close()
            kill_leftovers(f"sleep 0..{self.marker[2:]}")


@pytest.mark.timeout(110)
def test_ssh_pool_state_machine(sshd: SSHServer) -> None:
    run_state_machine_as_test(
        lambda: SSHPoolMachine(sshd),
        settings=settings(max_examples=8, stateful_step_count=12, deadline=None),
    )
