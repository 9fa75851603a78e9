"""The SSH pool under a plain asyncio loop (``asyncio.run``), not anyio's runner.

asyncssh reports a dead connection from a loop callback, outside any task. Under
``asyncio.run`` nothing tells anyio which library runs there, so anyio cannot
spawn from that callback: the pool must defer the reconnect to a task, or the
queued callers wait for a connector that never started until their timeout.
"""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
from support.ssh_helpers import (
    backend_for,
    kill_leftovers,
    no_process_left,
    sleep_command,
    unique_duration,
    wait_until,
)
from support.sshd import SSHServer

from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import AgentBackendError, WorkerLost


@pytest.mark.timeout(60)
def test_queued_callers_are_served_after_a_connection_dies(sshd: SSHServer) -> None:
    duration = unique_duration()

    async def scenario() -> tuple[list[object], float]:
        async with backend_for(sshd, max_connections=1, max_channels_per_connection=1) as backend:
            host = backend.hosts[0]
            outcomes: list[object] = []

            async def call(command: Command) -> None:
                try:
                    outcomes.append(await host.run(command))
                except AgentBackendError as exc:
                    outcomes.append(exc)

            with anyio.fail_after(20):
                first = asyncio.create_task(call(sleep_command(duration, timeout=10)))
                assert await wait_until(lambda: host.statistics().channels_open == 1, within=10)
                second = asyncio.create_task(call(Command(argv=("echo", "queued"), timeout=10)))
                assert await wait_until(lambda: host.statistics().leases_queued == 1, within=5)
                started = time.monotonic()
                (connection,) = host.connections()
                connection.conn.abort()  # its death is noticed in a loop callback
                await asyncio.wait({first, second})
                elapsed = time.monotonic() - started
            stats = host.statistics()
            assert (stats.handshakes, stats.connections_connecting, stats.connections_open) == (
                2,
                0,
                1,
            )
            return outcomes, elapsed

    try:
        outcomes, elapsed = asyncio.run(scenario())
        assert elapsed < 5  # not the queued caller's 10 s timeout
        lost, served = outcomes
        assert isinstance(lost, WorkerLost)
        assert isinstance(served, CommandResult)
        assert served.stdout.data == b"queued\n"
        assert asyncio.run(no_process_left(f"sleep {duration}")) == []
    finally:
        kill_leftovers(f"sleep {duration}")
