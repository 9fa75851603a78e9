"""Faults against a real sshd: timeouts, cancellation, killed servers, cut connections, limits.

Every test asserts the same contract: each call ends within its timeout with a
result or a typed error, the pool is usable afterwards, nothing is left
running remotely, and nothing was closed under a holder.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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
from support.tcp_proxy import TCPProxy

from agent_backend.backends.ssh import SSHHostConfig, SSHPoolConfig
from agent_backend.backends.ssh import pool as ssh_pool
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import (
    AgentBackendError,
    BackendUnavailable,
    PoolClosed,
    WorkerLost,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def duration() -> object:
    value = unique_duration()
    yield value
    kill_leftovers(f"sleep {value}")


async def test_timeout_kills_children_that_left_the_process_group(
    sshd: SSHServer, duration: str
) -> None:
    """Children that left the call's process group and ignore TERM are found by the call's
    token; each timed-out call is one remote kill, and costs no connection."""
    async with backend_for(sshd, kill_grace=0.3) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(10):
            escaped = await host.run(
                Command(
                    shell=f"setsid sh -c 'trap \"\" TERM; sleep {duration}' & sleep {duration}",
                    timeout=0.3,
                )
            )
        assert escaped.timed_out
        assert await no_process_left(f"sleep {duration}") == []
        assert host.statistics().remote_kills == 1
        ok = await host.run(Command(argv=("true",), timeout=5))  # the pool is still usable
        assert ok.exit_status == 0
        assert host.statistics().connections_lost == 0


async def test_queued_past_the_timeout_is_a_timed_out_result(
    sshd: SSHServer, duration: str
) -> None:
    async with backend_for(sshd, max_connections=1, max_channels_per_connection=1) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.run, sleep_command(duration, timeout=1.5))
                await wait_until(lambda: host.statistics().leases_active == 1, within=5)
                started = time.monotonic()
                busy = await host.run(Command(argv=("true",), timeout=0.3))
                assert time.monotonic() - started < 1.0
                assert busy.timed_out
                assert b"did not start" in busy.stderr.data
                assert host.statistics().leases_queued == 0
        assert await no_process_left(f"sleep {duration}") == []


async def test_kill_sshd_mid_call_then_restart(sshd: SSHServer, duration: str) -> None:
    """Callers get WorkerLost within their timeout; one reconnect serves the next burst."""
    async with backend_for(sshd, down_after_failures=100, connect_retries=0) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(30):
            await host.run(Command(argv=("true",), timeout=5))
            outcomes: list[object] = []

            async def call() -> None:
                started = time.monotonic()
                try:
                    outcomes.append(await host.run(sleep_command(duration, timeout=10)))
                except AgentBackendError as exc:
                    outcomes.append(exc)
                assert time.monotonic() - started < 10

            (first,) = host.connections()
            first_serial = first.serial
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(call)
                assert await wait_until(lambda: host.statistics().channels_open == 6, within=10)
                await sshd.akill()
            assert len(outcomes) == 6
            assert all(isinstance(o, WorkerLost) for o in outcomes), outcomes
            assert host.statistics().connections_open == 0

            with pytest.raises(BackendUnavailable, match="cannot connect"):
                await host.run(Command(argv=("true",), timeout=5))  # sshd is down: typed, fast

            await sshd.astart()  # same port, same host key
            results: list[CommandResult] = []

            async def ok_call() -> None:
                results.append(await host.run(Command(argv=("echo", "back"), timeout=10)))

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(ok_call)
        assert [r.stdout.data for r in results] == [b"back\n"] * 8
        # Exactly one reconnect for the burst: connection serials count successful handshakes
        # (the pool's own recheck after the loss may be that one, never one more).
        (reconnected,) = host.connections()
        assert reconnected.serial == first_serial + 1
        assert host.is_up()


async def test_host_marked_down_then_probed_back(sshd: SSHServer) -> None:
    settings = {"down_after_failures": 2, "probe_interval": 0.2, "connect_retries": 0}
    async with backend_for(sshd, **settings) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(30):
            await host.run(Command(argv=("true",), timeout=5))
            await sshd.akill()
            assert await wait_until(lambda: host.statistics().connections_open == 0, within=5)
            for _ in range(2):
                with pytest.raises(BackendUnavailable):
                    await host.run(Command(argv=("true",), timeout=5))
            assert not host.is_up()
            assert "down" in repr(host)
            with pytest.raises(BackendUnavailable, match="down"):
                await host.run(Command(argv=("true",), timeout=5))
            with pytest.raises(BackendUnavailable, match="no ssh host is up"):
                backend.pick_host()
            await sshd.astart()
            assert await wait_until(host.is_up, within=5)
            result = await host.run(Command(argv=("echo", "up"), timeout=5))
        assert result.stdout.data == b"up\n"
        assert host.statistics().consecutive_failures == 0


async def test_placement_skips_a_down_host(sshd_factory: Callable[..., SSHServer]) -> None:
    good, bad = sshd_factory(), sshd_factory()
    settings = {"down_after_failures": 1, "probe_interval": 30.0, "connect_retries": 0}
    async with backend_for(good, bad, **settings) as backend:
        await bad.akill()
        bad_host = backend.hosts[1]
        with anyio.fail_after(10), pytest.raises(BackendUnavailable):
            await bad_host.run(Command(argv=("true",), timeout=5))
        assert not bad_host.is_up()
        with anyio.fail_after(10):
            for _ in range(5):
                assert (
                    await backend.pick_host().run(Command(argv=("true",), timeout=5))
                ).host == backend.hosts[0].name


async def test_cut_connections_through_a_proxy(sshd: SSHServer, duration: str) -> None:
    """Cut connections: calls fail typed, one reconnect serves every waiter (no duplicates)."""
    async with TCPProxy(sshd.port) as proxy:
        config = SSHHostConfig(**sshd.client_options(port=proxy.port))
        # known_hosts names the real port; the proxy's port needs its own line.
        sshd.known_hosts.write_text(
            sshd.known_hosts.read_text()
            + f"[127.0.0.1]:{proxy.port} ssh-ed25519 {sshd.keys.host_public}\n"
        )
        from agent_backend.backends.ssh import SSHBackend

        async with SSHBackend.from_config(SSHPoolConfig(hosts=(config,))) as backend:
            host = backend.hosts[0]
            with anyio.fail_after(30):
                outcomes: list[object] = []

                async def call() -> None:
                    try:
                        outcomes.append(await host.run(sleep_command(duration, timeout=10)))
                    except AgentBackendError as exc:
                        outcomes.append(exc)

                started = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for _ in range(4):
                        tg.start_soon(call)
                    assert await wait_until(lambda: host.statistics().channels_open == 4, within=10)
                    await proxy.cut()
                assert time.monotonic() - started < 10
                assert all(isinstance(o, WorkerLost) for o in outcomes), outcomes
                before = host.statistics().handshakes
                async with anyio.create_task_group() as tg:
                    for _ in range(4):
                        tg.start_soon(host.run, Command(argv=("true",), timeout=10))
                assert host.statistics().handshakes - before == 1
                # sshd keeps commands of a dropped connection running (no pty, no SIGHUP):
                # the pool kills them over the new connection, after checking they are its own.
                assert await no_process_left(f"sleep {duration}", within=5) == []


async def test_keepalive_detects_a_silent_partition(sshd: SSHServer, duration: str) -> None:
    async with TCPProxy(sshd.port) as proxy:
        sshd.known_hosts.write_text(
            sshd.known_hosts.read_text()
            + f"[127.0.0.1]:{proxy.port} ssh-ed25519 {sshd.keys.host_public}\n"
        )
        from agent_backend.backends.ssh import SSHBackend

        config = SSHHostConfig(
            **sshd.client_options(port=proxy.port, keepalive_interval=0.2, keepalive_count_max=2)
        )
        async with SSHBackend.from_config(SSHPoolConfig(hosts=(config,))) as backend:
            host = backend.hosts[0]
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:

                    async def call() -> None:
                        with pytest.raises(WorkerLost):
                            await host.run(sleep_command(duration, timeout=15))

                    tg.start_soon(call)
                    assert await wait_until(lambda: host.statistics().channels_open == 1, within=10)
                    started = time.monotonic()
                    proxy.freeze()
                assert time.monotonic() - started < 3
                assert host.statistics().connections_lost == 1
                proxy.thaw()
                await proxy.cut()
                assert (await host.run(Command(argv=("true",), timeout=10))).exit_status == 0


async def test_connect_timeout_and_aclose_during_a_handshake(sshd: SSHServer) -> None:
    """A server that never answers: typed error within connect_timeout; aclose cancels the handshake."""
    async with TCPProxy(sshd.port) as proxy:
        proxy.freeze()
        sshd.known_hosts.write_text(
            sshd.known_hosts.read_text()
            + f"[127.0.0.1]:{proxy.port} ssh-ed25519 {sshd.keys.host_public}\n"
        )
        from agent_backend.backends.ssh import SSHBackend

        config = SSHHostConfig(
            **sshd.client_options(port=proxy.port, connect_timeout=0.5, connect_retries=0)
        )
        backend = SSHBackend.from_config(SSHPoolConfig(hosts=(config,)))
        async with backend:
            host = backend.hosts[0]
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(BackendUnavailable, match="cannot connect"):
                await host.run(Command(argv=("true",), timeout=5))
            assert time.monotonic() - started < 2.5
            # Now stop while a handshake is in flight, with a caller waiting on it.
            outcome: list[BaseException] = []

            async def waiting_call() -> None:
                try:
                    await host.run(Command(argv=("true",), timeout=30))
                except PoolClosed as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting_call)
                assert await wait_until(
                    lambda: host.statistics().connections_connecting == 1, within=5
                )
                handshakes = host.statistics().handshakes
                started = time.monotonic()
                with anyio.fail_after(5):
                    await backend.aclose()
                assert time.monotonic() - started < 2
        assert len(outcome) == 1
        assert host.statistics().handshakes == handshakes  # no reconnect after stop began
        assert host.statistics().connections_open == 0


async def test_max_sessions_exhausted_retries_and_lowers_capacity(
    sshd_factory: Callable[..., SSHServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """sshd MaxSessions 2, pool misconfigured to 4 channels: refusals are retried, capacity learned
    for a while (sshd also refuses transiently, when it has not yet freed closed sessions)."""
    monkeypatch.setattr(ssh_pool, "CAPACITY_COOLDOWN", 5.0)
    server = sshd_factory(max_sessions=2)
    async with backend_for(
        server, max_channels_per_connection=4, max_connections=1, retry_backoff=0.02
    ) as backend:
        host = backend.hosts[0]
        results: list[CommandResult] = []

        async def call() -> None:
            results.append(await host.run(Command(argv=("sleep", "0.2"), timeout=20)))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(call)
        assert [r.exit_status for r in results] == [0] * 8
        stats = host.statistics()
        assert stats.channel_refusals >= 1
        (connection,) = host.connections()
        assert host.pool.table.capacity_of(connection) <= 2
        # After the cooldown, the next release restores the configured capacity.
        assert connection.restore_at is not None
        connection.restore_at = time.monotonic()
        with anyio.fail_after(10):
            await host.run(Command(argv=("true",), timeout=5))
        assert host.pool.table.capacity_of(connection) == 4


async def test_max_sessions_exhausted_without_retries_fails_typed(
    sshd_factory: Callable[..., SSHServer],
) -> None:
    server = sshd_factory(max_sessions=2)
    settings = {"max_channels_per_connection": 4, "max_connections": 1, "channel_open_retries": 0}
    # Channel counting alone: no walls trial taking a session of its own first.
    async with backend_for(server, **settings, isolation="none") as backend:
        host = backend.hosts[0]
        outcomes: list[object] = []

        async def call() -> None:
            try:
                outcomes.append(await host.run(Command(argv=("sleep", "0.3"), timeout=20)))
            except BackendUnavailable as exc:
                outcomes.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(call)
            refused = [o for o in outcomes if isinstance(o, BackendUnavailable)]
            assert len(refused) == 2
            assert "MaxSessions" in str(refused[0])
            assert sum(isinstance(o, CommandResult) for o in outcomes) == 2
            # Usable afterwards, once sshd has freed the sessions it frees lazily (with no
            # retries configured, a call that races that is refused at once, typed).
            for _ in range(50):
                try:
                    assert (await host.run(Command(argv=("true",), timeout=5))).exit_status == 0
                    break
                except BackendUnavailable:
                    await anyio.sleep(0.1)
            else:
                pytest.fail("the pool never recovered")


async def test_handshake_ramp_and_retries_survive_strict_max_startups(
    sshd_factory: Callable[..., SSHServer],
) -> None:
    """sshd drops unauthenticated connections beyond MaxStartups: retried with backoff, no error."""
    server = sshd_factory(max_startups="2")
    settings = {
        "max_channels_per_connection": 1,
        "max_connections": 8,
        "max_concurrent_handshakes": 8,
        "handshake_interval": 0.0,
        "connect_retries": 8,
        "retry_backoff": 0.05,
    }
    async with backend_for(server, **settings) as backend:
        host = backend.hosts[0]
        results: list[CommandResult] = []

        async def call() -> None:
            results.append(await host.run(Command(argv=("sleep", "0.2"), timeout=30)))

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(call)
        assert [r.exit_status for r in results] == [0] * 16
        assert host.statistics().connections_open <= 8
