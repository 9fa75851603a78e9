"""The SSH backend against a real OpenSSH sshd on 127.0.0.1: pooling, placement, reaping, host
keys, lifecycle. What every host must do (commands, files, timeouts) is tests/test_host_contract.py."""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

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

from agent_backend.backends.ssh import SSHBackend, SSHHost
from agent_backend.dispatch.backend import Command
from agent_backend.dispatch.leases import Lease
from agent_backend.errors import (
    BackendUnavailable,
    ConfigError,
    LeaseError,
    PoolClosed,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def ssh_connection_of(output: bytes) -> tuple[str, int]:
    """(server address, server port) from ``$SSH_CONNECTION``."""
    _client, _cport, server, sport = output.decode().split()
    return server, int(sport)


async def test_channel_cap_and_connection_growth(sshd: SSHServer) -> None:
    async with backend_for(sshd, max_connections=2, max_channels_per_connection=3) as backend:
        host = backend.hosts[0]
        peak = {"active": 0, "open": 0}

        def watch() -> bool:
            s = host.statistics()
            peak["active"] = max(peak["active"], s.leases_active)
            peak["open"] = max(peak["open"], s.connections_open)
            assert s.channels_open <= 6
            for connection in host.connections():
                assert connection.open_channels <= 3
            return False

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(15):
                    tg.start_soon(host.run, Command(argv=("sleep", "0.5"), timeout=15))
                assert await wait_until(lambda: host.statistics().leases_active == 6, within=10)
                assert re.search(
                    r"leases: 6 active, \d+ queued \| conns: 2 open, 0 idle", repr(host)
                )
                tg.start_soon(functools.partial(wait_until, watch, within=1.0))
        stats = host.statistics()
        assert peak["active"] == 6
        assert peak["open"] == 2
        assert stats.handshakes == 2
        assert stats.calls == 15
        assert (
            repr(host)
            == f"<SSHHost 127.0.0.1:{sshd.port} [leases: 0 active, 0 queued | conns: 2 open, 2 idle]>"
        )


async def test_new_connections_only_when_existing_are_full(sshd: SSHServer) -> None:
    async with backend_for(sshd, max_channels_per_connection=4) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(20):
            for _ in range(5):  # sequential: one connection is always enough
                await host.run(Command(argv=("true",), timeout=5))
            assert host.statistics().handshakes == 1
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(host.run, Command(argv=("sleep", "0.2"), timeout=10))
            assert host.statistics().handshakes == 1
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(host.run, Command(argv=("sleep", "0.2"), timeout=10))
            assert host.statistics().handshakes == 2


async def test_burst_of_100_callers_at_a_cold_pool(sshd: SSHServer) -> None:
    """Default sshd (MaxSessions 10, MaxStartups 10:30:100) and default pool settings: no error."""
    async with backend_for(sshd) as backend:
        host = backend.hosts[0]
        results = []

        async def call(i: int) -> None:
            results.append(await host.run(Command(argv=("echo", str(i)), timeout=30)))

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(call, i)
        assert sorted(int(r.stdout.data) for r in results) == list(range(100))
        assert all(r.exit_status == 0 for r in results)
        stats = host.statistics()
        assert stats.handshake_failures == 0  # the ramp kept us under MaxStartups
        # (sshd may still refuse a channel now and then while it frees closed sessions
        # lazily under load: those are retried, which is why no call failed)
        assert stats.handshakes <= 8  # max_connections


async def test_routing_least_loaded_over_two_hosts(sshd_factory: Callable[..., SSHServer]) -> None:
    one, two = sshd_factory(), sshd_factory()
    async with backend_for(one, two, max_connections=1, max_channels_per_connection=4) as backend:
        assert len(backend.hosts) == 2
        seen: list[str] = []

        async def call() -> None:
            host = backend.pick_host()
            seen.append((await host.run(Command(argv=("sleep", "0.3"), timeout=10))).host)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(call)
                    await anyio.sleep(0.01)
        assert sorted(set(seen)) == sorted(h.name for h in backend.hosts)
        assert seen.count(backend.hosts[0].name) == 4
        assert "2 hosts" in repr(backend)
        assert backend.statistics().connections_open == 2


async def test_reaper_never_closes_a_leased_connection(sshd: SSHServer) -> None:
    """Calls longer than idle_ttl complete (never reaped under a holder); the idle clock starts at their end."""
    async with backend_for(sshd, idle_ttl=0.2, max_connections=1) as backend:
        host = backend.hosts[0]
        seen: list[tuple[int, int, int]] = []  # (exit status, handshakes, reaped) at each end

        async def call(delay: str) -> None:
            result = await host.run(Command(argv=("sleep", delay), timeout=10))
            stats = host.statistics()
            seen.append((result.exit_status or 0, stats.handshakes, stats.connections_reaped))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                # Overlapping calls, each several TTLs long, on the only connection.
                for delay in ("1.0", "0.6", "0.8"):
                    tg.start_soon(call, delay)
                    await anyio.sleep(0.15)
            assert seen == [(0, 1, 0)] * 3  # one connection throughout, never reaped under them
            assert await wait_until(lambda: host.statistics().connections_reaped == 1, within=3)
            assert host.statistics().connections_open == 0
            # The re-created connection is the same kind, host, port and user (never silently local).
            again = await host.run(Command(shell='echo "$SSH_CONNECTION"; id -un', timeout=5))
        lines = again.stdout.data.splitlines()
        assert ssh_connection_of(lines[0]) == ("127.0.0.1", sshd.port)
        assert lines[1].decode() == sshd.user
        stats = host.statistics()
        assert stats.handshakes == stats.connections_reaped + 1  # a reconnect only after a reap
        (connection,) = host.connections()
        assert connection.peer[:2] == ("127.0.0.1", sshd.port)
        assert connection.conn.get_extra_info("send_cipher") == "aes128-gcm@openssh.com"


async def test_stale_and_foreign_release_raise(sshd: SSHServer) -> None:
    async with backend_for(sshd) as backend:
        host = backend.hosts[0]
        with anyio.fail_after(10):
            await host.run(Command(argv=("true",), timeout=5))
        (connection,) = host.connections()
        owner = object()
        lease = host.pool.table.acquire(owner)
        assert lease is not None
        with pytest.raises(LeaseError):
            host.pool.release(Lease(connection, lease.token, object()))
        assert host.statistics().leases_active == 1
        host.pool.release(lease)
        with pytest.raises(LeaseError):
            host.pool.release(lease)
        assert host.statistics().connections_open == 1  # nothing was closed by the bad releases


async def test_aclose_is_idempotent_and_leaves_nothing(sshd: SSHServer) -> None:
    duration = unique_duration()
    backend = backend_for(sshd)
    outcomes: list[object] = []
    try:
        async with backend:
            host = backend.hosts[0]

            async def call() -> None:
                try:
                    outcomes.append(await host.run(sleep_command(duration)))
                except PoolClosed as exc:
                    outcomes.append(exc)

            ws = await host.make_workspace()
            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(call)
                assert await wait_until(lambda: host.statistics().channels_open == 10, within=10)
                with anyio.fail_after(15):
                    await anyio.wait_all_tasks_blocked()
                    await backend.aclose()  # while ten calls run
            await backend.aclose()
        assert len(outcomes) == 10
        assert all(isinstance(o, PoolClosed) for o in outcomes)
        stats = backend.statistics()
        assert stats.closed
        assert stats.connections_open == 0
        assert stats.leases_active == 0
        assert "closed" in repr(backend)
        assert not await anyio.Path(ws).exists()
        assert await no_process_left(f"sleep {duration}") == []
        assert await wait_until(lambda: sshd.session_processes() == [], within=5)
        with pytest.raises(PoolClosed):
            await host.run(Command(argv=("true",), timeout=5))
        with pytest.raises(PoolClosed):
            await backend.start()
    finally:
        kill_leftovers(f"sleep {duration}")


async def test_concurrent_aclose_calls_wait_for_the_first(sshd: SSHServer) -> None:
    backend = backend_for(sshd)
    await backend.start()
    with anyio.fail_after(10):
        await backend.hosts[0].run(Command(argv=("true",), timeout=5))
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(backend.aclose)
    assert backend.statistics().connections_open == 0
    assert await wait_until(lambda: sshd.session_processes() == [], within=5)


async def test_aclose_from_another_task_and_scope(sshd: SSHServer) -> None:
    """Background work is owned by a supervisor task: closing is not tied to the opener's scopes."""
    backend = backend_for(sshd)
    with anyio.move_on_after(30):
        await backend.start()
    with anyio.fail_after(10):
        await backend.hosts[0].run(Command(argv=("true",), timeout=5))
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.aclose)
    assert backend.is_closed()


async def test_host_key_verification_is_on_by_default(sshd: SSHServer, tmp_path: Path) -> None:
    wrong = tmp_path / "known_hosts"
    wrong.write_text(
        f"[127.0.0.1]:{sshd.port} ssh-ed25519 {sshd.keys.other_host_key.with_suffix('.pub').read_text().split()[1]}\n"
    )
    async with backend_for(sshd, known_hosts=str(wrong), connect_retries=3) as backend:
        host = backend.hosts[0]
        with (
            anyio.fail_after(10),
            pytest.raises(BackendUnavailable, match="HostKeyNotVerifiable") as info,
        ):
            await host.run(Command(argv=("true",), timeout=5))
        assert info.value.host == host.name
        assert host.statistics().handshakes == 1  # not retried: a key mismatch is not transient
        assert host.statistics().connections_open == 0


async def test_missing_known_hosts_fails_at_start(sshd: SSHServer, tmp_path: Path) -> None:
    backend = backend_for(sshd, known_hosts=str(tmp_path / "absent"))
    with anyio.fail_after(10), pytest.raises(ConfigError, match="known_hosts"):
        async with backend:
            pass
    assert backend.is_closed()


async def test_skipping_host_key_check_is_explicit_and_logged(
    sshd: SSHServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agent_backend.backends.ssh"):
        backend = backend_for(
            sshd, known_hosts=str(tmp_path / "absent"), insecure_skip_host_key_check=True
        )
    assert any("host key verification is OFF" in r.getMessage() for r in caplog.records)
    async with backend:
        with anyio.fail_after(10):
            result = await backend.hosts[0].run(Command(argv=("true",), timeout=5))
        assert result.exit_status == 0


async def test_statistics_are_frozen(sshd: SSHServer) -> None:
    async with backend_for(sshd) as backend:
        host: SSHHost = backend.hosts[0]
        stats = host.statistics()
        with pytest.raises(AttributeError):
            stats.calls = 3  # type: ignore[misc]
        assert isinstance(backend, SSHBackend)


async def test_workspaces_are_under_the_login_users_own_root_and_a_squatted_root_is_refused(
    sshd: SSHServer, tmp_path: Path
) -> None:
    async with backend_for(sshd) as backend:
        host = backend.hosts[0]
        workspace = await host.make_workspace()
        try:
            # Per remote user: another user of the host has a root of their own.
            assert workspace.startswith(f"/tmp/agent-backend-{os.getuid()}/ws.")
            assert (await anyio.Path(workspace).stat()).st_mode & 0o777 == 0o700
        finally:
            await host.remove_workspace(workspace)
    squatted = tmp_path / "squatted"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, 4242, 4242)  # made first by someone else
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    for root in (squatted, link):
        async with backend_for(sshd, workspace_root=str(root)) as backend:
            with pytest.raises(BackendUnavailable, match="is not a directory of this user"):
                await backend.hosts[0].make_workspace()
    assert list(squatted.iterdir()) == []
