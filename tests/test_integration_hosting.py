"""The trainer adapters' tools, opened once on the loop that uses them (integrations/_hosting.py).

HostedTools and PerLoop with a scripted opener (states: entries, exits, gates);
open_tools with the real local pool. No sleeps, no elapsed time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry, load_pool
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import RolloutError
from agent_backend.integrations._hosting import HostedTools, PerLoop, open_tools

pytestmark = pytest.mark.timeout(60)


class Opener:
    """Opens a stand-in for a dispatcher; counts entries and exits; can be gated or failed."""

    def __init__(self) -> None:
        self.entered = 0
        self.exited = 0
        self.gate: anyio.Event | None = None
        self.waiting = 0
        self.fail: list[Exception] = []
        self.fail_on_exit: Exception | None = None

    @contextlib.asynccontextmanager
    async def __call__(self, key: object = "tools") -> AsyncIterator[Any]:
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        if self.fail:
            raise self.fail.pop(0)
        self.entered += 1
        try:
            yield f"{key} #{self.entered}"
        finally:
            self.exited += 1
        if self.fail_on_exit is not None:
            raise self.fail_on_exit


@pytest.mark.anyio
async def test_the_first_call_opens_for_every_caller_in_a_task_closed_from_another() -> None:
    opener = Opener()
    opener.gate = anyio.Event()
    hosted = HostedTools(opener, what="the test generator")
    got: list[Any] = []

    async def call() -> None:
        got.append(await hosted.dispatcher())

    async with anyio.create_task_group() as callers:
        for _ in range(4):
            callers.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert opener.waiting == 1  # one opening; the other calls wait for it
        opener.gate.set()
    assert got == ["tools #1"] * 4
    assert (opener.entered, opener.exited) == (1, 0)  # held open after its callers ended
    async with anyio.create_task_group() as closer:
        closer.start_soon(hosted.aclose)
    assert (opener.entered, opener.exited) == (1, 1)
    assert repr(hosted) == "<HostedTools the test generator closed>"
    with pytest.raises(RolloutError, match="the test generator is closed"):
        await hosted.dispatcher()
    await hosted.aclose()  # idempotent
    assert opener.exited == 1


@pytest.mark.anyio
async def test_a_failed_opening_is_shared_by_its_waiters_and_the_next_call_tries_again() -> None:
    opener = Opener()
    opener.gate = anyio.Event()
    opener.fail = [ConnectionError("the pool did not start")]
    hosted = HostedTools(opener, what="the test generator")
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await hosted.dispatcher()
        except ConnectionError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as callers:
        callers.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert opener.waiting == 1  # the opening is under way
        for _ in range(2):
            callers.start_soon(call)  # these come while it is
        await anyio.wait_all_tasks_blocked()
        opener.gate.set()
    assert [str(e) for e in errors] == ["the pool did not start"] * 3
    assert opener.waiting == 1  # one attempt, its outcome shared
    assert await hosted.dispatcher() == "tools #1"  # a later call tries again
    await hosted.aclose()
    assert (opener.entered, opener.exited) == (1, 1)


@pytest.mark.anyio
async def test_closing_during_an_opening_waits_for_it_and_closes_what_it_opened() -> None:
    opener = Opener()
    opener.gate = anyio.Event()
    hosted = HostedTools(opener, what="the test generator")
    closed = anyio.Event()

    async def close() -> None:
        await hosted.aclose()
        closed.set()

    async with anyio.create_task_group() as group:
        group.start_soon(hosted.dispatcher)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        assert not closed.is_set()
        opener.gate.set()
    assert closed.is_set()
    assert (opener.entered, opener.exited) == (1, 1)


@pytest.mark.anyio
async def test_what_closing_raises_is_raised_by_aclose() -> None:
    opener = Opener()
    opener.fail_on_exit = OSError("a workspace could not be removed")
    hosted = HostedTools(opener, what="the test generator")
    await hosted.dispatcher()
    with pytest.raises(OSError, match="workspace"):
        await hosted.aclose()
    assert opener.exited == 1


@pytest.mark.anyio
async def test_per_loop_opens_once_per_key_and_anew_after_close() -> None:
    opener = Opener()
    hosts = PerLoop(opener)
    assert await hosts.dispatcher("a") == "a #1"
    assert await hosts.dispatcher("a") == "a #1"
    assert await hosts.dispatcher("b") == "b #2"
    await hosts.aclose()
    assert (opener.entered, opener.exited) == (2, 2)
    assert await hosts.dispatcher("a") == "a #3"
    await hosts.aclose()
    await hosts.aclose()  # nothing left in this loop
    assert opener.exited == 3


def test_per_loop_each_loop_opens_its_own_and_the_end_of_the_loop_closes_it() -> None:
    opener = Opener()
    hosts = PerLoop(opener)

    async def use() -> Any:
        return await hosts.dispatcher("a")

    # asyncio.run cancels the tasks left at the end of its loop: the holder exits its tools.
    assert asyncio.run(use()) == "a #1"
    assert (opener.entered, opener.exited) == (1, 1)
    assert asyncio.run(use()) == "a #2"
    assert (opener.entered, opener.exited) == (2, 2)


class Policy:
    """A policy that holds connections: an async context manager."""

    def __init__(self) -> None:
        self.state = "new"

    async def __aenter__(self) -> Policy:
        self.state = "open"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.state = "closed"


@pytest.mark.anyio
async def test_open_tools_opens_and_closes_only_what_was_not_open(tmp_path: Path) -> None:
    config = DEFAULT_POOL.model_copy(
        update={"workspace_root": str(tmp_path / "ws"), "kill_grace": 0.5}
    )
    # Tools and a pool: both opened here, and closed; with the policy's connections.
    policy = Policy()
    async with open_tools(pool=config, policy=policy) as made:
        assert made.statistics().state == "open"
        assert policy.state == "open"
        assert "exec" in {tool.name for tool in made.registry}
    assert made.statistics().state == "closed"
    assert policy.state == "closed"
    # A dispatcher not yet opened: opened with its pool, and closed.
    unopened = Dispatcher(ToolRegistry(builtin_tools()), load_pool(config))
    async with open_tools(dispatcher=unopened) as same:
        assert same is unopened
        assert unopened.statistics().state == "open"
    assert unopened.statistics().state == "closed"
    with pytest.raises(ValueError, match="closed"):
        async with open_tools(dispatcher=unopened):
            pass
    # An open one stays the caller's.
    async with (
        load_pool(config) as backend,
        Dispatcher(ToolRegistry(builtin_tools()), backend) as theirs,
    ):
        async with open_tools(dispatcher=theirs) as same:
            assert same is theirs
        assert theirs.statistics().state == "open"
