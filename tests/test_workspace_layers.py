"""Forks, snapshots, graders and the workspace quota of the local host (docs/sandboxes.md).

Under ``isolation = "namespaces"`` a fork is copy-on-write (overlayfs over frozen layers,
:mod:`agent_backend.sandbox.layers`): each test runs real commands in real sandboxes, and
checks what each sandbox sees, what the mount table holds, and what is left on disk. Those
tests need root, bubblewrap and cgroup v1: without them they skip, except under ``CI=true``,
where they fail. Under ``isolation = "none"`` a fork is a copy (``cp -a``): those run anywhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from support.walls import require_walls

from agent_backend.backends.local import LocalBackend, LocalHost, LocalPoolConfig
from agent_backend.dispatch.backend import Command, CommandResult, DirEntry, FileData, Host
from agent_backend.errors import BackendUnavailable, PoolError
from agent_backend.sandbox import SandboxLimits, guarantees_of
from agent_backend.sandbox.layers import mount_points

pytestmark = pytest.mark.anyio

LIMITS = SandboxLimits(memory_mb=256, tasks=64, tmp_mb=16)
QUOTA_MB = 8


def _mounts_in(root: Path | str) -> list[str]:
    """Mount points at or below ``root`` (this process's mount table)."""
    top = str(root).rstrip("/")
    return [point for point in mount_points() if point == top or point.startswith(top + "/")]


def _config(root: Path, **overrides: object) -> LocalPoolConfig:
    return LocalPoolConfig.model_validate(
        {
            "isolation": "namespaces",
            "limits": LIMITS,
            "spare_workspaces": 2,
            "workspace_root": str(root),
            **overrides,
        }
    )


@pytest.fixture
async def walled(tmp_path: Path) -> AsyncIterator[LocalHost]:
    require_walls()
    root = tmp_path / "root"
    async with LocalBackend(_config(root)) as backend:
        yield backend.host
    assert _mounts_in(root) == []
    assert [path async for path in anyio.Path(root).iterdir()] == []  # the store too


@pytest.fixture
async def quota(tmp_path: Path) -> AsyncIterator[LocalHost]:
    require_walls()
    root = tmp_path / "root"
    async with LocalBackend(_config(root, workspace_quota_mb=QUOTA_MB)) as backend:
        yield backend.host
    assert _mounts_in(root) == []
    assert [path async for path in anyio.Path(root).iterdir()] == []  # the store too


@pytest.fixture
async def copying(tmp_path: Path) -> AsyncIterator[LocalHost]:
    config = LocalPoolConfig(isolation="none", spare_workspaces=0, workspace_root=str(tmp_path))
    async with LocalBackend(config) as backend:
        yield backend.host


def _wait_for_file(path: str) -> None:
    """Until ``path`` exists (a state, bounded by polls, not by a time)."""
    for _ in range(60_000):
        if os.path.exists(path):
            return
        time.sleep(0.005)
    raise AssertionError(f"{path} never appeared")


async def sh(host: LocalHost, line: str, cwd: str) -> CommandResult:
    return await host.run(Command(shell=line, cwd=cwd, timeout=60, output_limit=1 << 16))


async def out(host: LocalHost, line: str, cwd: str) -> str:
    result = await sh(host, line, cwd)
    assert result.exit_status == 0, (line, result)
    return result.stdout.text()


# What a fork must carry over: content, an empty file, a symlink, modes of files and dirs.
PREPARE = (
    "echo base > a && : > empty && ln -s a link && mkdir -p d/e && echo deep > d/e/f && "
    "chmod 751 d && chmod 640 a && printf '#!/bin/sh\\necho ran\\n' > run.sh && chmod 755 run.sh"
)
DESCRIBE = "cat a; cat d/e/f; stat -c '%n %s %a %F' a empty link d d/e/f run.sh; readlink link"


# -- forks under walls ---------------------------------------------------------------------------


async def test_a_fork_gives_n_copies_of_the_base(walled: LocalHost) -> None:
    base = await walled.make_workspace()
    await out(walled, PREPARE, base)
    before = await out(walled, DESCRIBE, base)
    copies = await walled.fork_workspace(base, 3)
    assert walled.fork_method == "overlay"
    assert len(set(copies)) == 3
    assert base not in copies
    uids = {os.stat(path).st_uid for path in [base, *copies]}
    assert len(uids) == 4  # a uid of its own each
    for path in copies:
        assert await out(walled, DESCRIBE, path) == before
        assert await out(walled, "./run.sh; id -u", path) == f"ran\n{os.stat(path).st_uid}\n"
        assert path in walled.workspaces()
    assert await out(walled, DESCRIBE, base) == before


async def test_writes_in_one_copy_reach_no_other_nor_the_base(walled: LocalHost) -> None:
    base = await walled.make_workspace()
    await out(walled, PREPARE, base)
    first, second = await walled.fork_workspace(base, 2)
    # In a copy: change, add, remove, rename a directory.
    await out(walled, "echo first > a && echo new > new && rm empty && mv d d2", first)
    assert await out(walled, "cat a; ls", first) == "first\na\nd2\nlink\nnew\nrun.sh\n"
    for other in (second, base):
        assert await out(walled, "cat a; ls", other) == "base\na\nd\nempty\nlink\nrun.sh\n"
    # The base keeps working, and what it writes now reaches no copy.
    await out(walled, "echo later > a && echo mine > only-base", base)
    await walled.write_file(base, "by-host", b"tool")
    assert (await walled.read_file(base, "by-host", limit=99)).data == b"tool"
    for copy in (first, second):
        listing = await out(walled, "cat a; ls", copy)
        assert "later" not in listing
        assert "only-base" not in listing
        assert "by-host" not in listing
    assert await out(walled, "cat a only-base", base) == "later\nmine\n"


async def test_a_fork_of_a_fork_stacks_its_layers(walled: LocalHost) -> None:
    base = await walled.make_workspace()
    await out(walled, PREPARE, base)
    (child,) = await walled.fork_workspace(base, 1)
    await out(walled, "echo child > a && echo c > from-child && rm -r d", child)
    grandchildren = await walled.fork_workspace(child, 2)
    for path in grandchildren:
        assert await out(walled, "cat a from-child; ls", path) == (
            "child\nc\na\nempty\nfrom-child\nlink\nrun.sh\n"
        )
    await out(walled, "echo g > a && mkdir d && echo again > d/x", grandchildren[0])
    assert await out(walled, "cat a; ls", child) == "child\na\nempty\nfrom-child\nlink\nrun.sh\n"
    assert await out(walled, "cat a", grandchildren[1]) == "child\n"
    assert await out(walled, "cat a d/e/f", base) == "base\ndeep\n"
    # A snapshot of three layers shows what the workspace shows: whiteouts, an opaque directory.
    view = Path(await walled.snapshot_workspace(grandchildren[0]))
    assert sorted(os.listdir(view)) == ["a", "d", "empty", "from-child", "link", "run.sh"]
    assert (view / "a").read_text() == "g\n"
    assert os.listdir(view / "d") == ["x"]
    # Forked again after a change: one more layer; unchanged: the same one.
    await out(walled, "echo again > a", child)
    (again,) = await walled.fork_workspace(child, 1)
    assert await out(walled, "cat a", again) == "again\n"
    assert await out(walled, "cat a", grandchildren[1]) == "child\n"


async def test_removing_every_workspace_leaves_no_mount_and_no_layer(walled: LocalHost) -> None:
    root = str(walled.config.workspace_root)
    base = await walled.make_workspace()
    await out(walled, PREPARE, base)
    copies = await walled.fork_workspace(base, 2)
    nested = await walled.fork_workspace(copies[0], 2)
    snapshot = await walled.snapshot_workspace(copies[1])
    layers = walled._layers
    assert layers is not None
    assert layers.directory is not None
    assert len(_mounts_in(root)) >= 6  # an overlay per workspace, the snapshot's view
    for path in [*nested, base, *copies]:
        await walled.remove_workspace(path)
        assert not await anyio.Path(path).exists()
    await walled.remove_snapshot(snapshot)
    assert _mounts_in(root) == []
    assert os.listdir(layers.directory) == []
    assert layers.layers() == []
    # And the base's own removal first, its copies after: the layers go with the last user.
    base = await walled.make_workspace()
    (copy,) = await walled.fork_workspace(base, 1)
    await walled.remove_workspace(base)
    assert await out(walled, "ls; echo still > x; cat x", copy) == "still\n"
    await walled.remove_workspace(copy)
    assert _mounts_in(root) == []
    assert os.listdir(layers.directory) == []


async def test_a_busy_workspace_is_not_forked(walled: LocalHost) -> None:
    base = await walled.make_workspace()
    release = f"{base}/go"
    outcome: list[CommandResult] = []

    async def long_call() -> None:
        line = "touch started; while [ ! -e go ]; do sleep 0.01; done; echo done"
        outcome.append(await sh(walled, line, base))

    async with anyio.create_task_group() as group:
        group.start_soon(long_call)
        await anyio.to_thread.run_sync(_wait_for_file, f"{base}/started")
        with pytest.raises(PoolError, match="busy"):
            await walled.fork_workspace(base, 2)
        with pytest.raises(PoolError, match="busy"):
            await walled.snapshot_workspace(base)
        await anyio.Path(release).touch()
    assert outcome[0].stdout.text() == "done\n"
    (copy,) = await walled.fork_workspace(base, 1)  # between calls: fine
    assert await out(walled, "ls", copy) == "go\nstarted\n"
    with pytest.raises(PoolError, match="not a workspace"):
        await walled.fork_workspace("/nonexistent", 1)
    with pytest.raises(ValueError, match="at least one"):
        await walled.fork_workspace(base, 0)


async def test_calls_that_come_during_a_fork_wait_for_it(walled: LocalHost) -> None:
    base = await walled.make_workspace()
    await out(walled, "echo base > a", base)
    results: list[str] = []

    async def call() -> None:
        results.append(await out(walled, "cat a", base))

    async with anyio.create_task_group() as group:
        forked = group.start_soon
        forked(call)
        copies = await walled.fork_workspace(base, 4)
        for _ in range(4):
            forked(call)
    assert results == ["base\n"] * 5
    assert len(copies) == 4


# -- snapshots and graders -------------------------------------------------------------------------


async def test_a_grader_sees_the_snapshot_and_its_assets_and_nothing_else(
    walled: LocalHost, tmp_path: Path
) -> None:
    hidden = tmp_path / "hidden-tests"
    hidden.mkdir(mode=0o755)
    (hidden / "test_answer.sh").write_text('test "$(cat answer)" = 42 && echo PASS\n')
    (hidden / "test_answer.sh").chmod(0o644)
    secret = tmp_path / "expected.txt"
    secret.write_text("42\n")
    secret.chmod(0o644)
    agent = await walled.make_workspace()
    await out(walled, "echo 42 > answer", agent)
    snapshot = await walled.snapshot_workspace(agent)
    assert (Path(snapshot) / "answer").read_text() == "42\n"
    # The agent cannot see the assets, before grading or after; its later changes reach no grader.
    for path in (hidden, secret):
        probe = await sh(walled, f"ls {path}", agent)
        assert probe.exit_status != 0
    await out(walled, "echo 41 > answer && echo planted > extra", agent)
    grade = Command(
        shell="sh ../assets/hidden-tests/test_answer.sh; cat $GRADER_ASSETS/expected.txt; ls;"
        " id -u; echo graded > answer; echo tamper > ../assets/expected.txt || echo RO",
        timeout=60,
    )
    result = await walled.run_on_snapshot(snapshot, grade, assets=[str(hidden), str(secret)])
    lines = result.stdout.text().splitlines()
    assert lines[:3] == ["PASS", "42", "answer"], result
    assert int(lines[3]) not in {os.stat(agent).st_uid}
    assert lines[-1] == "RO"
    assert secret.read_text() == "42\n"
    # The grader's writes reached neither the snapshot nor the agent; its workspace is gone.
    assert (Path(snapshot) / "answer").read_text() == "42\n"
    assert not (Path(snapshot) / "extra").exists()
    assert await out(walled, "cat answer", agent) == "41\n"
    assert len(walled.workspaces()) == 1
    again = await walled.run_on_snapshot(snapshot, Command(shell="cat answer", timeout=60))
    assert again.stdout.text() == "42\n"
    await walled.remove_snapshot(snapshot)
    assert not await anyio.Path(snapshot).exists()
    with pytest.raises(PoolError, match="not a snapshot"):
        await walled.run_on_snapshot(snapshot, grade)


async def test_assets_an_agent_could_see_are_refused(walled: LocalHost) -> None:
    agent = await walled.make_workspace()
    snapshot = await walled.snapshot_workspace(agent)
    for asset, why in [
        ("/etc/hostname", "a sandbox is shown"),
        (agent, "a sandbox is shown"),
        ("relative/path", "must be absolute"),
        ("/nonexistent-asset", "does not exist"),
    ]:
        with pytest.raises(ValueError, match=why):
            await walled.run_on_snapshot(
                snapshot, Command(argv=("true",), timeout=60), assets=[asset]
            )
    assert walled.workspaces() == {agent}


# -- the quota -------------------------------------------------------------------------------------


async def test_a_write_past_the_quota_fails_and_the_session_goes_on(quota: LocalHost) -> None:
    workspace = await quota.make_workspace()
    fill = f"dd if=/dev/zero of=big bs=1M count={QUOTA_MB + 1} 2>&1"
    result = await sh(quota, fill, workspace)
    assert result.exit_status != 0
    assert "No space left on device" in result.stdout.text()
    with pytest.raises(OSError, match="No space left on device"):
        await quota.write_file(workspace, "more", b"x" * (2 << 20))
    assert await out(quota, "rm big more; echo fine > small; cat small", workspace) == "fine\n"
    assert any(line == f"disk: {QUOTA_MB} MiB" or line.startswith(f"disk: {QUOTA_MB} MiB")
               for line in quota.guarantees().lines())  # fmt: skip
    # A fork's own changes have the quota too (what it inherited is not counted).
    await out(quota, "dd if=/dev/zero of=half bs=1M count=5 2>/dev/null", workspace)
    (copy,) = await quota.fork_workspace(workspace, 1)
    forked = await sh(quota, f"dd if=/dev/zero of=big bs=1M count={QUOTA_MB + 1} 2>&1", copy)
    assert "No space left on device" in forked.stdout.text()
    assert await out(quota, "rm big; ls", copy) == "half\nsmall\n"
    assert await out(quota, "ls", workspace) == "half\nsmall\n"


def test_a_quota_needs_the_walls() -> None:
    with pytest.raises(ValueError, match="workspace_quota_mb"):
        LocalPoolConfig(isolation="none", workspace_quota_mb=64)
    assert LocalPoolConfig(isolation="none").workspace_quota_mb is None
    lines = guarantees_of("namespaces", SandboxLimits(), workspace_quota_mb=64).lines()
    assert any(line.startswith("disk: 64 MiB per workspace") for line in lines)
    assert any(line.startswith("disk: no quota") for line in guarantees_of("none", LIMITS).lines())


# -- a backend killed with forks: its successor removes every mount and directory -----------------

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
            workspace_root=sys.argv[2],
            workspace_quota_mb=int(sys.argv[3]) if sys.argv[3] != "-" else None,
        )
        async with LocalBackend(config) as backend:
            host = backend.host
            base = await host.make_workspace()
            await host.run(Command(shell="echo base > a", cwd=base, timeout=60))
            copies = await host.fork_workspace(base, 2)
            await host.fork_workspace(copies[0], 1)
            await host.snapshot_workspace(copies[1])
            print("READY", flush=True)
            await anyio.sleep_forever()

    anyio.run(main)
    """
)


def _fork_and_die(state: Path, root: Path, quota: str) -> str:
    """Run an owner that forks, SIGKILL it once it says so; the token of its directories."""
    with subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(state), str(root), quota], stdout=subprocess.PIPE
    ) as owner:
        try:
            assert owner.stdout is not None
            assert owner.stdout.readline() == b"READY\n"
        finally:
            owner.send_signal(signal.SIGKILL)
            owner.wait()
    (lock,) = root.glob("agent-backend-owner-*.lock")
    return lock.name.removeprefix("agent-backend-owner-").removesuffix(".lock")


@pytest.mark.parametrize("quota_mb", ["-", str(QUOTA_MB)], ids=["plain", "quota"])
async def test_a_successor_unmounts_and_removes_what_a_killed_owner_forked(
    tmp_path: Path, quota_mb: str
) -> None:
    require_walls()
    state, root = tmp_path / "state", tmp_path / "root"
    root.mkdir(mode=0o711)
    token = await anyio.to_thread.run_sync(_fork_and_die, state, root, quota_mb)
    left = [name for name in os.listdir(root) if token in name]
    assert any(name.startswith("agent-backend-layers-") for name in left)
    assert len(_mounts_in(root)) >= 5  # overlays, the snapshot's view (and tmpfs)
    config = _config(root, sandbox_state_dir=str(state), spare_workspaces=0)
    async with LocalBackend(config):
        assert [name for name in os.listdir(root) if token in name] == []
        assert [point for point in _mounts_in(root) if token in point] == []
    assert _mounts_in(root) == []
    assert os.listdir(root) == []


# -- without walls: copies -------------------------------------------------------------------------


async def test_without_walls_a_fork_is_a_copy(copying: LocalHost, tmp_path: Path) -> None:
    assert copying.fork_method == "copy"
    base = await copying.make_workspace()
    await out(copying, PREPARE, base)
    before = await out(copying, DESCRIBE, base)
    first, second = await copying.fork_workspace(base, 2)
    assert await out(copying, DESCRIBE, first) == before
    await out(copying, "echo first > a", first)
    assert await out(copying, "cat a", second) == "base\n"
    assert await out(copying, "cat a", base) == "base\n"
    snapshot = await copying.snapshot_workspace(base)
    await out(copying, "echo later > a", base)
    assets = tmp_path / "assets-dir"
    assets.mkdir()
    (assets / "t").write_text("hidden\n")
    grade = Command(shell="cat a ../assets/assets-dir/t; echo g > a", timeout=60)
    result = await copying.run_on_snapshot(snapshot, grade, assets=[str(assets)])
    assert result.stdout.text() == "base\nhidden\n"
    assert (Path(snapshot) / "a").read_text() == "base\n"
    await copying.remove_snapshot(snapshot)
    assert not await anyio.Path(snapshot).exists()
    for path in (base, first, second):
        await copying.remove_workspace(path)


async def test_a_host_without_forks_says_so() -> None:
    class Plain(Host):
        name = "plain"

        async def run(self, command: Command) -> CommandResult:
            raise NotImplementedError

        async def make_workspace(self) -> str:
            raise NotImplementedError

        async def remove_workspace(self, path: str) -> None:
            raise NotImplementedError

        async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
            raise NotImplementedError

        async def write_file(
            self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
        ) -> None:
            raise NotImplementedError

        async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
            raise NotImplementedError

        def calls_in_flight(self) -> int:
            return 0

    host = Plain()
    with pytest.raises(BackendUnavailable, match="cannot fork"):
        await host.fork_workspace("/w", 2)
    with pytest.raises(BackendUnavailable, match="cannot snapshot"):
        await host.snapshot_workspace("/w")
    with pytest.raises(BackendUnavailable):
        await host.run_on_snapshot("/s", Command(argv=("true",), timeout=1))
