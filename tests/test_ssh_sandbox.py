"""The ``namespaces`` tier of SSH pools against a real OpenSSH sshd on 127.0.0.1: what it
declares, how commands run inside it, an escape suite (each attack must fail behind the walls;
the ``none`` tier's outcome is printed, and asserted, for contrast where that is harmless), the
kill-by-token path into a sandbox, and hosts that cannot build the walls (refused, naming what
they lack; never used unconfined).

The sshd runs on this machine as this user, so what a call leaves behind is seen here directly
(``pgrep``, paths). Tests that need sshd and bubblewrap skip without them, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.ssh_helpers import (
    backend_for,
    kill_leftovers,
    no_process_left,
    processes_matching,
    require_remote_walls,
    unique_duration,
    wait_until,
)
from support.sshd import SSHServer
from typer.testing import CliRunner

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig, remote
from agent_backend.backends.ssh.walls import missing_on_host, ssh_guarantees
from agent_backend.cli import app
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import ConfigError, SandboxUnavailable
from agent_backend.pool_file import PoolSet, load_pools, pool_config_from_dict, with_isolation
from agent_backend.sandbox import SandboxLimits
from agent_backend.sandbox.bwrap import SYSTEM_PATHS, remote_sandbox_argv

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

runner = CliRunner()


@pytest.fixture
def walled_sshd(sshd: SSHServer) -> SSHServer:
    """The sshd fixture, on a host where the login user can build the walls; under
    ``CI=true`` a host that cannot fails the test instead of skipping it."""
    require_remote_walls()
    return sshd


def pool(server: SSHServer, isolation: str, **overrides: Any) -> SSHBackend:
    return backend_for(server, isolation=isolation, kill_grace=0.2, **overrides)


def sh(line: str, *, cwd: str | None = None, timeout: float = 20.0, **options: Any) -> Command:
    return Command(shell=line, cwd=cwd, timeout=timeout, **options)


async def run(backend: SSHBackend, command: Command) -> CommandResult:
    with anyio.fail_after(command.timeout + 20):
        return await backend.hosts[0].run(command)


def contrast(what: str, result: CommandResult | str) -> None:
    """What the ``none`` tier did with the same attack (``pytest -s`` shows it)."""
    shown = result if isinstance(result, str) else (result.exit_status, result.stdout.text())
    print(f"isolation = 'none', {what}: {shown}")


# -- configuration, guarantees, the argv (no network) -------------------------------------------


def test_the_tier_is_one_per_pool_and_only_enforced_limits_are_accepted() -> None:
    host = {"host": "10.0.0.1"}
    assert SSHHostConfig(**host).isolation == "namespaces"  # the default: docs/sandboxes.md
    walled = pool_config_from_dict(
        {"type": "ssh", "isolation": "namespaces", "limits": {"open_files": 64}, "hosts": [host]}
    )
    assert isinstance(walled, SSHPoolConfig)
    assert walled.hosts[0].isolation == "namespaces"  # a pool-level key is each host's default
    assert walled.hosts[0].limits.open_files == 64
    with pytest.raises(ConfigError, match="differ in isolation or limits"):
        pool_config_from_dict(
            {
                "type": "ssh",
                "isolation": "namespaces",
                "hosts": [host, {"host": "10.0.0.2", "isolation": "none"}],
            }
        )
    with pytest.raises(ConfigError, match="memory_mb, tmp_mb: not enforced on SSH") as caught:
        pool_config_from_dict(
            {"type": "ssh", "limits": {"memory_mb": 512, "tmp_mb": 9}, "hosts": [host]}
        )
    assert str(caught.value.key).startswith("limits")
    mixed = [SSHHostConfig(**host), SSHHostConfig(host="10.0.0.2", isolation="none")]
    with pytest.raises(ConfigError, match="one tier"):
        SSHBackend(mixed)


def test_with_isolation_sets_every_host_of_an_ssh_pool(tmp_path: Path) -> None:
    config = pool_config_from_dict(
        {"type": "ssh", "hosts": [{"host": "10.0.0.1"}, {"host": "10.0.0.2", "port": 2222}]}
    )
    walled = with_isolation(config, "namespaces")
    assert isinstance(walled, SSHPoolConfig)
    assert [h.isolation for h in walled.hosts] == ["namespaces", "namespaces"]
    assert [h.port for h in walled.hosts] == [22, 2222]  # nothing else changed
    assert with_isolation(walled, "namespaces") is walled
    assert [h.isolation for h in with_isolation(walled, "none").hosts] == ["none", "none"]
    file = tmp_path / "ssh.toml"
    file.write_text('type = "ssh"\n[[hosts]]\nhost = "10.0.0.1"\n')
    backend = load_pools(file, isolation="namespaces").backends["default"]  # --isolation
    assert isinstance(backend, SSHBackend)
    assert backend.guarantees()[0] == "isolation: namespaces"


def test_guarantees_say_what_each_tier_enforces_on_ssh_hosts() -> None:
    limits = SandboxLimits(open_files=128, file_size_mb=8)
    walled = ssh_guarantees("namespaces", limits)
    assert walled.limits["open files"] == "128 per process (RLIMIT_NOFILE)"
    assert walled.limits["file size"] == "8 MiB per file (RLIMIT_FSIZE)"
    assert "no per-session cgroups" in walled.limits["memory, tasks, cpu, tmp"]
    assert walled.network.startswith("own network namespace per call: loopback only")
    none = ssh_guarantees("none", limits)
    assert none.limits == {}
    assert none.filesystem.startswith("none")
    backend = SSHBackend([SSHHostConfig(host="10.0.0.1", isolation="namespaces")])
    assert backend.guarantees() == ssh_guarantees("namespaces", SandboxLimits()).lines()
    assert backend.statistics().guarantees == ssh_guarantees("namespaces", SandboxLimits())
    banner = PoolSet({"cmd": backend}, "cmd").describe_walls()
    assert banner.startswith("walls: isolation: namespaces (+")


def test_the_remote_sandbox_argv() -> None:
    limits = SandboxLimits(open_files=100, file_size_mb=2)
    argv = remote_sandbox_argv(["id", "-u"], workspace="/w/ws.1", cwd="/w/ws.1/sub", limits=limits)
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[4:7] == ["100", str(2 * 2048), "bwrap"]
    assert "ulimit -n" in argv[2]
    assert "oom_score_adj" in argv[2]
    for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"):
        assert flag in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL"
    assert argv[argv.index("--tmpfs") + 1] == "/tmp"
    assert argv.index("--tmpfs") < argv.index("--bind")  # the workspace over the private /tmp
    for path in SYSTEM_PATHS:
        assert f"--ro-bind-try {path} {path}" in " ".join(argv)
    assert [i for i, word in enumerate(argv) if word == "--bind"] == [argv.index("--bind")]
    assert argv[argv.index("--bind") : argv.index("--bind") + 3] == ["--bind", "/w/ws.1", "/w/ws.1"]
    assert argv[-3:] == ["/w/ws.1/sub", "id", "-u"]
    bare = remote_sandbox_argv(["true"], workspace=None, limits=limits)
    assert "--bind" not in bare
    assert bare[-2:] == ["/tmp", "true"]


def test_what_a_host_lacks_is_named_with_how_to_get_it() -> None:
    absent = missing_on_host("bwrap -\n/proc/sys/user/max_user_namespaces 0\n", "")
    assert absent == [
        "'bwrap' (bubblewrap) on the login PATH: apt-get install bubblewrap (dnf install bubblewrap)"
    ]
    off = missing_on_host(
        "bwrap /usr/bin/bwrap\n/proc/sys/user/max_user_namespaces 0\n"
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns 1\n",
        "bwrap: setting up uid map: Permission denied",
    )
    assert off[0] == "user namespaces: sysctl -w user.max_user_namespaces=65536"
    assert "apparmor_restrict_unprivileged_userns=0" in off[1]
    other = missing_on_host("bwrap /usr/bin/bwrap\n", "bwrap: Unknown option --size\n")
    assert other == [
        "a sandbox bubblewrap can build as the login user (it said: bwrap: Unknown option "
        "--size): bubblewrap 0.2 or later, and user namespaces allowed to users"
    ]


# -- commands behind the walls ------------------------------------------------------------------


async def test_commands_run_inside_as_they_would_without_walls(walled_sshd: SSHServer) -> None:
    tricky = ("a b", "it's", "$HOME", "`id`", ";", "*", "", "a b; echo INJECTED $(id) > x")
    data = os.urandom(300_000)
    async with pool(walled_sshd, "namespaces", env={"HOST_VAR": "from host"}) as backend:
        host = backend.hosts[0]
        ws = await host.make_workspace()
        argv = await run(backend, Command(argv=("printf", "%s|", *tricky), cwd=ws, timeout=10))
        assert (argv.exit_status, argv.stderr.data) == (0, b"")
        assert argv.stdout.data == "".join(f"{word}|" for word in tricky).encode()
        missing = await run(backend, Command(argv=("no-such-program-xyz",), cwd=ws, timeout=10))
        assert missing.exit_status == 127
        gone = await run(backend, Command(argv=("true",), cwd=f"{ws}/absent", timeout=10))
        assert gone.exit_status == 127
        digest = await run(backend, Command(argv=("sha256sum",), stdin=data, cwd=ws, timeout=10))
        assert digest.stdout.text().split()[0] == hashlib.sha256(data).hexdigest()
        env = await run(
            backend, sh('echo "$HOST_VAR|$V|$SSH_CONNECTION"', cwd=ws, env={"V": "x'y"})
        )
        host_var, value, connection = env.stdout.text().strip().split("|")
        assert (host_var, value) == ("from host", "x'y")
        assert connection.split()[2:] == ["127.0.0.1", str(walled_sshd.port)]
        # The workspace, at its own path, is where a command starts and what it writes to.
        made = await run(backend, sh("pwd; echo hi > made.txt", cwd=ws))
        assert made.stdout.text() == f"{ws}\n"
        assert (await host.read_file(ws, "made.txt", limit=100)).data == b"hi\n"
        # Without a session: the call's private /tmp. Outside every workspace: refused.
        sessionless = await run(backend, Command(argv=("pwd",), timeout=10))
        assert sessionless.stdout.text() == "/tmp\n"
        outside = await run(backend, Command(argv=("true",), cwd="/tmp", timeout=10))
        assert outside.exit_status == 126
        assert b"must be inside a session workspace" in outside.stderr.data


async def test_the_walls_are_checked_once_per_host_and_calls_wait_for_it(
    walled_sshd: SSHServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with pool(walled_sshd, "namespaces") as backend:
        host = backend.hosts[0]
        trials: list[int] = []
        check = host._trial_sandbox

        async def counted() -> None:
            if not host._walls_ready:  # a trial runs (else: another caller's already did)
                trials.append(1)
            await check()

        monkeypatch.setattr(host, "_trial_sandbox", counted)
        results: list[CommandResult] = []

        async def call() -> None:
            results.append(await host.run(Command(argv=("true",), timeout=20)))

        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(call)
        assert [r.exit_status for r in results] == [0] * 6
        assert len(trials) == 1  # one trial; the calls that came during it waited for it
        assert host.statistics().calls == 6  # the trial is not a call
        assert not host.statistics().walls_refused


# -- the escape suite ---------------------------------------------------------------------------


async def test_a_session_cannot_read_a_sibling_sessions_workspace(walled_sshd: SSHServer) -> None:
    outcomes: dict[str, CommandResult] = {}
    for isolation in ("namespaces", "none"):
        async with pool(walled_sshd, isolation) as backend:
            host = backend.hosts[0]
            mine, sibling = await host.make_workspace(), await host.make_workspace()
            await host.write_file(sibling, "secret", b"s3cret")
            line = f"cat {sibling}/secret; ls -a {posixpath.dirname(sibling)}"
            outcomes[isolation] = await run(backend, sh(line, cwd=mine))
    walled = outcomes["namespaces"]
    assert b"s3cret" not in walled.stdout.data
    assert b"No such file or directory" in walled.stderr.data
    assert posixpath.basename(sibling).encode() not in walled.stdout.data
    contrast("reading a sibling's workspace", outcomes["none"])
    assert b"s3cret" in outcomes["none"].stdout.data  # the same user, without walls


async def test_writes_outside_the_workspace_never_reach_the_host(walled_sshd: SSHServer) -> None:
    marker = f"agent-backend-escape-{os.getpid()}-{secrets.token_hex(4)}"
    home = str(Path.home())
    async with pool(walled_sshd, "namespaces") as backend:
        ws = await backend.hosts[0].make_workspace()
        targets = {
            f"/etc/{marker}": f"/etc/{marker}",
            f"$HOME/{marker}": f"{home}/{marker}",
            f"/tmp/{marker}": f"/tmp/{marker}",
            f"/var/tmp/{marker}": f"/var/tmp/{marker}",
            f"{posixpath.dirname(ws)}/{marker}": f"{posixpath.dirname(ws)}/{marker}",
        }
        line = "; ".join(f'echo pwned > "{inside}" && echo "wrote {inside}"' for inside in targets)
        result = await run(backend, sh(f"{line}; cat /tmp/{marker}", cwd=ws))
        written = [line.split()[1] for line in result.stdout.text().splitlines()[:-1]]
    try:
        # Only the sandbox's own /tmp took writes (the workspace root's copy there is a
        # mount point's parent in that tmpfs), and none reached the host.
        assert f"/tmp/{marker}" in written
        assert all(path.startswith("/tmp/") for path in written), written
        assert result.stdout.text().splitlines()[-1] == "pwned"
        assert b"Read-only file system" in result.stderr.data  # /etc
        for host_path in targets.values():
            assert not await anyio.Path(host_path).is_symlink(), host_path
            assert not await anyio.Path(host_path).exists(), host_path
    finally:
        for host_path in targets.values():
            with contextlib.suppress(OSError):
                os.unlink(host_path)
    async with pool(walled_sshd, "none") as backend:
        ws = await backend.hosts[0].make_workspace()
        unconfined = await run(backend, sh(f"echo pwned > /tmp/{marker}", cwd=ws))
    reached = await anyio.Path(f"/tmp/{marker}").exists()
    with contextlib.suppress(OSError):
        os.unlink(f"/tmp/{marker}")
    contrast("writing the host's /tmp", f"exit {unconfined.exit_status}, on the host: {reached}")
    assert reached


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()
    print("connected")
except OSError as exc:
    print("failed", exc.errno)
print(" ".join(name for _, name in socket.if_nameindex()))
"""


async def test_the_network_is_loopback_only(walled_sshd: SSHServer) -> None:
    """A listener on the ssh host's address (127.0.0.1 here): a walled command is refused at
    once (its loopback is its own), and its only interface is ``lo``."""
    with socket.socket() as listener:
        listener.bind((walled_sshd.address, 0))
        listener.listen()
        listener.setblocking(False)
        port = str(listener.getsockname()[1])
        probe = Command(argv=("python3", "-c", _CONNECT, walled_sshd.address, port), timeout=30)
        async with pool(walled_sshd, "namespaces") as backend:
            walled = await run(backend, probe)
        outcome, interfaces = walled.stdout.text().splitlines()
        assert outcome == "failed 111"  # ECONNREFUSED at once, not a timeout
        assert interfaces == "lo"
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's listener
        async with pool(walled_sshd, "none") as backend:
            unconfined = await run(backend, probe)
        contrast("connecting to the ssh host's listener", unconfined)
        assert unconfined.stdout.text().startswith("connected")


async def test_a_daemonized_process_dies_with_its_call(walled_sshd: SSHServer) -> None:
    duration = unique_duration(600)
    line = (
        f"setsid nohup sleep {duration} >/dev/null 2>&1 </dev/null & "
        f"until pgrep -f 'sleep {duration}' >/dev/null; do sleep 0.01; done; echo started"
    )
    try:
        async with pool(walled_sshd, "namespaces") as backend:
            ws = await backend.hosts[0].make_workspace()
            walled = await run(backend, sh(line, cwd=ws))
            assert walled.stdout.text() == "started\n"
            # The call returned: its PID namespace is gone, the daemon with it.
            assert await no_process_left(f"sleep {duration}", within=10) == []
        async with pool(walled_sshd, "none") as backend:
            ws = await backend.hosts[0].make_workspace()
            unconfined = await run(backend, sh(line, cwd=ws))
            survivors = processes_matching(f"sleep {duration}")
        contrast("setsid nohup sleep &", f"{unconfined.stdout.text().strip()}, left: {survivors}")
        assert survivors
    finally:
        kill_leftovers(f"sleep {duration}")


async def test_kill_minus_one_reaches_only_its_own_sandbox(walled_sshd: SSHServer) -> None:
    """No contrast: without walls, ``kill -9 -1`` from this user would end this test run."""
    async with pool(walled_sshd, "namespaces") as backend:
        host = backend.hosts[0]
        victim_ws, attacker_ws = await host.make_workspace(), await host.make_workspace()
        victim_line = "touch started; while [ ! -e go ]; do sleep 0.02; done; echo survived"
        outcomes: list[CommandResult] = []

        async def victim() -> None:
            outcomes.append(await host.run(sh(victim_line, cwd=victim_ws, timeout=40)))

        with anyio.fail_after(50):
            async with anyio.create_task_group() as tg:
                tg.start_soon(victim)
                started = Path(victim_ws, "started")
                assert await wait_until(started.exists, within=20)
                attack = await host.run(sh("kill -9 -1; echo still here", cwd=attacker_ws))
                assert attack.stdout.text() == "still here\n"
                await host.write_file(victim_ws, "go", b"")
        (result,) = outcomes
        assert (result.exit_status, result.stdout.text()) == (0, "survived\n")
        assert walled_sshd.is_running()


async def test_other_processes_are_invisible(walled_sshd: SSHServer) -> None:
    line = "for p in /proc/[0-9]*; do cat $p/comm; done"
    async with pool(walled_sshd, "namespaces") as backend:
        ws = await backend.hosts[0].make_workspace()
        walled = await run(backend, sh(line, cwd=ws))
    names = walled.stdout.text().split()
    assert "sshd" not in names
    assert len(names) <= 3, names  # bubblewrap's init, the shell, and the cat reading itself
    async with pool(walled_sshd, "none") as backend:
        unconfined = await run(backend, sh(line))
    contrast("processes seen in /proc", f"{len(unconfined.stdout.text().split())} processes")
    assert "sshd" in unconfined.stdout.text().split()


RAISE_NOFILE = "ulimit -H -n $(( $(ulimit -H -n) + 1 ))"


async def test_hard_limits_hold_and_cannot_be_raised(walled_sshd: SSHServer) -> None:
    limits = SandboxLimits(open_files=256, file_size_mb=1)
    line = (
        "ulimit -H -n; ulimit -H -f; ulimit -H -c; "
        f"{RAISE_NOFILE} 2>/dev/null && echo raised; "
        "python3 -c 'import resource as r; r.setrlimit(r.RLIMIT_NOFILE, (512, 512))' "
        "2>/dev/null && echo raised too; "
        "head -c 2097152 /dev/zero > big; echo big $?; "
        "cat /proc/self/oom_score_adj; grep -E '^(CapEff|NoNewPrivs):' /proc/self/status"
    )
    async with pool(walled_sshd, "namespaces", limits=limits) as backend:
        ws = await backend.hosts[0].make_workspace()
        walled = await run(backend, sh(line, cwd=ws))
        size = (await anyio.Path(ws, "big").stat()).st_size
    lines = walled.stdout.text().splitlines()
    assert lines[:3] == ["256", str(1 * 2048), "0"]
    assert "raised" not in lines
    assert "raised too" not in lines
    assert lines[3].split()[0] == "big"
    assert lines[3].split()[1] != "0"  # killed by SIGXFSZ at the limit
    assert size == 1 << 20  # RLIMIT_FSIZE
    assert lines[4] == "1000"  # the OOM killer takes a tool first
    assert lines[5].split() == ["CapEff:", "0000000000000000"]
    assert lines[6].split() == ["NoNewPrivs:", "1"]
    async with pool(walled_sshd, "none") as backend:
        unconfined = await run(backend, sh(f"{RAISE_NOFILE} && echo raised"))
    contrast("raising the hard limit of open files", unconfined)


# -- ending a sandboxed call: the token, the kill script ----------------------------------------


def both_sleeping(duration: str) -> Callable[[], bool]:
    """Both ``sleep``s of the call run (anchored: the shells' command lines hold the words too)."""
    return lambda: len(processes_matching(f"^sleep {duration}")) == 2


def _tokens_of(pids: list[int]) -> set[str]:
    tokens: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if entry.startswith(f"{remote.CALL_VAR}=".encode()):
                    tokens.add(entry.decode().partition("=")[2])
    return tokens


async def test_the_kill_script_finds_and_ends_a_sandboxed_call(walled_sshd: SSHServer) -> None:
    duration = unique_duration()
    try:
        async with pool(walled_sshd, "namespaces") as backend:
            host = backend.hosts[0]
            ws = await host.make_workspace()
            outcomes: list[CommandResult] = []

            async def call() -> None:
                line = f"sleep {duration} & sleep {duration}; echo never"
                outcomes.append(await host.run(sh(line, cwd=ws, timeout=40)))

            with anyio.fail_after(50):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    assert await wait_until(both_sleeping(duration), within=20)
                    # Inside the sandbox the call's token is in every process's environment.
                    tokens = _tokens_of(processes_matching(f"^sleep {duration}"))
                    assert len(tokens) == 1
                    killer = await host._maintenance(
                        host.connections()[0], remote.kill_script(sorted(tokens), "KILL"), 10.0
                    )
                    assert killer is not None
                    assert killer.exit_status == 0
            (result,) = outcomes
            assert b"never" not in result.stdout.data
            assert not result.timed_out
            assert (result.exit_status, result.signal) != (0, None)
            assert await no_process_left(f"sleep {duration}") == []
    finally:
        kill_leftovers(f"sleep {duration}")


async def test_timeout_and_cancellation_end_everything_a_sandboxed_call_started(
    walled_sshd: SSHServer,
) -> None:
    duration = unique_duration()
    line = f"(trap '' TERM; setsid sleep {duration}) & sleep {duration}; echo never"
    try:
        async with pool(walled_sshd, "namespaces") as backend:
            host = backend.hosts[0]
            ws = await host.make_workspace()
            timed_out = await run(backend, sh(line, cwd=ws, timeout=1.0))
            assert timed_out.timed_out
            assert b"never" not in timed_out.stdout.data
            assert await no_process_left(f"sleep {duration}") == []
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(host.run, sh(line, cwd=ws, timeout=30))
                    assert await wait_until(both_sleeping(duration), within=20)
                    tg.cancel_scope.cancel()
            assert await no_process_left(f"sleep {duration}") == []
            assert host.calls_in_flight() == 0
            assert host.statistics().remote_kills == 2
    finally:
        kill_leftovers(f"sleep {duration}")


# -- hosts that cannot build the walls ----------------------------------------------------------


async def test_a_host_without_bwrap_is_refused_naming_it_and_never_runs_unconfined(
    walled_sshd: SSHServer, sshd_factory: Callable[..., SSHServer], tmp_path: Path
) -> None:
    """A login PATH without bwrap: the host is refused (each call checks again), placement
    prefers a host that can wall its calls, and nothing ran without walls."""
    marker = tmp_path / "ran-unconfined"
    touch = Command(argv=("/usr/bin/touch", str(marker)), timeout=20)
    other = sshd_factory()
    without = SSHHostConfig(**walled_sshd.client_options(env={"PATH": "/nonexistent"}))
    able = SSHHostConfig(**other.client_options())
    config = SSHPoolConfig(hosts=(without, able), isolation="namespaces", close_timeout=5.0)
    async with SSHBackend.from_config(config) as backend:
        bad, good = backend.hosts
        with anyio.fail_after(30):
            assert backend.pick_host() is bad  # all idle: ties go to the first
            with pytest.raises(SandboxUnavailable, match="bwrap") as caught:
                await bad.run(touch)
            assert caught.value.missing == (
                "'bwrap' (bubblewrap) on the login PATH: apt-get install bubblewrap "
                "(dnf install bubblewrap)",
            )
            assert (caught.value.host, caught.value.backend) == (bad.name, "ssh")
            assert not marker.exists()
            assert bad.is_suspect()
            assert bad.statistics().walls_refused
            with pytest.raises(SandboxUnavailable, match="bwrap"):
                await bad.make_workspace()  # no session on a host that cannot wall it
            assert bad.workspaces() == frozenset()
            assert backend.pick_host() is good
            assert (await good.run(Command(argv=("true",), timeout=20))).exit_status == 0
    assert not marker.exists()  # the refused host never ran it, walled or not
    assert bad.statistics().calls == 1


def test_pool_check_shows_the_walls_and_a_refused_host(
    walled_sshd: SSHServer, sshd_factory: Callable[..., SSHServer], tmp_path: Path
) -> None:
    other = sshd_factory()
    lines = [
        'type = "ssh"',
        'isolation = "namespaces"',
        "connect_timeout = 5",
        "connect_retries = 0",
    ]
    for server, env in ((walled_sshd, {}), (other, {"PATH": "/nonexistent"})):
        lines.append("[[hosts]]")
        options = server.client_options(env=env)
        lines += [f"{key} = {json.dumps(value)}" for key, value in options.items() if key != "env"]
        lines += [f"env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in env.items())} }}"]
    pool_file = tmp_path / "ssh.toml"
    pool_file.write_text("\n".join(lines) + "\n")
    checked = runner.invoke(app, ["pool", "check", str(pool_file), "--timeout", "20"])
    assert checked.exit_code == 1, checked.output
    rows = {line.split()[0]: line for line in checked.stdout.splitlines() if "@" in line}
    ok = rows[f"{walled_sshd.user}@{walled_sshd.address}:{walled_sshd.port}"]
    refused = rows[f"{other.user}@{other.address}:{other.port}"]
    assert " ok " in ok
    assert "DOWN" in refused
    assert "SandboxUnavailable: isolation = 'namespaces' cannot be enforced" in refused
    assert "'bwrap' (bubblewrap) on the login PATH" in refused
    assert "  isolation: namespaces" in checked.stdout
    assert "  network: own network namespace per call: loopback only" in checked.stdout
    unwalled = runner.invoke(app, ["pool", "check", str(pool_file), "--isolation", "none"])
    assert unwalled.exit_code == 0, unwalled.output
    assert "  isolation: none" in unwalled.stdout
