"""The Host contract, run against every kind of host: this machine (both ways of spawning a
child) and an SSH host on a real OpenSSH sshd on 127.0.0.1.

What every :class:`~agent_backend.dispatch.backend.Host` must keep (its docstring and
``dispatch/backend.py``'s): a command that ran is a result, whatever its exit status; argv
runs without a shell; stdin, env and cwd are what the call says; output is bounded, its
head and tail kept; a timeout or a cancellation ends every process the call started;
workspaces are private, real paths, removed with everything in them, and a path the host
did not make is never removed; file operations resolve their paths beneath the workspace
with the host's kernel (a path that leaves it, even through a symlink, is refused; one that
stays inside through a symlink works), refuse files with more than one hard link, return
names raw, and report other errors as the matching ``OSError``;
a host refuses calls before it starts and after it closes, and closing ends the calls in
flight. What only one kind of host does (the local host's scratch directory and spawn
paths, the SSH pool's connections and remote kills) is tested in that host's own files.

The SSH host runs on this machine as this user, so its processes are local processes: the
same checks (pids, ``pgrep``) see what a call left behind on either host. Without sshd the
SSH variant skips, except under ``CI=true``, where it fails (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.proc_helpers import spawn_on, wait_dead
from support.ssh_helpers import (
    backend_for,
    kill_leftovers,
    no_process_left,
    unique_duration,
    wait_until,
)
from support.sshd import SSHServer

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.dispatch.backend import Backend, Command
from agent_backend.errors import PathOutsideWorkspace, PoolClosed, PoolError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KILL_GRACE = 0.3
"""Seconds between TERM and KILL on every host under test."""
HOST_ENV = {"HOST_VAR": "from host", "SHARED": "host"}
"""The environment every command of the host under test gets (a call's own env wins)."""


@dataclasses.dataclass
class Target:
    """A started host under test, and what differs between the kinds of host."""

    kind: str
    make: Callable[[], Backend]
    """A new backend like the one running (not started)."""
    backend: Backend
    name: str
    """The host's name, as results carry it."""
    term: str
    kill: str
    """How the host names SIGTERM and SIGKILL in ``CommandResult.signal``."""
    workspace_prefix: str
    idle: Callable[[], bool]
    """True when the host holds nothing for any call (no slot, lease or channel)."""

    @property
    def host(self) -> Any:
        return self.backend.hosts[0]


def _local(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Callable[[], Backend], str]:
    """The local backend's maker, and the prefix of its workspaces' paths: without walls, so
    that its spawn paths are the ones under test (tests/test_sandbox.py runs the namespaces
    tier's contract: stdin, cwd, env, output, timeouts, process groups)."""
    spawn_on(request.param, request.getfixturevalue("monkeypatch"))
    root = tmp_path / "root"
    config = LocalPoolConfig(
        isolation="none", workspace_root=str(root), kill_grace=KILL_GRACE, extra_env=HOST_ENV
    )
    return (lambda: LocalBackend(config)), f"{os.path.realpath(root)}/agent-backend-ws-"


@pytest.fixture(params=["local-pidfd", "local-asyncio", "ssh"])
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Target]:
    if request.param == "ssh":
        sshd: SSHServer = request.getfixturevalue("sshd")

        def make() -> Backend:
            # The contract's mechanics (pids, pid files in /tmp) are those of an unwalled host.
            return backend_for(sshd, kill_grace=KILL_GRACE, env=HOST_ENV, isolation="none")

        async with make() as backend:
            host = backend.hosts[0]

            def ssh_idle() -> bool:
                s = host.statistics()
                return (s.leases_active, s.leases_queued, s.channels_open) == (0, 0, 0)

            yield Target(
                "ssh",
                make,
                backend,
                name=f"{sshd.user}@127.0.0.1:{sshd.port}",
                term="TERM",
                kill="KILL",
                workspace_prefix=f"/tmp/agent-backend-{os.getuid()}/ws.",
                idle=ssh_idle,
            )
        return
    make, prefix = _local(request, tmp_path)
    async with make() as backend:
        host = backend.hosts[0]

        def local_idle() -> bool:
            s = host.statistics()
            return (s.calls_active, s.calls_queued) == (0, 0)

        yield Target(
            request.param,
            make,
            backend,
            name="local",
            term="SIGTERM",
            kill="SIGKILL",
            workspace_prefix=prefix,
            idle=local_idle,
        )


@pytest.fixture
def duration() -> object:
    """A sleep duration only this test's processes use (found with pgrep)."""
    value = unique_duration()
    yield value
    kill_leftovers(f"sleep {value}")


def sh(line: str, timeout: float = 10.0, **kwargs: Any) -> Command:
    return Command(shell=line, timeout=timeout, **kwargs)


def lines(output: bytes) -> list[str]:
    return output.decode().splitlines()


# -- results ----------------------------------------------------------------------------------


async def test_exit_status_stdout_and_stderr_are_kept_apart(target: Target) -> None:
    with anyio.fail_after(10):
        result = await target.host.run(sh("echo out; echo err >&2; exit 3"))
    assert (result.exit_status, result.signal, result.timed_out) == (3, None, False)
    assert (result.stdout.data, result.stderr.data) == (b"out\n", b"err\n")
    assert result.host == target.host.name == target.name
    assert 0 < result.duration < 5


async def test_argv_runs_without_a_shell(target: Target) -> None:
    tricky = ("a b", "it's", "$HOME", "`id`", ";", "*", "", "a b; echo INJECTED $(id) `id` > x")
    with anyio.fail_after(10):
        argv = await target.host.run(Command(argv=("printf", "%s|", *tricky), timeout=5))
        keyword = await target.host.run(Command(argv=("if",), timeout=5))
        missing = await target.host.run(Command(argv=("no-such-program-xyz",), timeout=5))
    assert argv.exit_status == 0
    assert argv.stdout.data == "".join(f"{word}|" for word in tricky).encode()
    assert argv.stderr.data == b""  # nothing of the host's own machinery shows
    assert keyword.exit_status == 127  # a program named "if", not shell syntax
    assert missing.exit_status == 127


async def test_a_command_killed_by_a_signal_reports_it(target: Target) -> None:
    with anyio.fail_after(10):
        result = await target.host.run(sh("kill -9 $$"))
    assert (result.exit_status, result.signal, result.timed_out) == (None, target.kill, False)


# -- what the call says: stdin, env, cwd --------------------------------------------------------


async def test_stdin_is_written_and_closed_and_absent_input_is_empty(target: Target) -> None:
    host = target.host
    data = os.urandom(1_000_000)  # more than a pipe buffer: written while the command reads
    with anyio.fail_after(20):
        digest = await host.run(Command(argv=("sha256sum",), stdin=data, timeout=10))
        no_input = await host.run(Command(argv=("cat",), timeout=5))  # empty, not left open
        no_input_line = await host.run(sh("cat; echo done", timeout=5))
        empty_input = await host.run(Command(argv=("wc", "-c"), stdin=b"", timeout=5))
        ignored = await host.run(Command(argv=("true",), stdin=b"x" * 5_000_000, timeout=5))
    assert digest.stdout.text().split()[0] == hashlib.sha256(data).hexdigest()
    assert (no_input.exit_status, no_input.stdout.data) == (0, b"")
    assert no_input_line.stdout.text() == "done\n"
    assert (empty_input.exit_status, empty_input.stdout.data.strip()) == (0, b"0")
    assert ignored.exit_status == 0  # a command that ignores its input does not hang the call


async def test_env_is_the_hosts_with_the_calls_over_it(target: Target) -> None:
    with anyio.fail_after(10):
        result = await target.host.run(
            sh(
                'echo "$HOST_VAR|$SHARED|$CALL_VAR"',
                env={"CALL_VAR": "x y'z", "SHARED": "call"},
            )
        )
    assert result.stdout.text() == "from host|call|x y'z\n"


async def test_a_bad_environment_variable_name_is_refused(target: Target) -> None:
    # A name no shell can export (BAD-NAME) never reaches a host: the Command refuses it,
    # so the local host cannot hand it to a child while the SSH host's shell would choke.
    with pytest.raises(ValueError, match="environment variable"):
        await target.host.run(Command(argv=("true",), env={"BAD-NAME": "1"}, timeout=5))


async def test_cwd_is_the_given_directory_and_a_missing_one_is_a_result(target: Target) -> None:
    host = target.host
    with anyio.fail_after(10):
        workspace = await host.make_workspace()
        pinned = await host.run(sh("pwd", cwd=workspace))
        gone = await host.run(sh("pwd", cwd=f"{workspace}/nope"))
    assert pinned.stdout.text().strip() == workspace
    assert gone.exit_status == 127
    assert f"{workspace}/nope".encode() in gone.stderr.data


# -- output is bounded: head and tail kept -------------------------------------------------------


async def test_output_is_bounded_head_and_tail_kept(target: Target) -> None:
    host = target.host
    with anyio.fail_after(20):
        numbers = await host.run(Command(shell="seq 1 100000", timeout=5, output_limit=100))
        zeros = await host.run(
            Command(
                shell="printf start; head -c 5000000 /dev/zero; printf end",
                output_limit=1000,
                timeout=15,
            )
        )
    text = numbers.stdout.text()
    assert text.startswith("1\n2\n3\n")
    assert text.endswith("99999\n100000\n")
    assert numbers.stdout.total_bytes == len("".join(f"{i}\n" for i in range(1, 100001)))
    assert zeros.stdout.truncated
    assert zeros.stdout.total_bytes == 5_000_008
    assert zeros.stdout.data.startswith(b"start")
    assert zeros.stdout.data.endswith(b"end")
    assert len(zeros.stdout.data) < 1100


# -- nothing outlives its call: timeout and cancellation -----------------------------------------


async def test_timeout_ends_the_whole_process_group(target: Target, duration: str) -> None:
    host = target.host
    line = f"echo started; sleep {duration} & echo $!; sleep {duration}; echo never"
    started = time.monotonic()
    with anyio.fail_after(10):
        result = await host.run(sh(line, timeout=0.5))
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert (result.exit_status, result.signal) == (None, target.term)
    started_line, child = lines(result.stdout.data)  # what it printed before is kept
    assert started_line == "started"
    assert elapsed < 0.5 + KILL_GRACE + 2.0  # timeout + grace + a bounded kill path
    assert await wait_dead(int(child), within=1.0)
    assert await no_process_left(f"sleep {duration}") == []
    with anyio.fail_after(10):
        assert (await host.run(Command(argv=("true",), timeout=5))).exit_status == 0


async def test_a_group_that_ignores_sigterm_gets_sigkill(target: Target, duration: str) -> None:
    line = f"trap '' TERM; (trap '' TERM; sleep {duration}) & echo $!; sleep {duration}; echo never"
    started = time.monotonic()
    with anyio.fail_after(10):
        result = await target.host.run(sh(line, timeout=0.3))
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.signal == target.kill
    assert 0.3 + KILL_GRACE <= elapsed < 0.3 + KILL_GRACE + 2.0  # TERM, the grace, then KILL
    assert await wait_dead(int(result.stdout.text()), within=1.0)
    assert await no_process_left(f"sleep {duration}") == []


async def test_cancellation_ends_the_process_group(
    target: Target, duration: str, tmp_path: Path
) -> None:
    host = target.host
    pid_file = tmp_path / "pid"
    line = f"sleep {duration} & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; sleep {duration}"
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(host.run, sh(line, timeout=30))
            assert await wait_until(pid_file.exists, within=8)
            group.cancel_scope.cancel()
        assert await wait_dead(int(pid_file.read_text()), within=1.0)
        assert await no_process_left(f"sleep {duration}") == []
        assert host.calls_in_flight() == 0
        assert target.idle()
        assert (await host.run(Command(argv=("true",), timeout=5))).exit_status == 0


async def test_calls_in_flight_counts_the_running_calls(target: Target) -> None:
    host = target.host
    assert host.is_up()
    assert host.calls_in_flight() == 0
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(host.run, Command(argv=("sleep", "0.3"), timeout=5))
            assert await wait_until(lambda: host.calls_in_flight() == 1, within=5)
    assert host.calls_in_flight() == 0
    assert target.idle()


# -- workspaces and files -----------------------------------------------------------------------


async def test_workspaces_are_private_real_paths_removed_with_their_contents(
    target: Target,
) -> None:
    host = target.host
    with anyio.fail_after(20):
        workspace = await host.make_workspace()
        path = anyio.Path(workspace)
        assert workspace.startswith(target.workspace_prefix)
        assert await path.is_dir()
        assert str(await path.resolve()) == workspace
        assert (await path.stat()).st_mode & 0o777 == 0o700
        await (path / "deep" / "er").mkdir(parents=True)
        await (path / "deep" / "er" / "f").write_text("x")
        await (path / "deep").chmod(0o500)  # read-only inside: removed all the same
        other = await host.make_workspace()
        assert host.workspaces() == {workspace, other}
        await host.remove_workspace(workspace)
        assert not await path.exists()
        await host.remove_workspace(workspace)  # idempotent
        await host.remove_workspace("/etc")  # not made here: left alone
        assert await anyio.Path("/etc").is_dir()
        assert host.workspaces() == {other}
        await target.backend.aclose()
    assert not await anyio.Path(other).exists()  # closing removed the one left behind


def _odd_names(workspace: str) -> None:
    Path(workspace, "odd\nname").write_bytes(b"")
    os.close(os.open(os.fsencode(workspace) + b"/bad\xffbyte", os.O_CREAT | os.O_WRONLY))


async def test_file_operations(target: Target) -> None:
    host = target.host
    with anyio.fail_after(20):
        workspace = await host.make_workspace()
        await host.write_file(workspace, "a.txt", b"first\x00version")
        await host.write_file(workspace, "a.txt", b"hello world")  # replaced
        head = await host.read_file(workspace, "a.txt", limit=5)
        whole = await host.read_file(workspace, "a.txt", limit=100)
        os.mkdir(f"{workspace}/sub")
        through_parent = await host.read_file(workspace, "./sub/../a.txt", limit=100)
        os.symlink("/etc", f"{workspace}/link")
        await host.write_file(workspace, "sub/bin", b"\x00\xff\x00")
        binary = await host.read_file(workspace, "sub/bin", limit=10)
        # Names come back as the directory holds them: whoever shows them escapes them.
        _odd_names(workspace)
        listed = await host.list_dir(workspace, ".")
        listed_sub = await host.list_dir(workspace, "sub")
        with pytest.raises(FileNotFoundError):
            await host.read_file(workspace, "nope", limit=10)
        with pytest.raises(IsADirectoryError):
            await host.read_file(workspace, "sub", limit=10)
        with pytest.raises(IsADirectoryError):
            await host.write_file(workspace, "sub/..", b"")
        with pytest.raises(FileNotFoundError):
            await host.write_file(workspace, "missing/x", b"")
        with pytest.raises(NotADirectoryError):
            await host.list_dir(workspace, "a.txt")
        # Missing parents are made beneath the workspace, on request.
        await host.write_file(workspace, "new/deeper/x.txt", b"made", make_parents=True)
    assert (head.data, head.size) == (b"hello", 11)
    assert (whole.data, whole.size) == (b"hello world", 11)
    assert through_parent == whole
    assert (binary.data, binary.size) == (b"\x00\xff\x00", 3)
    assert [(e.name, e.kind, e.size) for e in listed] == [
        ("a.txt", "file", 11),
        ("bad\udcffbyte", "file", 0),
        ("link", "symlink", 0),
        ("odd\nname", "file", 0),
        ("sub", "dir", 0),
    ]
    assert [(e.name, e.kind, e.size) for e in listed_sub] == [("bin", "file", 3)]
    assert await anyio.Path(workspace, "new", "deeper", "x.txt").read_bytes() == b"made"
    assert not await anyio.Path(workspace, "missing").exists()


LEAVING = [
    "..",
    "../x",
    "sub/../../x",
    "/etc/passwd",
    "/",
    "out/passwd",  # an absolute symlink out
    "up/x",  # a relative symlink to the workspace's parent
    "hop/../../x",  # through a symlinked directory, then up
    "proc/self/root/etc/passwd",  # /proc, where magic links are
]
"""Paths that leave the workspace, given the tree :func:`_leaving_tree` makes."""


def _leaving_tree(workspace: str) -> None:
    os.mkdir(f"{workspace}/sub")
    os.symlink("/etc", f"{workspace}/out")
    os.symlink("..", f"{workspace}/up")
    os.symlink("sub", f"{workspace}/hop")
    os.symlink("/proc", f"{workspace}/proc")


async def test_paths_that_leave_the_workspace_are_refused_by_the_kernel(target: Target) -> None:
    host = target.host
    workspace = await host.make_workspace()
    _leaving_tree(workspace)
    parent = anyio.Path(workspace).parent
    with anyio.fail_after(30):
        for path in LEAVING:
            with pytest.raises(PathOutsideWorkspace):
                await host.read_file(workspace, path, limit=10)
            with pytest.raises(PathOutsideWorkspace):
                await host.write_file(workspace, f"{path}/pwned", b"pwned", make_parents=True)
            with pytest.raises(PathOutsideWorkspace):
                await host.list_dir(workspace, path)
            if path not in ("..", "/"):
                with pytest.raises(PathOutsideWorkspace):
                    await host.write_file(workspace, path, b"pwned")
    # (The parent also holds other workspaces, spares made meanwhile among them.)
    assert not await (parent / "x").exists()
    assert not await (parent / "pwned").exists()
    assert not await anyio.Path("/etc/pwned").exists()
    assert "pwned" not in await anyio.Path("/etc/passwd").read_text()


def _inside_links(workspace: str) -> None:
    os.makedirs(f"{workspace}/sub/deep")
    Path(workspace, "sub", "f.txt").write_text("inside")
    os.symlink("sub/f.txt", f"{workspace}/to-file")
    os.symlink("sub", f"{workspace}/to-dir")
    os.symlink("../f.txt", f"{workspace}/sub/deep/up-one")
    os.symlink(f"{workspace}/sub/f.txt", f"{workspace}/absolute")  # absolute: refused
    os.symlink("nothing-here", f"{workspace}/dangling")


async def test_symlinks_that_stay_inside_the_workspace_work(target: Target) -> None:
    host = target.host
    workspace = await host.make_workspace()
    _inside_links(workspace)
    with anyio.fail_after(20):
        through_file = await host.read_file(workspace, "to-file", limit=100)
        through_dir = await host.read_file(workspace, "to-dir/f.txt", limit=100)
        through_up = await host.read_file(workspace, "sub/deep/up-one", limit=100)
        listed = await host.list_dir(workspace, "to-dir")
        await host.write_file(workspace, "to-file", b"written through")
        await host.write_file(workspace, "to-dir/g.txt", b"new", make_parents=True)
        with pytest.raises(PathOutsideWorkspace):
            await host.read_file(workspace, "absolute", limit=100)
        # A symlink is written through only to a file that exists: nothing is created for it.
        with pytest.raises(FileNotFoundError):
            await host.write_file(workspace, "dangling", b"x")
    assert through_file.data == through_dir.data == through_up.data == b"inside"
    assert [e.name for e in listed] == ["deep", "f.txt"]
    assert await anyio.Path(workspace, "sub", "f.txt").read_text() == "written through"
    assert await anyio.Path(workspace, "sub", "g.txt").read_text() == "new"
    assert await anyio.Path(workspace, "to-file").is_symlink()
    assert not await anyio.Path(workspace, "dangling").exists()  # its target was not made


async def test_files_with_more_than_one_hard_link_are_refused(target: Target) -> None:
    host = target.host
    workspace = await host.make_workspace()
    # Next to the workspace: on the same filesystem, outside the workspace.
    outside = anyio.Path(workspace).parent / f"outside-{os.path.basename(workspace)}"
    await outside.write_text("secret")
    try:
        await anyio.Path(workspace, "linked").hardlink_to(outside)
        with anyio.fail_after(20):
            with pytest.raises(OSError, match="more than one hard link") as read:
                await host.read_file(workspace, "linked", limit=100)
            with pytest.raises(OSError, match="more than one hard link") as written:
                await host.write_file(workspace, "linked", b"pwned")
        assert read.value.errno == written.value.errno == errno.EMLINK
        assert await outside.read_text() == "secret"
    finally:
        await outside.unlink()


async def test_a_workspace_must_be_an_absolute_path(target: Target) -> None:
    # A relative workspace would depend on the host's own working directory.
    host = target.host
    with pytest.raises(ValueError, match="absolute"):
        await host.read_file("relative", "x", limit=1)
    with pytest.raises(ValueError, match="absolute"):
        await host.write_file("relative", "x", b"x")
    with pytest.raises(ValueError, match="absolute"):
        await host.list_dir("relative", ".")


# -- lifecycle ----------------------------------------------------------------------------------


async def test_use_before_start_and_after_close_is_refused(target: Target) -> None:
    backend = target.make()
    host = backend.hosts[0]
    with pytest.raises(PoolError, match="not started"):
        await host.run(Command(argv=("true",), timeout=5))
    await backend.aclose()
    with pytest.raises(PoolClosed):
        await host.run(Command(argv=("true",), timeout=5))


async def test_closing_ends_the_calls_in_flight_and_refuses_new_ones(
    target: Target, duration: str, tmp_path: Path
) -> None:
    backend, host = target.backend, target.host
    outcomes: list[object] = []
    pid_files = [tmp_path / f"pid{i}" for i in range(3)]

    async def call(pid_file: Path) -> None:
        line = f"sleep {duration} & echo $! > {pid_file}; sleep {duration}"
        try:
            outcomes.append(await host.run(sh(line, timeout=30)))
        except PoolClosed as exc:
            outcomes.append(exc)

    with anyio.fail_after(20):
        workspaces = [await host.make_workspace() for _ in range(2)]
        async with anyio.create_task_group() as group:
            for pid_file in pid_files:
                group.start_soon(call, pid_file)
            assert await wait_until(lambda: all(p.exists() for p in pid_files), within=10)
            assert await wait_until(lambda: host.calls_in_flight() == 3, within=5)
            started = time.monotonic()
            async with anyio.create_task_group() as closers:  # two at once: both wait for it
                closers.start_soon(backend.aclose)
                closers.start_soon(backend.aclose)
            assert time.monotonic() - started < 5
        await backend.aclose()  # idempotent
    assert len(outcomes) == 3
    assert all(isinstance(outcome, PoolClosed) for outcome in outcomes)
    for pid_file in pid_files:
        assert await wait_dead(int(pid_file.read_text()), within=1.0)
    assert await no_process_left(f"sleep {duration}") == []
    for workspace in workspaces:
        assert not await anyio.Path(workspace).exists()
    assert backend.is_closed()
    assert "closed" in repr(backend)
    with pytest.raises(PoolClosed):
        await host.run(Command(argv=("true",), timeout=5))
    with pytest.raises(PoolClosed):
        await host.make_workspace()
    with pytest.raises(PoolClosed):
        await backend.start()
