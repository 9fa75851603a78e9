"""Workspaces of a local backend that was killed are removed by the next one to start; a live
backend's never are (agent_backend/backends/local/owner.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from support.ssh_helpers import wait_until

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.backends.local import owner as local_owner
from agent_backend.backends.local.owner import OwnerLock, sweep_dead_owners

pytestmark = pytest.mark.anyio

# A backend in another process: starts, makes a workspace with a file in it, says where,
# then waits to be killed (or to be told to close, on stdin).
CHILD = textwrap.dedent(
    """
    import sys, anyio
    from agent_backend.backends.local import LocalBackend, LocalPoolConfig

    async def main():
        async with LocalBackend(LocalPoolConfig(isolation="none", workspace_root=sys.argv[1])) as backend:
            await backend.start()
            path = await backend.host.make_workspace()
            open(path + "/data.txt", "w").write("x" * 100)
            print(path, flush=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)

    anyio.run(main)
    """
)


class Child:
    def __init__(self, root: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.workspace = Path(self.process.stdout.readline().strip())
        assert self.workspace.is_dir(), self.workspace

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(timeout=30) == -signal.SIGKILL

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(timeout=30) == 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


async def test_a_killed_backends_workspace_is_removed_when_the_next_starts(root: Path) -> None:
    child = Child(root)
    try:
        child.kill()
        assert child.workspace.is_dir()  # killed: it could not clean up
        async with LocalBackend(
            LocalPoolConfig(isolation="none", workspace_root=str(root))
        ) as backend:
            await backend.start()
            assert not child.workspace.exists()
            # Only the new backend's own lock and scratch directory are left.
            token = backend.host._owner.token  # type: ignore[union-attr]
            assert all(token in name for name in names(root)), names(root)
        assert names(root) == []
    finally:
        child.stop()


async def test_a_live_backends_workspace_is_never_touched(root: Path) -> None:
    child = Child(root)
    try:
        async with LocalBackend(
            LocalPoolConfig(isolation="none", workspace_root=str(root))
        ) as backend:
            await backend.start()
            assert (child.workspace / "data.txt").read_text() == "x" * 100
        child.close()
        assert names(root) == []  # it closed cleanly: workspace and lock file gone
    finally:
        child.stop()


async def test_two_backends_of_one_process_exclude_each_other(root: Path) -> None:
    config = LocalPoolConfig(isolation="none", workspace_root=str(root))
    async with LocalBackend(config) as first:
        await first.start()
        workspace = await first.host.make_workspace()
        async with LocalBackend(config) as second:
            await second.start()
            assert Path(workspace).is_dir()  # noqa: ASYNC240
        assert Path(workspace).is_dir()  # noqa: ASYNC240
        assert sweep_dead_owners(str(root)) == []


async def test_a_workspace_left_at_close_is_swept_later(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = LocalPoolConfig(isolation="none", workspace_root=str(root))
    backend = LocalBackend(config)
    await backend.start()
    workspace = await backend.host.make_workspace()
    # and its spare (one in use at most: one spare), made in the background
    assert await wait_until(lambda: len(backend.host.spare_workspaces()) == 1, within=10)

    def refuse(path: str) -> None:
        raise PermissionError(13, "refused by the test", path)

    with monkeypatch.context() as patch:
        patch.setattr("agent_backend.backends.local.backend.remove_tree", refuse)
        await backend.aclose()
    # Left (with the spare and the scratch directory), and so is the owner's lock file, unlocked.
    assert Path(workspace).is_dir()  # noqa: ASYNC240
    assert any(name.endswith(".lock") for name in names(root))
    swept = sweep_dead_owners(str(root))
    assert workspace in swept
    assert len(swept) == 3
    assert names(root) == []


def test_sweep_removes_a_link_with_an_owned_name_but_never_follows_it(
    root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    lock = OwnerLock.acquire(str(root))
    link = root / f"{lock.prefix('ws')}link"
    link.symlink_to(outside)
    lock.release_lock_only()  # as if its process had died
    assert sweep_dead_owners(str(root)) == [str(link)]
    assert (outside / "keep.txt").read_text() == "keep"
    assert names(root) == []


def test_sweep_removes_every_kind_of_a_dead_owners_directories(root: Path) -> None:
    lock = OwnerLock.acquire(str(root))
    for kind in ("ws", "spare", "trash", "scratch"):
        (root / f"{lock.prefix(kind)}abc").mkdir()
        (root / f"{lock.prefix(kind)}abc" / "data.txt").write_text("x")
    lock.release_lock_only()  # as if its process had died
    assert len(sweep_dead_owners(str(root))) == 4
    assert names(root) == []


def test_directories_without_a_lock_file_are_left_alone(root: Path) -> None:
    (root / "agent-backend-ws-0123456789abcdef-abc").mkdir()
    (root / "agent-backend-ws-legacy").mkdir()
    (root / "unrelated").mkdir()
    assert sweep_dead_owners(str(root)) == []
    assert len(names(root)) == 3


def test_an_unlocked_temporary_lock_is_taken_and_its_owner_starts_over(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instant between creating and locking the temporary file: a sweeper may take it."""
    real_flock = local_owner.fcntl.flock
    raced = []

    def flock_after_a_sweep(fd: int, operation: int) -> None:
        if not raced:
            raced.append(True)
            sweep_dead_owners(str(root))  # finds the temporary file unlocked: removes it
        real_flock(fd, operation)

    monkeypatch.setattr(local_owner.fcntl, "flock", flock_after_a_sweep)
    lock = OwnerLock.acquire(str(root))
    monkeypatch.setattr(local_owner.fcntl, "flock", real_flock)
    assert raced
    assert names(root) == [os.path.basename(lock.path)]
    assert sweep_dead_owners(str(root)) == []  # held
    lock.release()
    lock.release()  # idempotent
    assert names(root) == []


async def test_start_runs_the_sweep_off_the_event_loop(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real = local_owner.sweep_dead_owners

    def record(path: str) -> list[str]:
        threads.append(threading.get_ident())
        return real(path)

    monkeypatch.setattr("agent_backend.backends.local.backend.sweep_dead_owners", record)
    async with LocalBackend(LocalPoolConfig(isolation="none", workspace_root=str(root))) as backend:
        await backend.start()
    assert len(threads) == 1
    assert threads[0] != threading.get_ident()  # a worker thread, not the event loop's
