"""BackgroundTasks, the one task group of every owner of background work (agent_backend.lifecycle).

Proved by states (events, counters, task states), never by sleeps or elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import anyio
import pytest

from agent_backend.lifecycle import BackgroundTasks

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class Worker:
    """A background task that says when it runs and when it ended (and how)."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.ended = anyio.Event()
        self.cancelled = False
        self.task: asyncio.Task[object] | None = None

    async def __call__(self) -> None:
        self.task = asyncio.current_task()
        self.started.set()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        finally:
            self.ended.set()


async def test_tasks_run_while_open_and_close_cancels_and_awaits_them() -> None:
    workers = [Worker() for _ in range(3)]
    tasks = BackgroundTasks("test")
    async with tasks:
        assert tasks.is_open()
        for worker in workers:
            tasks.start_soon(worker)
        for worker in workers:
            await worker.started.wait()  # all three in flight at once
        assert "[tasks: 3]" in repr(tasks)
        assert not any(worker.ended.is_set() for worker in workers)
    # aclose() returned: every task was cancelled and has ended; none outlives the owner.
    assert all(worker.cancelled and worker.ended.is_set() for worker in workers)
    assert all(worker.task is not None and worker.task.done() for worker in workers)
    assert tasks.is_closed()
    assert not tasks.is_open()
    assert repr(tasks) == "<BackgroundTasks 'test' [tasks: 0] closed>"
    with pytest.raises(RuntimeError, match="closed"):
        tasks.start_soon(Worker())


async def test_close_is_idempotent_and_concurrent_closes_all_wait_for_the_end() -> None:
    worker = Worker()
    tasks = BackgroundTasks("test")
    await tasks.open()
    tasks.start_soon(worker)
    await worker.started.wait()
    returned: list[bool] = []

    async def close() -> None:
        await tasks.aclose()
        returned.append(worker.ended.is_set())

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(close)
    assert returned == [True, True, True]  # none returned before the task had ended
    await tasks.aclose()  # and again, after
    assert tasks.is_closed()


async def test_close_is_shielded_from_the_callers_cancellation() -> None:
    release = anyio.Event()
    ended = anyio.Event()

    async def slow_to_stop() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await release.wait()  # its cleanup takes a while
            ended.set()

    tasks = BackgroundTasks("test")
    await tasks.open()
    tasks.start_soon(slow_to_stop)
    closed = anyio.Event()

    async def close_cancelled() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()  # the caller is cancelled before and during the close
            await tasks.aclose()
        closed.set()

    async with anyio.create_task_group() as group:
        group.start_soon(close_cancelled)
        await anyio.wait_all_tasks_blocked()
        assert not ended.is_set()
        assert not closed.is_set()
        release.set()
    assert ended.is_set()
    assert closed.is_set()
    assert tasks.is_closed()


async def test_a_closed_or_never_opened_group_starts_nothing() -> None:
    tasks = BackgroundTasks("test")
    with pytest.raises(RuntimeError, match="not open"):
        tasks.start_soon(Worker())
    await tasks.aclose()  # never opened: nothing to do
    await tasks.aclose()
    with pytest.raises(RuntimeError, match="once"):
        await tasks.open()


async def test_a_failing_task_stops_the_others_is_logged_and_raised_by_the_first_close(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="agent_backend.lifecycle")
    sibling = Worker()
    go = anyio.Event()

    async def fails() -> None:
        await go.wait()
        raise ValueError("the probe broke")

    tasks = BackgroundTasks("test pool")
    await tasks.open()
    tasks.start_soon(sibling)
    tasks.start_soon(fails)
    await sibling.started.wait()
    go.set()
    await sibling.ended.wait()  # the failure ended the group: its sibling was cancelled
    assert sibling.cancelled
    await anyio.wait_all_tasks_blocked()
    assert isinstance(tasks.failure(), ValueError)
    assert not tasks.is_open()
    assert "failed" in repr(tasks)
    [record] = [r for r in caplog.records if r.name == "agent_backend.lifecycle"]
    assert "test pool" in record.getMessage()
    assert record.exc_info is not None
    with pytest.raises(RuntimeError, match="failed") as refused:
        tasks.start_soon(Worker())
    assert isinstance(refused.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="the probe broke"):
        await tasks.aclose()
    await tasks.aclose()  # raised once; closing again is quiet


async def test_several_failures_at_once_are_raised_together() -> None:
    go = anyio.Event()

    async def fails(message: str) -> None:
        await go.wait()
        raise ValueError(message)

    tasks = BackgroundTasks("test")
    await tasks.open()
    tasks.start_soon(fails, "a")
    tasks.start_soon(fails, "b")
    await anyio.wait_all_tasks_blocked()
    go.set()  # both wake in the same round: neither is cancelled before it raises
    with pytest.raises(ExceptionGroup) as raised:
        await tasks.aclose()
    assert sorted(str(e) for e in raised.value.exceptions) == ["a", "b"]


async def test_a_task_started_just_before_close_runs_before_it_is_cancelled() -> None:
    ran: list[str] = []

    async def bookkeeping() -> None:
        ran.append("begun")
        try:
            await anyio.sleep_forever()
        finally:
            ran.append("settled")

    tasks = BackgroundTasks("test")
    await tasks.open()
    tasks.start_soon(bookkeeping)
    await tasks.aclose()  # no checkpoint between the start and the close
    assert ran == ["begun", "settled"]


async def test_held_resources_stay_entered_until_close_and_exit_normally_shielded() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def resource(name: str) -> AsyncIterator[str]:
        events.append(f"enter {name}")
        try:
            yield name
        except BaseException as exc:  # the exit must be a normal one
            events.append(f"exit {name} by {type(exc).__name__}")
            raise
        await anyio.lowlevel.checkpoint()  # an exit that awaits: shielded from the cancel
        events.append(f"exit {name}")

    tasks = BackgroundTasks("test")
    await tasks.open()
    assert await tasks.hold(resource("pool")) == "pool"
    assert events == ["enter pool"]
    await tasks.aclose()
    assert events == ["enter pool", "exit pool"]


async def test_what_entering_raises_is_raised_by_hold_and_the_group_goes_on() -> None:
    @contextlib.asynccontextmanager
    async def broken() -> AsyncIterator[None]:
        raise LookupError("no such pool file")
        yield

    worker = Worker()
    tasks = BackgroundTasks("test")
    async with tasks:
        tasks.start_soon(worker)
        with pytest.raises(LookupError, match="no such pool file"):
            await tasks.hold(broken())
        assert tasks.is_open()
        assert tasks.failure() is None
        await worker.started.wait()
        assert not worker.ended.is_set()
    assert worker.ended.is_set()


async def test_a_failing_exit_of_a_held_resource_is_raised_by_close() -> None:
    @contextlib.asynccontextmanager
    async def fails_to_close() -> AsyncIterator[None]:
        yield
        raise OSError("could not remove the workspace")

    tasks = BackgroundTasks("test")
    await tasks.open()
    await tasks.hold(fails_to_close())
    with pytest.raises(OSError, match="workspace"):
        await tasks.aclose()


async def test_opened_in_one_task_closed_in_another() -> None:
    worker = Worker()
    tasks = BackgroundTasks("test")
    opened = anyio.Event()

    async def opener() -> None:
        await tasks.open()
        tasks.start_soon(worker)
        opened.set()  # and this task ends, the group lives on

    async with anyio.create_task_group() as group:
        group.start_soon(opener)
    await opened.wait()
    await worker.started.wait()
    assert tasks.is_open()
    async with anyio.create_task_group() as group:
        group.start_soon(tasks.aclose)
    assert worker.ended.is_set()
    assert tasks.is_closed()
