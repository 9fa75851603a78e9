"""WorkspaceKeeper: workspaces made and removed by a few threads of their own, spares kept ahead
(agent_backend/backends/local/workspaces.py). Waits are on states (a count, a path), each bounded."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from support.ssh_helpers import wait_until

from agent_backend.backends.local.workspaces import THREADS, WorkspaceKeeper
from agent_backend.errors import PoolClosed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class Disk:
    """Spares made, renamed and removed under ``root``, counted; ``gate`` (cleared) holds makes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made = 0
        self.removed = 0
        self.fail_makes = False
        self.fail_removals = False
        self.fail_discards = False
        self.gate = threading.Event()
        self.gate.set()
        self.remove_gate = threading.Event()  # cleared: removals are held
        self.remove_gate.set()
        # Set: a removal waits (bounded) until this many makes are done, and notes if it ran out.
        self.removals_wait_for_made: int | None = None
        self.removal_starved_makes = False
        self.lock = threading.Lock()

    def make(self) -> str:
        self.gate.wait(10)
        if self.fail_makes:
            raise OSError(28, "No space left on device")
        path = tempfile.mkdtemp(prefix="spare-", dir=self.root)
        with self.lock:
            self.made += 1
        return path

    def activate(self, spare: str) -> str:
        head, name = os.path.split(spare)
        path = os.path.join(head, "ws-" + name.removeprefix("spare-"))
        os.rename(spare, path)
        return path

    def remove(self, path: str) -> None:
        self.remove_gate.wait(10)
        if self.removals_wait_for_made is not None:
            deadline = time.monotonic() + 5
            while self.made < self.removals_wait_for_made and time.monotonic() < deadline:
                time.sleep(0.005)
            if self.made < self.removals_wait_for_made:
                self.removal_starved_makes = True
        if self.fail_removals:
            raise PermissionError(13, "refused by the test", path)
        shutil.rmtree(path)
        with self.lock:
            self.removed += 1

    def discard(self, path: str) -> str:
        if self.fail_discards:
            raise OSError(18, "Invalid cross-device link", path)
        head, name = os.path.split(path)
        trash = os.path.join(head, "trash-" + name.removeprefix("ws-"))
        os.rename(path, trash)
        return trash

    def listing(self) -> list[str]:
        return sorted(os.listdir(self.root))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``condition()`` holds: the threads work at their own pace."""
    assert await wait_until(condition, within=10, step=0.005), what


def is_dir(path: str) -> bool:
    return os.path.isdir(path)


@pytest.fixture
async def disk(tmp_path: Path) -> Disk:
    return Disk(tmp_path)


async def open_keeper(disk: Disk, max_spares: int, *, trash: bool = False) -> WorkspaceKeeper:
    return WorkspaceKeeper(
        disk.make,
        disk.activate,
        disk.remove,
        max_spares=max_spares,
        loop=asyncio.get_running_loop(),
        discard=disk.discard if trash else None,
    )


@pytest.fixture
async def keeper(disk: Disk) -> AsyncIterator[WorkspaceKeeper]:
    keeper = await open_keeper(disk, max_spares=8)
    yield keeper
    for path in await keeper.aclose():
        disk.remove(path)


async def test_spares_follow_the_most_in_use_and_are_handed_out_without_a_make(
    keeper: WorkspaceKeeper, disk: Disk
) -> None:
    taken = [await keeper.take() for _ in range(3)]
    assert len(set(taken)) == 3
    assert all(is_dir(p) and os.path.basename(p).startswith("ws-") for p in taken)
    await until(lambda: keeper.spares == 3, "three spares made after three in use")
    made = disk.made
    disk.gate.clear()  # a make now would block: a spare must come without one
    fourth = await keeper.take()
    assert disk.made == made
    assert fourth not in taken
    disk.gate.set()
    for path in [*taken, fourth]:
        await keeper.remove(path)
        assert not is_dir(path)  # gone when remove() returns
    await until(lambda: keeper.spares == 4, "the spares grew to the four in use at once")
    assert [n.split("-")[0] for n in disk.listing()] == ["spare"] * 4  # the spares, nothing else
    assert {os.path.basename(p) for p in keeper.spare_paths()} == set(disk.listing())


async def test_spares_never_exceed_max_spares(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=2)
    try:
        taken = [await keeper.take() for _ in range(5)]
        await until(lambda: keeper.spares == 2, "two spares")
        for path in taken:
            await keeper.remove(path)
        # The threads are idle once the target is met: nothing more is made.
        await until(lambda: disk.made == 7, "five taken and two spares made")
        assert keeper.spares == 2
        assert len(disk.listing()) == 2
    finally:
        for path in await keeper.aclose():
            disk.remove(path)
    assert disk.listing() == []


async def test_no_spares_when_max_spares_is_zero(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0)
    try:
        path = await keeper.take()
        await keeper.remove(path)
        assert (keeper.spares, disk.made, disk.listing()) == (0, 1, [])
    finally:
        assert await keeper.aclose() == []


async def test_many_at_once_are_made_by_every_thread(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0)
    try:
        disk.gate.clear()
        results: list[str] = []

        async def take() -> None:
            results.append(await keeper.take())

        async with anyio.create_task_group() as group:
            for _ in range(THREADS * 3):
                group.start_soon(take)
            await anyio.lowlevel.checkpoint()
            disk.gate.set()
        assert len(set(results)) == THREADS * 3
        for path in results:
            await keeper.remove(path)
        assert disk.listing() == []
    finally:
        await keeper.aclose()


async def test_a_workspace_made_for_a_caller_who_gave_up_is_removed(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0)
    try:
        disk.gate.clear()
        with anyio.move_on_after(0.05):
            await keeper.take()  # held at the gate, then cancelled
        disk.gate.set()
        await until(lambda: disk.made == 1, "the make the cancelled caller asked for")
        await until(lambda: disk.removed == 1, "its directory removed in the background")
        assert disk.listing() == []
    finally:
        assert await keeper.aclose() == []


async def test_a_spare_removed_from_outside_is_replaced_by_a_new_one(
    keeper: WorkspaceKeeper, disk: Disk
) -> None:
    first = await keeper.take()
    await until(lambda: keeper.spares == 1, "one spare")
    (spare,) = keeper.spare_paths()
    os.rmdir(spare)  # the rename fails: a thread makes one instead
    second = await keeper.take()
    assert is_dir(second)
    assert second != first
    for path in (first, second):
        await keeper.remove(path)


async def test_a_failed_make_reaches_the_caller_and_spares_stop_until_asked_again(
    keeper: WorkspaceKeeper, disk: Disk
) -> None:
    disk.fail_makes = True
    with pytest.raises(OSError, match="No space left"):
        await keeper.take()
    assert keeper.spares == 0
    disk.fail_makes = False
    path = await keeper.take()
    assert is_dir(path)
    await keeper.remove(path)


async def test_a_failed_removal_reaches_the_caller(keeper: WorkspaceKeeper, disk: Disk) -> None:
    path = await keeper.take()
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError):
        await keeper.remove(path)


async def test_aclose_refuses_waiting_callers_is_idempotent_and_ends_the_threads(
    disk: Disk,
) -> None:
    keeper = await open_keeper(disk, max_spares=4)
    disk.gate.clear()
    errors: list[BaseException] = []

    async def take() -> None:
        try:
            await keeper.take()
        except PoolClosed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        for _ in range(THREADS + 2):  # more than the threads: some wait in the queue
            group.start_soon(take)
        await until(lambda: keeper.waiting == 2, "two callers queued behind the threads")
        async with anyio.create_task_group() as closers:
            closers.start_soon(keeper.aclose)
            await anyio.lowlevel.checkpoint()
            disk.gate.set()
    left = await keeper.aclose()  # again: the same end, nothing twice
    assert len(errors) == 2
    assert not keeper.running
    with pytest.raises(PoolClosed):
        await keeper.take()
    for path in [*left, *(str(disk.root / name) for name in disk.listing())]:
        if is_dir(path):
            disk.remove(path)


# -- with a discard function: renamed to trash, removed afterwards ---------------------------------


async def test_remove_renames_to_trash_and_returns_before_the_tree_is_removed(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0, trash=True)
    try:
        path = await keeper.take()
        Path(path, "data.txt").write_text("x")  # noqa: ASYNC240
        disk.remove_gate.clear()  # no removal can finish now
        with anyio.fail_after(5):
            await keeper.remove(path)
        assert not is_dir(path)  # gone under its name at once
        assert disk.removed == 0
        assert [n.split("-")[0] for n in disk.listing()] == ["trash"]
        disk.remove_gate.set()
        # Counted after the tree is gone: wait for the count, not only for the empty folder.
        await until(
            lambda: disk.removed == 1 and disk.listing() == [], "the trash removed by a thread"
        )
        assert disk.removed == 1
    finally:
        disk.remove_gate.set()
        assert await keeper.aclose() == []


async def test_aclose_waits_for_the_trash(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0, trash=True)
    paths = [await keeper.take() for _ in range(THREADS + 2)]
    disk.remove_gate.clear()
    for path in paths:
        await keeper.remove(path)
    assert len(disk.listing()) == THREADS + 2  # all trash, none removed yet
    async with anyio.create_task_group() as group:
        group.start_soon(keeper.aclose)
        await anyio.lowlevel.checkpoint()
        assert keeper.running  # held by the removals
        disk.remove_gate.set()
    assert not keeper.running
    assert disk.removed == THREADS + 2
    assert disk.listing() == []


async def test_a_trash_removal_that_fails_is_logged_and_left_to_aclose(
    disk: Disk, caplog: pytest.LogCaptureFixture
) -> None:
    keeper = await open_keeper(disk, max_spares=0, trash=True)
    path = await keeper.take()
    disk.fail_removals = True
    with caplog.at_level("WARNING", logger="agent_backend.backends.local"):
        await keeper.remove(path)  # returns: nobody waits for the trash
        await until(
            lambda: any("could not remove workspace" in r.message for r in caplog.records),
            "the failure logged",
        )
    left = await keeper.aclose()
    assert [os.path.basename(p) for p in left] == disk.listing()
    assert [n.split("-")[0] for n in disk.listing()] == ["trash"]


async def test_a_failed_rename_to_trash_falls_back_to_a_removal_waited_for(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=0, trash=True)
    try:
        disk.fail_discards = True
        path = await keeper.take()
        await keeper.remove(path)
        assert disk.removed == 1  # removed in place before remove() returned
        assert disk.listing() == []
        path = await keeper.take()
        disk.fail_removals = True
        with pytest.raises(PermissionError, match="refused by the test"):
            await keeper.remove(path)  # and its error reaches the caller
    finally:
        disk.fail_removals = False
        for left in await keeper.aclose():
            disk.remove(left)


async def test_spares_are_made_before_the_trash_is_removed(disk: Disk) -> None:
    keeper = await open_keeper(disk, max_spares=2 * THREADS, trash=True)
    try:
        first = [await keeper.take() for _ in range(2 * THREADS)]
        await until(lambda: keeper.spares == 2 * THREADS, "a spare for each in use")
        made = disk.made
        disk.gate.clear()  # the threads now hold in the makes of the next spares
        second = [await keeper.take() for _ in range(2 * THREADS)]  # the spares: no make
        for path in [*first, *second]:
            await keeper.remove(path)  # trash queued behind the makes
        # A removal holds its thread until every spare owed is made: only the other
        # threads, picking spares before trash, can make them.
        disk.removals_wait_for_made = made + 2 * THREADS
        disk.gate.set()
        await until(lambda: keeper.spares == 2 * THREADS, "the spares made again")
        await until(lambda: disk.removed == 4 * THREADS, "then the trash removed")
        assert not disk.removal_starved_makes
        assert [n.split("-")[0] for n in disk.listing()] == ["spare"] * (2 * THREADS)
    finally:
        disk.gate.set()
        disk.removals_wait_for_made = None
        for path in await keeper.aclose():
            disk.remove(path)
