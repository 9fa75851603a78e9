"""Owner records on SSH hosts (agent_backend/backends/ssh/owners.py), against a real OpenSSH
sshd on 127.0.0.1: a daemon SIGKILLed with a workspace and a running command leaves both on
the host, and the next backend to use the host removes them before its first call; a live
owner's workspace, lock and command are never touched; a clean close lets go of the lock and
leaves no holder; a lost connection's lock is taken again.

The sshd runs on this machine as this user, so the remote side is seen here directly (lock
files, ``/proc``). Tests skip without sshd (and the ``namespaces`` ones without bubblewrap),
except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.ssh_helpers import (
    backend_for,
    kill_leftovers,
    lock_is_held,
    no_process_left,
    processes_matching,
    processes_with_token,
    require_remote_walls,
    unique_duration,
    wait_until,
)
from support.sshd import SSHServer

from agent_backend.backends.ssh import SSHBackend, SSHHost
from agent_backend.backends.ssh.owners import lock_path
from agent_backend.dispatch.backend import Command

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

CHILD = Path(__file__).parent / "support" / "ssh_owner_child.py"
TIERS = ["none", "namespaces"]


@pytest.fixture(params=TIERS)
def isolation(request: pytest.FixtureRequest) -> str:
    tier: str = request.param
    if tier == "namespaces":
        require_remote_walls()
    return tier


@pytest.fixture
def root(tmp_path: Path) -> str:
    """A workspace root of this test's own: no other test's owners are in it."""
    return str(tmp_path / "root")


@pytest.fixture
def durations() -> Iterator[list[str]]:
    """Unique sleep durations (``durations.append(unique_duration())``); leftovers killed."""
    made: list[str] = []
    yield made
    for duration in made:
        kill_leftovers(f"sleep {duration}")


def exists(*parts: str) -> bool:
    return os.path.lexists(os.path.join(*parts))


def read_bytes(*parts: str) -> bytes:
    return Path(*parts).read_bytes()


def listing(path: str) -> list[str]:
    return os.listdir(path)


def pool(server: SSHServer, isolation: str, root: str, **overrides: Any) -> SSHBackend:
    return backend_for(
        server, isolation=isolation, workspace_root=root, kill_grace=0.2, **overrides
    )


class Child:
    """A backend in another process (tests/support/ssh_owner_child.py) with a workspace and a
    running ``sleep``; SIGKILLed by the test."""

    def __init__(self, server: SSHServer, isolation: str, root: str, duration: str, log: Path):
        options = server.client_options(
            isolation=isolation, workspace_root=root, sleep=duration, kill_grace=0.2
        )
        self.log = log
        with log.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(options)],
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self.instance = ""
        self.workspace = ""

    async def wait_ready(self) -> None:
        assert self.process.stdout is not None
        with anyio.fail_after(60):
            line = await anyio.to_thread.run_sync(
                self.process.stdout.readline, abandon_on_cancel=True
            )
        words = line.decode().split()
        assert words[:1] == ["READY"], (line, self.log.read_text()[-3000:])
        self.instance, self.workspace = words[1], words[2]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=30) == -signal.SIGKILL

    def cleanup(self) -> None:
        if self.process.poll() is None:
            self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()


async def test_a_successor_removes_what_a_killed_owner_left_and_spares_a_live_peer(
    sshd: SSHServer,
    isolation: str,
    root: str,
    durations: list[str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead_sleep, peer_sleep = unique_duration(), unique_duration()
    durations.extend([dead_sleep, peer_sleep])
    child = Child(sshd, isolation, root, dead_sleep, tmp_path / "child.log")
    try:
        async with pool(sshd, isolation, root) as peer_backend:
            # A live peer: same host, same root, a workspace and a command running.
            peer = peer_backend.hosts[0]
            peer_workspace = await peer.make_workspace()
            await peer.write_file(peer_workspace, "mine.txt", b"still here\n")
            peer_lock = lock_path(root, peer.instance)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    peer.run, Command(argv=("sleep", peer_sleep), cwd=peer_workspace, timeout=300)
                )
                assert await wait_until(
                    lambda: bool(processes_matching(f"sleep {peer_sleep}")), within=30
                )

                await child.wait_ready()
                dead_lock = lock_path(root, child.instance)
                assert child.workspace.startswith(f"{root}/ws.{child.instance}.")
                assert exists(child.workspace, "left-behind.txt")
                assert lock_is_held(dead_lock)
                assert await wait_until(
                    lambda: bool(processes_matching(f"sleep {dead_sleep}")), within=30
                )
                child.kill()
                # Its connection ends with it: sshd closes the channel, the holder reads EOF
                # and exits, and the kernel drops its lock. Its workspace and (without walls)
                # its command stay behind: nothing of the dead process removes them.
                assert await wait_until(lambda: not lock_is_held(dead_lock), within=30)
                assert exists(child.workspace)
                assert exists(dead_lock)

                with caplog.at_level(logging.INFO, logger="agent_backend.backends.ssh"):
                    async with pool(sshd, isolation, root) as successor_backend:
                        successor = successor_backend.hosts[0]
                        with anyio.fail_after(60):
                            result = await successor.run(Command(argv=("true",), timeout=30))
                        assert result.exit_status == 0, result
                        # The sweep ran before the first call: the dead owner's records,
                        # workspace and processes are gone.
                        assert not exists(child.workspace)
                        assert not exists(dead_lock)
                        assert await no_process_left(f"sleep {dead_sleep}", within=30) == []
                        assert processes_with_token(f"{child.instance}.") == []
                        assert lock_is_held(lock_path(root, successor.instance))

                        # The live peer's are untouched.
                        assert lock_is_held(peer_lock)
                        assert read_bytes(peer_workspace, "mine.txt") == b"still here\n"
                        assert processes_matching(f"sleep {peer_sleep}")
                        assert peer.statistics().channels_open == 1  # its call still runs
                        read = await peer.read_file(peer_workspace, "mine.txt", limit=100)
                        assert read.data == b"still here\n"
                tg.cancel_scope.cancel()  # ends the peer's call (its command is killed)
            assert await no_process_left(f"sleep {peer_sleep}", within=30) == []
            await peer.remove_workspace(peer_workspace)
    finally:
        child.cleanup()
    swept = [r.getMessage() for r in caplog.records if "dead owner(s) left" in r.getMessage()]
    assert len(swept) == 1, swept
    assert "removed what 1 dead owner(s) left: 1 workspace(s)" in swept[0]


async def test_a_clean_close_lets_go_of_the_lock_and_leaves_no_holder(
    sshd: SSHServer, isolation: str, root: str
) -> None:
    backend = pool(sshd, isolation, root)
    async with backend:
        host: SSHHost = backend.hosts[0]
        workspace = await host.make_workspace()
        path = lock_path(root, host.instance)
        assert lock_is_held(path)
        assert host.owner_lock.is_held()
        assert len(processes_with_token(f"{host.instance}.owner")) == 1
    # Nothing of this owner is left on the host (its workspace removed at close), so its lock
    # file goes too, and the holder has ended.
    assert not exists(workspace)
    assert not exists(path)
    assert await wait_until(lambda: processes_with_token(f"{host.instance}.") == [], within=10)
    assert not host.owner_lock.is_held()
    await backend.aclose()  # idempotent
    assert listing(os.path.join(root, "owners")) == []


async def test_the_lock_is_taken_again_after_its_connection_is_lost(
    sshd: SSHServer, root: str
) -> None:
    """sshd killed like a crashed host (every connection and command with it): once it is
    back, the lock is held again with the same instance, on a new connection."""
    async with pool(sshd, "none", root, probe_interval=0.5, retry_backoff_max=0.5) as backend:
        host = backend.hosts[0]
        workspace = await host.make_workspace()
        path = lock_path(root, host.instance)
        (holder,) = processes_with_token(f"{host.instance}.owner")
        assert host.owner_lock.takes == 1
        await sshd.akill()
        assert await wait_until(lambda: not lock_is_held(path), within=30)
        await sshd.astart()
        assert await wait_until(lambda: lock_is_held(path), within=60)
        assert await wait_until(host.owner_lock.is_held, within=30)
        (again,) = processes_with_token(f"{host.instance}.owner")
        assert again != holder
        assert host.owner_lock.takes == 2
        with anyio.fail_after(60):
            result = await host.run(Command(argv=("echo", "back"), cwd=workspace, timeout=30))
        assert result.stdout.text() == "back\n"
        await host.remove_workspace(workspace)
    assert not exists(path)


async def test_a_host_that_refuses_the_owner_records_is_still_used(
    sshd: SSHServer, root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``owners/`` is a symbolic link: never followed; the lock and the sweep fail with a
    WARNING that says why, and the host makes workspaces and runs commands all the same."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.mkdir(root, 0o700)
    os.symlink(elsewhere, os.path.join(root, "owners"))
    with caplog.at_level(logging.WARNING, logger="agent_backend.backends.ssh"):
        async with pool(sshd, "none", root) as backend:
            host = backend.hosts[0]
            workspace = await host.make_workspace()
            with anyio.fail_after(60):
                result = await host.run(Command(argv=("echo", "ok"), cwd=workspace, timeout=30))
            assert result.stdout.text() == "ok\n"
            assert not host.owner_lock.is_held()
            await host.remove_workspace(workspace)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "could not take this owner's lock" in m and "not a directory of this user" in m
        for m in warnings
    ), warnings
    assert any("could not remove what dead owners left" in m for m in warnings), warnings
    assert listing(str(elsewhere)) == []
