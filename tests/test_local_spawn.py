"""The local backend's spawn, on each of its three paths (libc's posix_spawn in the spawner's
thread, Popen on the event loop, asyncio's transport): what a new spawn path could get wrong.
Descriptors leaked or inherited, signals left ignored, the process group, the child's PATH,
output at the cap, big stdin, many children at once, cancellation mid-read, and a child whose
caller went away."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from support.proc_helpers import wait_dead
from support.ssh_helpers import wait_until
from test_local_backend import spawn_with

from agent_backend.backends.local import LocalBackend, LocalHost, LocalPoolConfig
from agent_backend.backends.local import spawn as local_spawn
from agent_backend.dispatch import Command
from agent_backend.errors import PoolClosed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PATHS = ["posix_spawn", "popen", "asyncio"]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def settled_fds(expected: set[str], within: float = 5.0) -> set[str]:
    """This process's descriptors once they match ``expected`` (or after ``within`` seconds)."""
    await wait_until(lambda: open_fds() == expected, within=within)
    return open_fds()


@pytest.fixture(params=PATHS)
async def host(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[LocalHost]:
    spawn_with(request.param, monkeypatch)
    config = LocalPoolConfig(
        isolation="none",
        workspace_root=str(tmp_path / "root"),
        kill_grace=0.5,
        max_concurrent_calls=128,
    )
    async with LocalBackend(config) as backend:
        yield backend.host


def sh(line: str, timeout: float = 10.0, **kwargs: object) -> Command:
    return Command(shell=line, timeout=timeout, **kwargs)  # type: ignore[arg-type]


async def test_no_descriptor_leaks_whatever_way_a_call_ends(
    host: LocalHost, tmp_path: Path
) -> None:
    for _ in range(3):  # warm: the event loop's own descriptors are made on first use
        await host.run(sh("echo warm"))
    before = open_fds()
    missing_cwd = str(tmp_path / "gone")
    for _ in range(5):
        assert (await host.run(sh("echo out; echo err >&2"))).exit_status == 0
        assert (await host.run(sh("cat", stdin=b"x" * 200_000))).stdout.total_bytes == 200_000
        assert (
            await host.run(Command(argv=("no-such-program-xyz",), timeout=5))
        ).exit_status == 127
        assert (
            await host.run(Command(argv=("true",), cwd=missing_cwd, timeout=5))
        ).exit_status == 127
        assert (await host.run(Command(argv=("echo", "a\x00b"), timeout=5))).exit_status == 126
        assert (await host.run(sh("sleep 30", timeout=0.2))).timed_out
        assert (await host.run(sh("sleep 1 & echo held"))).exit_status == 0
        with anyio.move_on_after(0.2):  # cut mid-read: the command prints without end
            await host.run(sh("yes", timeout=30))
    assert await settled_fds(before) == before


async def test_closing_the_backend_gives_back_every_descriptor_and_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in PATHS:
        spawn_with(path, monkeypatch)
        before = open_fds()
        config = LocalPoolConfig(isolation="none", workspace_root=str(tmp_path / path))
        async with LocalBackend(config) as backend:
            assert (await backend.host.run(sh("echo hi"))).stdout.data == b"hi\n"
        assert await settled_fds(before) == before, path
        assert not spawner_threads(), path
        monkeypatch.undo()


def spawner_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "agent-backend-spawner" and t.is_alive()]


async def test_the_child_inherits_no_descriptor_and_no_ignored_signal(host: LocalHost) -> None:
    # An inheritable descriptor of ours must not reach the command (close_fds); Python ignores
    # SIGPIPE and SIGXFSZ, and ignored signals survive exec: the command gets them back.
    read, write = os.pipe()
    os.set_inheritable(write, True)
    try:
        fds = await host.run(Command(argv=("ls", "/proc/self/fd"), timeout=5))
        status = await host.run(Command(argv=("cat", "/proc/self/status"), timeout=5))
    finally:
        os.close(read)
        os.close(write)
    # ls sees 0-2 and the descriptor it opened to list the directory.
    assert sorted(int(n) for n in fds.stdout.text().split()) == [0, 1, 2, 3]
    fields = dict(line.split(":\t", 1) for line in status.stdout.text().splitlines())
    ignored = int(fields["SigIgn"], 16)
    blocked = int(fields["SigBlk"], 16)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (signum - 1)), signum.name
    assert blocked == 0
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # ours is left as it was
    # A pipeline whose reader leaves early ends (by SIGPIPE) instead of running on.
    piped = await host.run(sh("yes | head -n 2", timeout=10))
    assert (piped.exit_status, piped.stdout.data, piped.timed_out) == (0, b"y\ny\n", False)


async def test_the_child_leads_its_own_group_in_our_session(host: LocalHost) -> None:
    result = await host.run(Command(argv=("cat", "/proc/self/stat"), timeout=5))
    raw = result.stdout.data
    pid = int(raw.split(b" ", 1)[0])
    fields = raw[raw.rfind(b")") + 2 :].split()
    pgrp, session = int(fields[2]), int(fields[3])
    assert pgrp == pid
    assert session == os.getsid(0)


async def test_a_bare_program_name_is_found_on_the_childs_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "my-tool-xyz"
    tool.write_text('#!/bin/sh\necho found "$@"\n')
    tool.chmod(0o755)
    (bin_dir / "not-executable-xyz").write_text("#!/bin/sh\necho no\n")
    for path in PATHS:
        spawn_with(path, monkeypatch)
        config = LocalPoolConfig(
            isolation="none",
            workspace_root=str(tmp_path / path),
            extra_env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
        )
        async with LocalBackend(config) as backend:
            found = await backend.host.run(Command(argv=("my-tool-xyz", "a b"), timeout=5))
            assert (found.exit_status, found.stdout.data) == (0, b"found a b\n"), path
            # Not on our own PATH: the child's is what counts.
            assert shutil.which("my-tool-xyz") is None
            denied = await backend.host.run(Command(argv=("not-executable-xyz",), timeout=5))
            assert denied.exit_status in (126, 127), path
            relative = await backend.host.run(
                Command(argv=("./my-tool-xyz",), cwd=str(bin_dir), timeout=5)
            )
            assert relative.stdout.data == b"found\n", path
            directory = await backend.host.run(Command(argv=(str(bin_dir),), timeout=5))
            assert directory.exit_status == 126, path
        monkeypatch.undo()


@pytest.mark.parametrize("extra", [0, 1])
async def test_output_exactly_at_the_cap_is_whole_and_one_byte_more_is_truncated(
    host: LocalHost, extra: int
) -> None:
    limit = 100_000
    result = await host.run(
        Command(shell=f"head -c {limit + extra} /dev/zero >&2", timeout=10, output_limit=limit)
    )
    assert result.stderr.total_bytes == limit + extra
    assert result.stderr.truncated is bool(extra)
    if not extra:
        assert result.stderr.data == b"\0" * limit
    assert result.stdout.total_bytes == 0


async def test_stdin_larger_than_a_pipe_reaches_the_command(host: LocalHost) -> None:
    data = os.urandom(4 << 20)
    result = await host.run(Command(argv=("sha256sum",), stdin=data, timeout=20))
    assert result.stdout.text().split()[0] == hashlib.sha256(data).hexdigest()


async def test_many_concurrent_children_each_get_their_own_output(host: LocalHost) -> None:
    results: dict[int, bytes] = {}

    async def one(i: int) -> None:
        result = await host.run(Command(argv=("echo", str(i)), timeout=30))
        assert result.exit_status == 0
        results[i] = result.stdout.data

    async with anyio.create_task_group() as group:
        for i in range(300):
            group.start_soon(one, i)
    assert results == {i: f"{i}\n".encode() for i in range(300)}


async def test_cancelled_mid_read_the_group_is_ended(host: LocalHost, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with anyio.move_on_after(0.3) as scope:
        await host.run(sh(f"echo $$ > {pid_file}; yes", timeout=30))
    assert scope.cancelled_caught
    assert await wait_dead(int(pid_file.read_text()))


# -- the spawner itself -----------------------------------------------------------------------------


def spawner_or_skip() -> local_spawn.Spawner:
    if not local_spawn.posix_spawn_supported():
        if os.environ.get("CI") == "true":
            pytest.fail("this libc has no posix_spawn addchdir_np/addclosefrom_np (glibc 2.34+)")
        pytest.skip("no posix_spawn addchdir_np/addclosefrom_np here (glibc 2.34+)")
    return local_spawn.Spawner()


async def test_a_child_whose_caller_went_away_is_killed_and_reaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = open_fds()
    spawner = spawner_or_skip()
    orphans: list[int] = []
    deliver = spawner._deliver

    def watched(outcomes: list[tuple[asyncio.Future[local_spawn.Spawned], object]]) -> None:
        for future, outcome in outcomes:
            if future.cancelled() and isinstance(outcome, local_spawn.Spawned):
                orphans.append(outcome.pid)
        deliver(outcomes)  # type: ignore[arg-type]

    monkeypatch.setattr(spawner, "_deliver", watched)
    try:
        with anyio.move_on_after(0):  # not shielded, as a caller must: cancelled at once
            await spawner.spawn(["/bin/sleep", "30"], cwd=str(tmp_path), env={}, stdin=False)
        assert await wait_until(lambda: bool(orphans), within=10)
        # Killed and reaped: not running, and not left a zombie of ours.
        assert await wait_until(lambda: not os.path.exists(f"/proc/{orphans[0]}"), within=5)
    finally:
        await spawner.aclose()
    assert await settled_fds(before) == before


async def test_the_spawner_closes_once_and_refuses_spawns_after(tmp_path: Path) -> None:
    spawner = spawner_or_skip()
    assert "running" in repr(spawner)
    spawned = await spawner.spawn(["true"], cwd=str(tmp_path), env={"PATH": os.defpath}, stdin=True)
    for fd in (spawned.pidfd, spawned.stdin, spawned.stdout, spawned.stderr):
        assert fd is not None
        os.close(fd)
    await anyio.to_thread.run_sync(os.waitpid, spawned.pid, 0)
    await spawner.aclose()
    await spawner.aclose()
    assert spawner.is_closed()
    assert "closed" in repr(spawner)
    assert not spawner_threads()
    with pytest.raises(PoolClosed):
        await spawner.spawn(["true"], cwd=str(tmp_path), env={}, stdin=False)
