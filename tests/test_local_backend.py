"""LocalBackend with real subprocesses, what only the local host does: its two spawn paths,
the environment its config lets through, its scratch directory, processes that escape or
outlive their call, memory under huge output, its slots, file operations that never block
the loop, and what aclose leaves behind. What every host must do is tests/test_host_contract.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from support.proc_helpers import (
    entries,
    rss_bytes,
    slow_local_disk,
    spawn_on,
    wait_dead,
    watch_loop,
)
from support.ssh_helpers import wait_until

from agent_backend.backends.local import LocalBackend, LocalHost, LocalPoolConfig
from agent_backend.backends.local import backend as local_module
from agent_backend.backends.local import owner as local_owner
from agent_backend.backends.local import spawn as local_spawn
from agent_backend.dispatch import Command
from agent_backend.errors import BackendUnavailable, PoolClosed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def spawn_with(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"posix_spawn"`` (libc's, in the spawner's thread: local/spawn.py), ``"popen"`` (Popen on the
    event loop, where libc falls short) or ``"asyncio"`` (no pidfds either)."""
    spawn_on("asyncio" if path == "asyncio" else "pidfd", monkeypatch)
    if path == "popen":
        monkeypatch.setattr(local_spawn, "_PROBED", True)
        monkeypatch.setattr(local_spawn, "_LIBC", None)
    elif path == "posix_spawn" and not local_spawn.posix_spawn_supported():
        if os.environ.get("CI") == "true":
            pytest.fail("this libc has no posix_spawn addchdir_np/addclosefrom_np (glibc 2.34+)")
        pytest.skip("no posix_spawn addchdir_np/addclosefrom_np here (glibc 2.34+)")


@pytest.fixture(params=["posix_spawn", "popen", "asyncio"])
async def host(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[LocalHost]:
    """A started local host; every test runs on the three ways of spawning (local/process.py)."""
    spawn_with(request.param, monkeypatch)
    config = LocalPoolConfig(
        isolation="none", workspace_root=str(tmp_path / "root"), kill_grace=0.5
    )
    async with LocalBackend(config) as backend:
        yield backend.host


def entries_of(path: Path) -> list[str]:
    return os.listdir(path) if path.is_dir() else []


def sh(line: str, timeout: float = 10.0, **kwargs: object) -> Command:
    return Command(shell=line, timeout=timeout, **kwargs)  # type: ignore[arg-type]


# -- running commands ---------------------------------------------------------------------------


async def test_commands_cost_no_thread_on_the_pidfd_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.11's asyncio waits for each child in a thread of its own; beside a busy
    # server those threads fought the event loop for the GIL. With a pidfd, none is made.
    spawn_on("pidfd", monkeypatch)
    config = LocalPoolConfig(
        isolation="none", workspace_root=str(tmp_path / "root"), kill_grace=0.5
    )
    async with LocalBackend(config) as backend:
        await commands_start_no_thread(backend.host, tmp_path)


async def commands_start_no_thread(host: LocalHost, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    before = set(threading.enumerate())
    new: list[set[threading.Thread]] = []

    async def running() -> None:
        assert await wait_until(lambda: len(entries_of(marks)) == 8, within=20)
        new.append(set(threading.enumerate()) - before)
        group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        for i in range(8):
            group.start_soon(host.run, sh(f"touch {marks}/{i}; sleep 30", timeout=40))
        marks.mkdir()
        group.start_soon(running)
    assert new == [set()]


async def test_environment_is_only_what_the_config_lets_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    monkeypatch.setenv("PASS_ME", "yes")
    config = LocalPoolConfig(
        isolation="none",
        workspace_root=str(tmp_path),
        env_passthrough=("PATH", "PASS_ME"),
        extra_env={"FROM_CONFIG": "c", "OVERRIDDEN": "config"},
    )
    async with LocalBackend(config) as backend:
        result = await backend.host.run(
            Command(argv=("env",), env={"OVERRIDDEN": "call", "FROM_CALL": "x"}, timeout=5)
        )
    env = dict(line.split("=", 1) for line in result.stdout.text().splitlines())
    env.pop("PWD", None)
    assert env == {
        "PATH": os.environ["PATH"],
        "PASS_ME": "yes",
        "FROM_CONFIG": "c",
        "OVERRIDDEN": "call",
        "FROM_CALL": "x",
    }


async def test_without_a_cwd_commands_run_in_a_private_scratch(host: LocalHost) -> None:
    scratch = (await host.run(sh("pwd"))).stdout.text().strip()
    assert scratch != os.getcwd()
    assert os.path.basename(scratch).startswith("agent-backend-scratch-")


async def test_a_missing_program_is_named_and_a_nul_in_argv_is_a_result(host: LocalHost) -> None:
    missing = await host.run(Command(argv=("no-such-program-xyz",), timeout=5))
    assert missing.exit_status == 127
    assert b"command not found" in missing.stderr.data
    nul = await host.run(Command(argv=("echo", "a\x00b"), timeout=5))
    assert nul.exit_status == 126


# -- process groups: nothing outlives its call (timeout, cancellation, normal end) --------------


async def test_a_leader_killed_by_sigterm_always_reports_its_signal(host: LocalHost) -> None:
    # The leader is the sleeping process itself: the group is found empty while the leader
    # may still be a zombie nobody collected; its status must be waited for, every time.
    for _ in range(20):
        result = await host.run(sh("exec sleep 30", timeout=0.1))
        assert result.timed_out
        assert (result.exit_status, result.signal) == (None, "SIGTERM")


async def test_cancellation_at_any_moment_leaks_no_process(host: LocalHost, tmp_path: Path) -> None:
    # Cut at every stage: queueing, spawning, running. Nothing may survive,
    # and no pipe may be left open (-W error turns an unclosed transport into a failure).
    delays = [0, 0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02]
    for index, delay in enumerate(delays):
        with anyio.move_on_after(delay):
            await host.run(sh(f"echo $$ > {tmp_path}/{index}; sleep 5 & sleep 5"))
    for index in range(len(delays)):
        pid_file = tmp_path / str(index)
        if pid_file.exists() and pid_file.read_text().strip():
            assert await wait_dead(int(pid_file.read_text()), within=1.0)
    assert host.calls_in_flight() == 0
    import gc

    gc.collect()


async def test_processes_left_behind_at_a_normal_exit_are_ended(host: LocalHost) -> None:
    started = time.monotonic()
    result = await host.run(sh("sleep 60 >/dev/null 2>&1 & echo $!"))
    assert result.exit_status == 0
    assert time.monotonic() - started < 2
    assert await wait_dead(int(result.stdout.text()), within=1.0)


async def test_a_background_process_holding_stdout_does_not_hang_the_call(
    host: LocalHost,
) -> None:
    started = time.monotonic()
    result = await host.run(sh("sleep 60 & echo started"))
    assert result.exit_status == 0
    assert result.stdout.text() == "started\n"
    assert time.monotonic() - started < 2


async def test_an_escaped_process_holding_the_pipe_costs_a_bounded_drain(host: LocalHost) -> None:
    # setsid leaves the call's group: it cannot be signalled with it, but the
    # call still returns (after a bounded drain) instead of waiting for EOF.
    result = await host.run(sh("setsid sleep 3 & echo $!", timeout=10))
    assert result.exit_status == 0
    escaped = int(result.stdout.text())
    os.kill(escaped, signal.SIGKILL)


# -- output is bounded in memory -----------------------------------------------------------------


async def test_a_gigabyte_of_output_costs_bounded_memory(host: LocalHost) -> None:
    peak = baseline = rss_bytes()

    async def sample(stop: anyio.Event) -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            await anyio.sleep(0.005)

    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(sample, stop)
        result = await host.run(
            Command(shell="yes | head -c 1000000000", timeout=50, output_limit=4096)
        )
        stop.set()
    assert result.exit_status == 0
    assert result.stdout.total_bytes == 1_000_000_000
    assert result.stdout.truncated
    assert len(result.stdout.data) < 4096 + 100
    assert result.stdout.data.startswith(b"y\ny\n")
    assert b"bytes omitted" in result.stdout.data
    assert peak - baseline < 40 * 1024 * 1024, f"RSS grew by {(peak - baseline) >> 20} MiB"


# -- concurrency ---------------------------------------------------------------------------------


async def test_max_concurrent_calls_queues_and_the_wait_counts_against_the_timeout(
    tmp_path: Path,
) -> None:
    config = LocalPoolConfig(isolation="none", workspace_root=str(tmp_path), max_concurrent_calls=2)
    async with LocalBackend(config) as backend:
        host = backend.host
        results = []

        async def one() -> None:
            results.append(await host.run(sh("sleep 0.4", timeout=0.6)))

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(one)
            await anyio.sleep(0.1)
            assert host.statistics().calls_active == 2
            assert host.statistics().calls_queued == 2
            assert host.calls_in_flight() == 4
        elapsed = time.monotonic() - started
    # Two ran at once; the other two waited 0.4 s of their 0.6 s and timed out.
    assert sorted(r.timed_out for r in results) == [False, False, True, True]
    assert elapsed < 1.5


# -- files ---------------------------------------------------------------------------------------


async def test_reading_a_fifo_does_not_hang(host: LocalHost) -> None:
    workspace = await host.make_workspace()
    os.mkfifo(f"{workspace}/pipe")
    with anyio.fail_after(2):
        with pytest.raises(OSError, match="not a regular file"):
            await host.read_file(workspace, "pipe", limit=10)
        with pytest.raises(OSError, match=r"No such device or address|not a regular file"):
            await host.write_file(workspace, "pipe", b"x")


# -- lifecycle -----------------------------------------------------------------------------------


async def test_a_closed_workspace_is_gone_at_once_and_its_tree_removed_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    removing = threading.Event()  # cleared: a removal of a tree is held
    real_remove = local_owner.remove_tree

    def held_remove(path: str) -> None:
        removing.wait(10)
        real_remove(path)

    monkeypatch.setattr(local_module, "remove_tree", held_remove)
    backend = LocalBackend(
        LocalPoolConfig(isolation="none", workspace_root=str(root), spare_workspaces=0)
    )
    await backend.start()
    try:
        host = backend.host
        workspace = await host.make_workspace()
        Path(workspace, "out.txt").write_text("x")  # noqa: ASYNC240
        with anyio.fail_after(5):
            await host.remove_workspace(workspace)  # does not wait for the tree's removal
        assert not await anyio.Path(workspace).exists()
        trash = [n for n in entries_of(root) if "-trash-" in n]
        assert len(trash) == 1, entries_of(root)
        removing.set()
        assert await wait_until(
            lambda: not any("-trash-" in n for n in entries_of(root)), within=10
        )
    finally:
        removing.set()
        await backend.aclose()
    assert entries_of(root) == []


async def test_aclose_ends_calls_removes_workspaces_and_is_idempotent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    backend = LocalBackend(
        LocalPoolConfig(isolation="none", workspace_root=str(root), kill_grace=0.5)
    )
    await backend.start()
    host = backend.host
    workspaces = [await host.make_workspace() for _ in range(3)]
    # Spares follow the most in use at once: three, made in the background.
    assert await wait_until(lambda: len(host.spare_workspaces()) == 3, within=10)
    # three workspaces, three spares, the scratch directory and the owner lock (local/owner.py)
    assert len(entries(root)) == 8
    pid_file = tmp_path / "pid"
    errors: list[BaseException] = []

    async def long_call() -> None:
        try:
            await host.run(sh(f"sleep 60 & echo $! > {pid_file}; sleep 60", timeout=30))
        except PoolClosed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        await anyio.sleep(0.3)
        started = time.monotonic()
        async with anyio.create_task_group() as closers:
            closers.start_soon(backend.aclose)
            closers.start_soon(backend.aclose)
        assert time.monotonic() - started < 3
    assert len(errors) == 1
    assert await wait_dead(int(pid_file.read_text()), within=1.0)
    assert entries(root) == []
    for workspace in workspaces:
        assert not await anyio.Path(workspace).exists()
    await backend.aclose()
    assert backend.is_closed()
    assert "closed" in repr(backend)
    with pytest.raises(PoolClosed):
        await host.run(sh("true"))
    with pytest.raises(PoolClosed):
        await host.make_workspace()


async def test_a_missing_default_cwd_fails_at_start(tmp_path: Path) -> None:
    config = LocalPoolConfig(
        isolation="none", workspace_root=str(tmp_path), default_cwd=str(tmp_path / "nope")
    )
    with pytest.raises(BackendUnavailable, match="not a directory"):
        async with LocalBackend(config):
            pass


async def test_statistics_and_repr(host: LocalHost) -> None:
    await host.make_workspace()
    stats = host.statistics()
    assert (stats.calls_active, stats.calls_queued, stats.workspaces, stats.closed) == (
        0,
        0,
        1,
        False,
    )
    assert repr(host) == "<LocalHost [calls: 0 active, 0 queued | workspaces: 1]>"


async def test_the_event_loop_stays_responsive_under_many_calls(host: LocalHost) -> None:
    # Nothing slow runs on the event loop thread (it would freeze every other call). Every file
    # operation takes 0.3 s here: 30 workspaces in series would take 9 s.
    # Only for the test's own work: the backend's close (teardown) runs at disk speed.
    with pytest.MonkeyPatch.context() as slow:
        slow_local_disk(slow, host, 0.3)
        started = time.monotonic()
        async with watch_loop() as stall, anyio.create_task_group() as work:
            for _ in range(30):
                work.start_soon(host.make_workspace)
            for _ in range(8):
                work.start_soon(host.run, sh("head -c 3000000 /dev/zero"))
        elapsed = time.monotonic() - started
    assert elapsed < 4, f"took {elapsed:.1f} s: workspaces were made in series"
    assert stall.worst < 1.0, f"the event loop stalled for {stall.worst:.3f} s"
    assert host.statistics().workspaces == 30
