"""The namespaces isolation tier, attacked: each attack must fail there (docs/sandboxes.md).

Every test runs a real command in a real sandbox (bubblewrap, cgroup v1, a uid
of the session's own) on the local backend. The same attacks against
``isolation = "none"`` are run once and their outcome printed, for contrast
(``-s`` shows them); only the namespaces tier's outcome is asserted.

The tests need root, bubblewrap and cgroup v1: without them they skip, except
under ``CI=true``, where they fail. Attacks that could hurt the machine (a fork
bomb, a memory hog) run inside limits set first, and are bounded by count.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from support.proc_helpers import pid_alive
from support.walls import require_walls

from agent_backend.backends.local import LocalBackend, LocalHost, LocalPoolConfig
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import BackendUnavailable, SandboxUnavailable
from agent_backend.sandbox import CgroupTree, SandboxLimits, missing_for_namespaces
from agent_backend.sandbox.registry import UID_BASE, UID_COUNT

pytestmark = pytest.mark.anyio

HOME = os.path.expanduser("~")
LIMITS = SandboxLimits(memory_mb=96, tasks=48, cpus=1.0, open_files=256, tmp_mb=16)


@pytest.fixture
async def walled() -> AsyncIterator[LocalHost]:
    require_walls()
    config = LocalPoolConfig(isolation="namespaces", limits=LIMITS, spare_workspaces=2)
    async with LocalBackend(config) as backend:
        yield backend.host


@pytest.fixture
async def open_host() -> AsyncIterator[LocalHost]:
    async with LocalBackend(LocalPoolConfig(isolation="none", spare_workspaces=0)) as backend:
        yield backend.host


async def sh(host: LocalHost, line: str, cwd: str, *, limit: float = 60.0) -> CommandResult:
    return await host.run(Command(shell=line, cwd=cwd, timeout=limit, output_limit=1 << 16))


def _processes_with(marker: str) -> list[int]:
    """Live processes on this host whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
                if marker.encode() in cmdline and pid_alive(int(name)):
                    found.append(int(name))
    return found


def _wait_for_processes(marker: str, count: int) -> None:
    """Until ``count`` processes with ``marker`` run (a state, bounded by polls, not by a time)."""
    for _ in range(60_000):
        if len(_processes_with(marker)) >= count:
            return
        time.sleep(0.005)
    raise AssertionError(f"{count} processes with {marker!r} never ran")


async def contrast(open_host: LocalHost, attack: str, line: str) -> None:
    """Run ``line`` unconfined and print what it achieved there (not asserted)."""
    workspace = await open_host.make_workspace()
    result = await sh(open_host, line, workspace, limit=20)
    print(f"\n[isolation=none] {attack}: exit {result.exit_status}: {result.stdout.text()[:200]!r}")


# -- guarantees and refusal ------------------------------------------------------------------------


async def test_guarantees_are_reported(walled: LocalHost) -> None:
    stats = walled.statistics()
    assert stats.guarantees is not None
    assert stats.guarantees.isolation == "namespaces"
    assert stats.guarantees.limits["memory"].startswith("96 MiB")
    assert any(line.startswith("network: ") for line in stats.guarantees.lines())


async def test_a_pool_that_cannot_have_its_walls_refuses_to_start() -> None:
    config = LocalPoolConfig(isolation="namespaces", spare_workspaces=0)
    missing = missing_for_namespaces()
    if not missing:
        # Make one requirement unmet for real: no bwrap on this process's PATH.
        saved = os.environ["PATH"]
        os.environ["PATH"] = "/nonexistent"
        try:
            with pytest.raises(SandboxUnavailable) as caught:
                async with LocalBackend(config):
                    pass
        finally:
            os.environ["PATH"] = saved
    else:
        with pytest.raises(SandboxUnavailable) as caught:
            async with LocalBackend(config):
                pass
    assert caught.value.missing
    assert "missing" in str(caught.value)
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.missing == caught.value.missing


async def test_a_workspace_root_sandboxes_cannot_reach_is_refused(tmp_path: Path) -> None:
    require_walls()
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    config = LocalPoolConfig(
        isolation="namespaces", workspace_root=str(closed / "root"), spare_workspaces=0
    )
    with pytest.raises(SandboxUnavailable, match="no o\\+x") as caught:
        async with LocalBackend(config):
            pass
    # The first closed directory on the way is named (pytest's own base may be the first).
    named = [p for p in (closed, *closed.parents) if f"{p} has no o+x" in str(caught.value)]
    assert named


def test_default_cwd_cannot_be_combined_with_walls() -> None:
    with pytest.raises(ValueError, match="default_cwd"):
        LocalPoolConfig(isolation="namespaces", default_cwd="/srv")


# -- a command as usual, inside ---------------------------------------------------------------


async def test_stdin_cwd_env_and_missing_programs_work_as_outside(walled: LocalHost) -> None:
    workspace = await walled.make_workspace()
    await sh(walled, "mkdir -p sub", workspace)
    command = Command(
        argv=("sh", "-c", "cat; pwd; echo $GREETING"),
        cwd=f"{workspace}/sub",
        env={"GREETING": "hello"},
        stdin=b"from stdin\n",
        timeout=60,
        output_limit=4096,
    )
    result = await walled.run(command)
    assert result.stdout.text() == f"from stdin\n{workspace}/sub\nhello\n"
    missing = await walled.run(
        Command(argv=("no-such-program",), cwd=workspace, timeout=60, output_limit=4096)
    )
    assert missing.exit_status == 127
    assert "no-such-program" in missing.stderr.text()
    outside = await walled.run(Command(argv=("true",), cwd="/usr", timeout=60, output_limit=99))
    assert outside.exit_status == 126


# -- who the command is --------------------------------------------------------------------------


async def test_a_session_is_a_uid_of_its_own_without_privileges(walled: LocalHost) -> None:
    first, second = await walled.make_workspace(), await walled.make_workspace()
    result = await sh(
        walled, "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status", first
    )
    lines = result.stdout.text().split()
    uid = int(lines[0])
    assert UID_BASE <= uid < UID_BASE + UID_COUNT
    assert lines[1:] == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000",
                         "NoNewPrivs:", "1"]  # fmt: skip
    assert os.stat(first).st_uid == uid
    other = await sh(walled, "id -u", second)
    assert int(other.stdout.text()) != uid


async def test_another_sessions_workspace_cannot_be_seen_or_touched(
    walled: LocalHost, open_host: LocalHost
) -> None:
    mine, theirs = await walled.make_workspace(), await walled.make_workspace()
    secret = secrets.token_hex(8)
    assert (await sh(walled, f"echo {secret} > secret", theirs)).exit_status == 0
    attack = f"cat {theirs}/secret; echo planted > {theirs}/planted; ls {os.path.dirname(theirs)}"
    result = await sh(walled, attack, mine)
    assert secret not in result.stdout.text()
    assert not await anyio.Path(theirs, "planted").exists()
    assert os.path.basename(theirs) not in result.stdout.text()
    # Nor the spares a later session will be handed.
    for spare in walled.spare_workspaces():
        probe = await sh(walled, f"touch {spare}/x; ls {spare}", mine)
        assert probe.exit_status != 0
        assert not await anyio.Path(spare, "x").exists()
    await contrast(open_host, "read another session", f"cat {theirs}/secret")


async def test_the_daemon_its_token_and_its_environment_are_out_of_reach(
    walled: LocalHost, tmp_path: Path
) -> None:
    workspace = await walled.make_workspace()
    me = os.getpid()
    attack = textwrap.dedent(
        f"""\
        cat /proc/{me}/environ && echo ENVIRON
        kill -0 {me} && echo SIGNALLED
        kill -9 {me} && echo KILLED
        cat {HOME}/.config/agent-backend/token && echo TOKEN
        ls /proc | grep -c '^[0-9]'
        """
    )
    result = await sh(walled, attack, workspace)
    out = result.stdout.text()
    assert "ENVIRON" not in out
    assert "SIGNALLED" not in out
    assert "KILLED" not in out
    assert "TOKEN" not in out
    # Only the sandbox's own processes exist there: its init, the shell, grep, ls.
    assert int(out.split()[-1]) <= 5
    assert pid_alive(me)


async def test_kill_minus_one_harms_nothing_outside(walled: LocalHost) -> None:
    a, b = await walled.make_workspace(), await walled.make_workspace()
    marker = f"7{secrets.randbelow(10**6)}.5"
    async with anyio.create_task_group() as group:
        outcome: dict[str, CommandResult] = {}

        async def long_call() -> None:
            outcome["b"] = await sh(walled, f"sleep {marker}; echo survived", b)

        group.start_soon(long_call)
        await anyio.to_thread.run_sync(_wait_for_processes, f"sleep {marker}", 1)
        await sh(walled, "kill -9 -1", a)
        assert _processes_with(f"sleep {marker}")  # still running
        group.cancel_scope.cancel()
    assert pid_alive(os.getpid())


# -- nothing outlives its call ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "escape",
    [
        "setsid sleep {m} &",
        "nohup sleep {m} > /dev/null 2>&1 &",
        "sh -c 'sh -c \"sleep {m} &\" &'",
        "setsid sh -c 'trap \"\" TERM HUP; sleep {m}' > /dev/null 2>&1 < /dev/null &",
    ],
    ids=["setsid", "nohup", "double-fork", "setsid-ignoring-term"],
)
async def test_processes_die_with_their_call(walled: LocalHost, escape: str) -> None:
    workspace = await walled.make_workspace()
    marker = f"9{secrets.randbelow(10**6)}.25"
    # The call waits for a file the test makes once it has seen the escaped process run.
    line = escape.format(m=marker) + "\necho started; while [ ! -e go ]; do sleep 0.01; done"
    outcome: list[CommandResult] = []

    async def call() -> None:
        outcome.append(await sh(walled, line, workspace))

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        await anyio.to_thread.run_sync(_wait_for_processes, f"sleep {marker}", 1)
        await anyio.Path(workspace, "go").touch()
    assert "started" in outcome[0].stdout.text()
    assert _processes_with(f"sleep {marker}") == []


async def test_a_timed_out_call_takes_everything_with_it(walled: LocalHost) -> None:
    workspace = await walled.make_workspace()
    marker = f"8{secrets.randbelow(10**6)}.75"
    result = await sh(walled, f"setsid sleep {marker} & sleep {marker}", workspace, limit=1.0)
    assert result.timed_out
    assert _processes_with(f"sleep {marker}") == []


async def test_closing_a_session_removes_its_uid_cgroups_and_workspace() -> None:
    require_walls()
    # No spares kept, so none made new for a next session either: removed.
    config = LocalPoolConfig(isolation="namespaces", limits=LIMITS, spare_workspaces=0)
    async with LocalBackend(config) as backend:
        await _close_and_see_it_removed(backend.host)


async def _close_and_see_it_removed(walled: LocalHost) -> None:
    workspace = await walled.make_workspace()
    uid = os.stat(workspace).st_uid
    registry = walled._registry
    assert registry is not None
    assert uid in registry.uids()
    await walled.remove_workspace(workspace)
    for _ in range(1000):  # the keeper's threads remove it after the rename
        if uid not in registry.uids():
            break
        await anyio.sleep(0.01)
    assert uid not in registry.uids()
    assert not await anyio.Path(workspace).exists()


async def test_the_cap_on_sandboxes_counts_those_not_yet_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``max_sandboxes`` counts a sandbox when it is asked for: with two still being built, a
    third session past the cap is refused at once, and a closed one frees its place."""
    require_walls()
    config = LocalPoolConfig(isolation="namespaces", max_sandboxes=3, spare_workspaces=0)
    async with LocalBackend(config) as backend:
        host = backend.host  # its scratch directory holds the first sandbox
        building, release = threading.Semaphore(0), threading.Event()
        start = LocalHost._start_sandbox

        def held_start(self: LocalHost, root: str, walls: Any) -> None:
            building.release()
            assert release.wait(120)  # bounded: the test sets it
            start(self, root, walls)

        monkeypatch.setattr(LocalHost, "_start_sandbox", held_start)
        made: list[str] = []
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(lambda: _append(made, host.make_workspace()))
            for _ in range(2):  # both counted, neither ready
                assert await anyio.to_thread.run_sync(building.acquire, True, 120)
            with pytest.raises(BackendUnavailable, match="max_sandboxes = 3"):
                await host.make_workspace()
            release.set()
        assert len(made) == 2
        assert (await sh(host, "echo ready", made[0])).stdout.text() == "ready\n"
        await host.remove_workspace(made[0])
        for _ in range(12000):  # bounded: the keeper's threads remove it, then the place is free
            try:
                made[0] = await host.make_workspace()
                break
            except BackendUnavailable:
                await anyio.sleep(0.01)
        assert (await sh(host, "echo again", made[0])).stdout.text() == "again\n"


async def _append(into: list[str], made: Any) -> None:
    into.append(await made)


_LEAVE_EVERYTHING = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
os.makedirs("d/e"); open("d/e/f", "w").write("x"); open(".hidden", "w").write("y")
os.setxattr(".", "user.left", b"x")
os.chmod("d", 0o500)
open("/tmp/t", "w").write("t"); os.mkdir("/tmp/shut"); os.chmod("/tmp/shut", 0)
open("/dev/shm/s", "w").write("s")
assert libc.mq_open(b"/q", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0
assert libc.shmget(0x5A1, 4096, 0o1600) >= 0
assert libc.msgget(0x5A2, 0o1600) >= 0
assert libc.semget(0x5A3, 1, 0o1600) >= 0
assert libc.syscall(248, b"user", b"leftkey", b"v", 1, -4) > 0  # add_key(2) to @u (x86-64)
subprocess.Popen(["setsid", "sleep", "600.5"], start_new_session=True)
"""
_WHAT_IS_LEFT = (
    "ls -A . /tmp /dev/shm /dev/mqueue; python3 -c 'import os; print(*os.listxattr(\".\"))'; "
    "cat /proc/sysvipc/shm /proc/sysvipc/msg "
    "/proc/sysvipc/sem | grep -v key; grep -o leftkey /proc/keys; ps -e -o comm= | grep sleep"
)


async def test_a_sandbox_made_new_for_the_next_session_keeps_nothing_of_the_last() -> None:
    """A closed session's sandbox is made new in place for the next session (cheaper than a
    new one): nothing the first left, anywhere it could write, reaches the second."""
    require_walls()
    config = LocalPoolConfig(isolation="namespaces", limits=LIMITS, spare_workspaces=1)
    async with LocalBackend(config) as backend:
        host = backend.host
        first = await host.make_workspace()
        uid = os.stat(first).st_uid
        left = await sh(host, f"python3 -c '{_LEAVE_EVERYTHING}' && {_WHAT_IS_LEFT}", first)
        assert left.exit_status == 0, left
        words = left.stdout.text().split()
        traces = (".hidden", "d", "t", "shut", "s", "q", "1441", "1442", "1443", "leftkey")
        for trace in (*traces, "user.left"):
            assert trace in words, (trace, words)  # left there, and seen
        # Its own root and /dev (tmpfs, its uid's) it cannot change: no /bin or /dev/null of
        # its choosing for the next session.
        fixed = await sh(host, "rm /bin; touch /x; touch /dev/x; rm /dev/null; ls / /dev", first)
        assert [word for word in ("x", "null", "bin") if word in fixed.stdout.text().split()] == [
            "null",
            "bin",
        ], fixed
        await host.remove_workspace(first)
        # Being made new: back with the spares, under a spare's name, when done.
        spare = os.path.join(os.path.dirname(first), Path(first).name.replace("-ws-", "-spare-"))
        for _ in range(6000):  # bounded: a reset takes a few ms
            if spare in host.spare_workspaces():
                break
            await anyio.sleep(0.01)
        second = await host.make_workspace()
        assert (second, os.stat(second).st_uid) == (first, uid)  # the same sandbox, made new
        seen = await sh(host, _WHAT_IS_LEFT, second)
        listing = set(seen.stdout.text().split()) - {".:", "/dev/mqueue:", "/dev/shm:", "/tmp:"}
        allowed = set()
        if second.startswith("/tmp/"):  # only the way to the workspace, where the host keeps it
            allowed.add(Path(second).relative_to("/tmp").parts[0])
        assert listing <= allowed, seen


# -- limits ------------------------------------------------------------------------------------------


async def test_a_fork_bomb_stops_at_the_task_limit(walled: LocalHost) -> None:
    bomb, bystander = await walled.make_workspace(), await walled.make_workspace()
    # Bounded by count: 300 sleepers asked for, the pids cgroup allows 48 tasks in all.
    script = (
        "import os, time\n"
        "made = 0\n"
        "for _ in range(300):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        made += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print(made, len([p for p in os.listdir('/proc') if p.isdigit()]), flush=True)\n"
        "os._exit(0)\n"
    )
    result = await sh(walled, f'python3 -c "{script}"', bomb, limit=60)
    made, alive = map(int, result.stdout.text().split())
    assert 8 < made < LIMITS.tasks
    assert alive <= LIMITS.tasks
    # Another session forks as usual meanwhile and after.
    ok = await sh(walled, "sh -c 'echo fine'", bystander)
    assert ok.stdout.text().strip() == "fine"


async def test_a_memory_hog_is_killed_in_its_own_cgroup(walled: LocalHost) -> None:
    hog, bystander = await walled.make_workspace(), await walled.make_workspace()
    line = "python3 -c 'b = bytearray(400 << 20); print(len(b))'"
    result = await sh(walled, line, hog, limit=60)
    assert result.exit_status != 0
    assert "419430400" not in result.stdout.text()
    assert pid_alive(os.getpid())
    ok = await sh(walled, "echo fine", bystander)
    assert ok.stdout.text().strip() == "fine"


async def test_limits_cannot_be_raised(walled: LocalHost) -> None:
    workspace = await walled.make_workspace()
    result = await sh(walled, f"ulimit -n {LIMITS.open_files * 4} && echo RAISED", workspace)
    assert "RAISED" not in result.stdout.text()
    hard = await sh(walled, "ulimit -Hn", workspace)
    assert int(hard.stdout.text()) == LIMITS.open_files
    oom = await sh(walled, "cat /proc/self/oom_score_adj; echo -1000 > /proc/self/oom_score_adj"
                   " && echo LOWERED", workspace)  # fmt: skip
    assert oom.stdout.text().split()[0] == "1000"
    assert "LOWERED" not in oom.stdout.text()


async def test_the_private_tmp_is_capped(walled: LocalHost) -> None:
    workspace = await walled.make_workspace()
    line = f"dd if=/dev/zero of=/tmp/fill bs=1M count={LIMITS.tmp_mb * 4} 2>&1; du -m /tmp/fill"
    result = await sh(walled, line, workspace)
    assert int(result.stdout.text().split()[-2]) <= LIMITS.tmp_mb


# -- the kernel's own doors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attack", "line"),
    [
        ("mount", "mount -t tmpfs none /tmp && echo BROKE"),
        ("setuid binary", "su -c 'id -u' root && echo BROKE"),
        ("proc sys write", "echo evil > /proc/sys/kernel/hostname && echo BROKE"),
        ("sys write", "echo 1 > /sys/kernel/mm/ksm/run && echo BROKE"),
        ("user namespace", "unshare -U -r id -u && echo BROKE"),
        ("system dirs", "touch /usr/bin/evil /etc/evil && echo BROKE"),
        (
            # PTRACE_SEIZE (stops nothing) of the agent, pid 2: it shares the commands' uid.
            "ptrace the sandbox's agent",
            "python3 -c 'import ctypes; l = ctypes.CDLL(None); "
            'print("BROKE" if l.ptrace(0x4206, 2, 0, 0) == 0 else "no")\'',
        ),
    ],
)
async def test_privileged_doors_stay_shut(
    walled: LocalHost, open_host: LocalHost, attack: str, line: str
) -> None:
    workspace = await walled.make_workspace()
    result = await sh(walled, line, workspace)
    assert "BROKE" not in result.stdout.text(), (attack, result)


_TRACE_INIT = """
import ctypes, errno, subprocess
libc = ctypes.CDLL(None, use_errno=True)
child = subprocess.Popen(["sleep", "60"])
print("own child", libc.ptrace(0x4206, child.pid, 0, 0))  # PTRACE_SEIZE: ptrace works here
child.kill()
print("init", libc.ptrace(0x4206, 1, 0, 0), errno.errorcode.get(ctypes.get_errno()))
for path, mode in (("/proc/1/mem", "r+b"), ("/proc/1/exe", "rb")):
    try:
        open(path, mode).close()
        print(path, "opened")
    except OSError as exc:
        print(path, errno.errorcode[exc.errno])
"""


async def test_the_init_cannot_be_traced_read_or_written(walled: LocalHost) -> None:
    """The namespace's init (PID 1, a shell that outlives every call) shares the commands' uid;
    it runs from an execute-only file, so it is not dumpable: no ptrace, no ``/proc/1/mem``
    (a command could otherwise make it start processes that outlive their call)."""
    workspace = await walled.make_workspace()
    result = await sh(walled, f"python3 -c '{_TRACE_INIT}'", workspace)
    assert result.exit_status == 0, result
    lines = result.stdout.text().splitlines()
    assert lines[0] == "own child 0"
    assert lines[1:] == ["init -1 EPERM", "/proc/1/mem EACCES", "/proc/1/exe EACCES"]


# -- the network -----------------------------------------------------------------------------------


async def test_no_network_but_loopback_and_refusals_are_immediate(
    walled: LocalHost, open_host: LocalHost
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        workspace = await walled.make_workspace()
        probe = (
            "python3 -c 'import socket, time; s = socket.socket(); s.settimeout(30); "
            f'print(s.connect_ex(("127.0.0.1", {port})))\'; '
            "ls /sys/class/net 2>/dev/null || cat /proc/net/dev | tail -n +3 | cut -d: -f1"
        )
        result = await sh(walled, probe, workspace, limit=60)
        lines = result.stdout.text().split()
        assert lines[0] == str(__import__("errno").ECONNREFUSED)  # refused at once, no timeout
        assert [n for n in lines[1:] if n.strip()] == ["lo"]
        await contrast(
            open_host,
            "reach a host loopback service",
            f"python3 -c 'import socket; print(socket.create_connection((\"127.0.0.1\", {port})))'",
        )


# -- reconciliation after a SIGKILL -----------------------------------------------------------------

_OWNER = textwrap.dedent(
    """\
    import anyio, sys
    from agent_backend.backends.local import LocalBackend, LocalPoolConfig
    from agent_backend.dispatch.backend import Command

    async def main():
        config = LocalPoolConfig(
            isolation="namespaces",
            spare_workspaces=2,
            sandbox_state_dir=sys.argv[1],
            workspace_root=sys.argv[3],
        )
        async with LocalBackend(config) as backend:
            workspace = await backend.host.make_workspace()
            print(workspace, flush=True)
            line = f"setsid sleep {sys.argv[2]} & sleep {sys.argv[2]}"
            await backend.host.run(Command(shell=line, cwd=workspace, timeout=600, output_limit=99))

    anyio.run(main)
    """
)


def _kill_owner_mid_call(state: Path, marker: str, root: str) -> tuple[str, str]:
    """Start an owner whose call runs ``sleep marker`` twice, SIGKILL it once both run; its
    workspace and owner token."""
    with subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(state), marker, root],
        stdout=subprocess.PIPE,
        text=True,
    ) as owner:
        try:
            assert owner.stdout is not None
            workspace = owner.stdout.readline().strip()
            _wait_for_processes(f"sleep {marker}", 2)
            lock = next((state / "owners").iterdir())
            return workspace, lock.name.removesuffix(".lock")
        finally:
            owner.send_signal(signal.SIGKILL)
            owner.wait()


def _cgroups_of(token: str) -> list[str]:
    """The dead owner's cgroup directories still there (it shared this process's cgroups)."""
    return [path for path in CgroupTree(token).roots.values() if os.path.exists(path)]


@pytest.mark.parametrize("round_", range(3))
async def test_a_successor_removes_everything_a_killed_owner_left(
    tmp_path: Path, round_: int
) -> None:
    require_walls()
    state = tmp_path / "state"
    marker = f"6{secrets.randbelow(10**6)}.5"
    # A root of this test's own (pytest's tmp_path is closed to other uids): no other backend
    # sweeps it, so what is found there is what the owner left and its successor removed.
    root = f"/tmp/agent-backend-test-{secrets.token_hex(6)}"
    await anyio.Path(root).mkdir(mode=0o711)
    try:
        await _kill_and_succeed(state, marker, root)
    finally:
        await anyio.to_thread.run_sync(shutil.rmtree, root)


async def _kill_and_succeed(state: Path, marker: str, root: str) -> None:
    workspace, token = await anyio.to_thread.run_sync(_kill_owner_mid_call, state, marker, root)
    assert await anyio.Path(workspace).is_dir()  # left behind
    config = LocalPoolConfig(
        isolation="namespaces",
        spare_workspaces=0,
        sandbox_state_dir=str(state),
        workspace_root=root,
    )
    async with LocalBackend(config):
        assert _processes_with(f"sleep {marker}") == []
        assert not await anyio.Path(workspace).exists()
        assert [p.name for p in (state / "uids").iterdir() if os.readlink(p) == token] == []
        assert not (state / "owners" / f"{token}.lock").exists()
        assert await anyio.to_thread.run_sync(_cgroups_of, token) == []


# -- through the daemon ------------------------------------------------------------------------------


def test_through_the_daemon_a_command_reaches_neither_the_daemon_nor_another_session() -> None:
    """The daemon (a real uvicorn) on a walled pool: a tool cannot call it, see it, or read
    another session's workspace, with the token in hand or not."""
    require_walls()
    from support.daemon_fixtures import TOKEN, make_registry

    from agent_backend.daemon import DaemonSettings, run_in_thread

    settings = DaemonSettings(tokens=(TOKEN,), port=0, grace=2.0, mcp=False)
    pool = LocalPoolConfig(isolation="namespaces", limits=LIMITS, spare_workspaces=2)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with (
        run_in_thread(make_registry(), settings, pool=pool) as running,
        httpx.Client(base_url=running.url, headers=headers, timeout=60) as http,
    ):
        ready = http.get("/v1/health/ready").json()
        assert "isolation: namespaces" in ready["pools"]["default"]["guarantees"]
        port = httpx.URL(running.url).port
        first = http.post("/v1/sessions").json()["id"]
        second = http.post("/v1/sessions").json()["id"]

        def run(session: str, command: str) -> str:
            call = {"name": "exec", "arguments": {"command": command}, "session": session}
            response = http.post("/v1/call", json=call)
            assert response.status_code == 200, response.text
            return str(response.json()["output"])

        secret = secrets.token_hex(8)
        run(second, f"echo {secret} > secret; pwd")
        where = run(second, "pwd").strip()
        attack = textwrap.dedent(
            f"""\
            python3 -c 'import socket; s = socket.socket(); print("daemon", s.connect_ex(("127.0.0.1", {port})))'
            cat {where}/secret 2>/dev/null
            kill -0 {os.getpid()} 2>/dev/null && echo SIGNALLED
            env | grep -c AGENT_BACKEND
            """
        )
        out = run(first, attack)
        assert f"daemon {__import__('errno').ECONNREFUSED}" in out
        assert secret not in out
        assert "SIGNALLED" not in out
        assert out.strip().splitlines()[-1] == "0"  # nothing of the daemon's in the environment
        assert secret in run(second, "cat secret")


def _sandbox_processes(uid: int) -> dict[int, tuple[str, int]]:
    """The processes of sandbox uid ``uid``: pid -> (name, PSS in KiB)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            name = (entry / "comm").read_text().strip()
            rollup = (entry / "smaps_rollup").read_text()
        except OSError:
            continue
        pss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        found[int(entry.name)] = (name, pss)
    return found


async def test_an_idle_sandbox_lets_its_agent_go_and_wakes_it_for_the_next_call() -> None:
    require_walls()
    config = LocalPoolConfig(limits=LIMITS, spare_workspaces=0, sandbox_agent_idle=0.2)
    async with LocalBackend(config) as backend:
        host = backend.host
        workspace = await host.make_workspace()
        first = await sh(host, "echo one > f; cat f", workspace)
        assert first.stdout.text() == "one\n"
        uid = (await anyio.Path(workspace).stat()).st_uid

        def agent_gone() -> bool:
            names = [name for name, _ in _sandbox_processes(uid).values()]
            return bool(names) and not any(name.startswith("python") for name in names)

        with anyio.fail_after(60):  # 0.2 s of idleness, then a handshake
            while not agent_gone():  # noqa: ASYNC110 - a state in /proc, not an event
                await anyio.sleep(0.02)
        idle = _sandbox_processes(uid)
        pss = sum(kib for _, kib in idle.values())
        print(f"\nidle sandbox: {sorted(name for name, _ in idle.values())}, {pss} KiB PSS")
        assert pss <= 2048, idle
        # Woken by the next call; and again, many times, with the files kept.
        for _ in range(3):
            again = await sh(host, "cat f; echo $$", workspace)
            assert again.exit_status == 0, again
            assert again.stdout.text().startswith("one\n")
            with anyio.fail_after(60):
                while not agent_gone():  # noqa: ASYNC110
                    await anyio.sleep(0.02)
        # An agent that dies unasked (killed from outside) ends its sandbox; the next call gets
        # a new one (and what its last command left is gone with the old one).
        slow = await sh(host, "sleep 300.5 & echo started", workspace)
        assert slow.stdout.text() == "started\n"
        await sh(host, "true", workspace)
        agents = [pid for pid, (name, _) in _sandbox_processes(uid).items() if "python" in name]
        assert len(agents) == 1
        os.kill(agents[0], signal.SIGKILL)
        with anyio.fail_after(60):  # its shell reports it; the sandbox is ended
            while _sandbox_processes(uid):  # noqa: ASYNC110 - a state in /proc
                await anyio.sleep(0.02)
        after = await sh(host, "cat f", workspace)
        assert after.stdout.text() == "one\n"
        assert _processes_with("sleep 300.5") == []


async def test_what_the_file_tools_make_belongs_to_the_session() -> None:
    """write_file runs as root on the host; what it makes (the file, missing parents) is owned
    by the sandbox's uid, so the session's commands can append to it and write beside it."""
    require_walls()
    config = LocalPoolConfig(limits=LIMITS, spare_workspaces=0)
    async with LocalBackend(config) as backend:
        host = backend.host
        workspace = await host.make_workspace()
        uid = os.stat(workspace).st_uid
        await host.write_file(workspace, "a/b/notes.txt", b"one\n", make_parents=True)
        await host.write_file(workspace, "top.txt", b"top\n")
        for made in ("a", "a/b", "a/b/notes.txt", "top.txt"):
            assert os.stat(os.path.join(workspace, made)).st_uid == uid, made
        result = await sh(
            host, "echo two >> a/b/notes.txt && echo up >> top.txt && touch a/b/new", workspace
        )
        assert result.exit_status == 0, result.stderr.text()
        data = await host.read_file(workspace, "a/b/notes.txt", limit=100)
        assert data.data == b"one\ntwo\n"
        # A file the session made stays its own when write_file replaces its content.
        await host.write_file(workspace, "a/b/new", b"replaced\n")
        assert os.stat(os.path.join(workspace, "a/b/new")).st_uid == uid


async def test_a_spare_keeps_its_agent_until_a_session_takes_it() -> None:
    """A spare's agent stays past ``sandbox_agent_idle`` (the session that takes it must not
    wait for an agent to start: seconds on a loaded machine); taken, it leaves when idle."""
    require_walls()
    config = LocalPoolConfig(limits=LIMITS, spare_workspaces=1, sandbox_agent_idle=0.2)
    async with LocalBackend(config) as backend:
        host = backend.host
        first = await host.make_workspace()
        assert (await sh(host, "echo one", first)).stdout.text() == "one\n"
        suffix = first.rsplit("-", 1)[-1]
        process = host._walls[suffix].process
        assert process is not None
        await host.remove_workspace(first)  # made new in place: a spare again, its agent awake
        with anyio.fail_after(60):
            while not any(s.endswith(suffix) for s in host.spare_workspaces()):  # noqa: ASYNC110
                await anyio.sleep(0.02)
        with anyio.fail_after(60):  # 0.2 s of idleness: it asks to leave, and is kept
            while not process._kept_awake:  # noqa: ASYNC110 - its answer to the agent
                await anyio.sleep(0.02)
        uid = os.stat(next(s for s in host.spare_workspaces() if s.endswith(suffix))).st_uid
        assert any(name.startswith("python") for name, _ in _sandbox_processes(uid).values())
        workspace = await host.make_workspace()
        assert workspace.endswith(suffix)  # that very sandbox
        with anyio.fail_after(60):  # taken and idle: it leaves
            while any(  # noqa: ASYNC110 - a state in /proc
                name.startswith("python") for name, _ in _sandbox_processes(uid).values()
            ):
                await anyio.sleep(0.02)
        result = await sh(host, "echo woken", workspace)
        assert result.stdout.text() == "woken\n"
