"""ActorSet's replica state machine, with fake actors: no Ray (killing a fake is a no-op)."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator
from typing import Any, Literal

import anyio
import anyio.abc
import pytest

from agent_backend.backends.ray.replicas import ActorSet
from agent_backend.errors import BackendUnavailable

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture(autouse=True)
def _ray_left_as_it_was() -> Iterator[None]:
    """Killing a fake must not connect this process to Ray (ray.kill would start one)."""
    import ray

    before = ray.is_initialized()
    yield
    assert ray.is_initialized() == before


class _Sentinel:
    """Awaitable like a Ray ObjectRef of a never-ending call: fails once the actor "dies"."""

    def __init__(self) -> None:
        self.died = anyio.Event()

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        await self.died.wait()
        raise RuntimeError("the actor died")


@dataclasses.dataclass(eq=False)
class _Entry:
    index: int
    generation: int
    name: str
    handle: Any = None
    sentinel: _Sentinel = dataclasses.field(default_factory=_Sentinel)
    state: Literal["starting", "live", "dead"] = "starting"
    in_flight: int = 0
    served: int = 0
    cause: str | None = None


class _Harness:
    def __init__(self, *, replicas: int, max_restarts: int, max_concurrency: int = 2) -> None:
        self.spawned: list[_Entry] = []
        self.broken: set[tuple[int, int]] = set()
        """(replica, generation) pairs whose actor never gets ready."""
        self._changed = anyio.Event()
        self.actors = ActorSet[_Entry](
            replicas=replicas,
            max_restarts=max_restarts,
            max_concurrency=max_concurrency,
            spawn=self.spawn,
            await_ready=self.await_ready,
            changed=self.changed,
            closed_cause="closed",
        )

    def spawn(self, index: int, generation: int) -> _Entry:
        entry = _Entry(index, generation, f"p-{index}.{generation}")
        self.spawned.append(entry)
        return entry

    async def await_ready(self, entry: _Entry) -> str:
        await anyio.lowlevel.checkpoint()
        if (entry.index, entry.generation) in self.broken:
            raise BackendUnavailable(f"{entry.name} did not start", backend="ray")
        return entry.name

    def changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def settle(self, predicate: Any) -> None:
        with anyio.fail_after(10):
            while not predicate():
                await self._changed.wait()


async def test_start_returns_each_ready_result_in_replica_order() -> None:
    h = _Harness(replicas=3, max_restarts=1)
    async with anyio.create_task_group() as tasks:
        assert await h.actors.start(tasks) == ["p-0.0", "p-1.0", "p-2.0"]
        assert h.actors.states() == {"live": 3}
        assert h.actors.live() == 3
        tasks.cancel_scope.cancel()


async def test_pick_is_least_loaded_then_least_served_and_never_full_or_dead() -> None:
    h = _Harness(replicas=3, max_restarts=0, max_concurrency=1)
    async with anyio.create_task_group() as tasks:
        await h.actors.start(tasks)
        a, b, c = h.actors.entries
        a.served, b.served, c.served = 2, 0, 1
        assert h.actors.pick() is b
        b.in_flight = 1
        assert h.actors.pick() is c
        c.state = "dead"
        assert h.actors.pick() is a
        a.in_flight = 1
        assert h.actors.pick() is None
        tasks.cancel_scope.cancel()


async def test_a_dead_actor_is_evicted_once_and_replaced_with_the_next_generation() -> None:
    h = _Harness(replicas=2, max_restarts=2)
    async with anyio.create_task_group() as tasks:
        await h.actors.start(tasks)
        first = h.actors.entries[0]
        first.sentinel.died.set()
        await h.settle(
            lambda: h.actors.entries[0].state == "live" and h.actors.entries[0] is not first
        )
        h.actors.evict(first, "again")  # already dead: nothing happens
        assert (h.actors.evictions, h.actors.replacements) == (1, 1)
        assert first.cause == "RuntimeError: the actor died"
        assert [e.name for e in h.actors.entries] == ["p-0.1", "p-1.0"]
        assert h.actors.retired == [first]
        assert [e.name for e in h.actors.everyone()] == ["p-0.0", "p-0.1", "p-1.0"]
        tasks.cancel_scope.cancel()


async def test_failed_replacements_use_the_budget_then_the_set_is_exhausted() -> None:
    h = _Harness(replicas=1, max_restarts=2)
    h.broken = {(0, 1)}
    async with anyio.create_task_group() as tasks:
        await h.actors.start(tasks)
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.entries[0].generation == 2)
        await h.settle(lambda: h.actors.entries[0].state == "live")
        assert h.actors.replacements == 2
        assert h.spawned[1].state == "dead"
        assert h.spawned[1].cause == "p-0.1 did not start"
        assert not h.actors.exhausted()
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.exhausted())
        assert h.actors.replacements == 2
        assert h.actors.evictions == 2
        assert h.actors.causes() == "p-0.2: RuntimeError: the actor died"
        tasks.cancel_scope.cancel()


async def test_no_replacement_once_the_owner_task_group_is_cancelled() -> None:
    h = _Harness(replicas=1, max_restarts=3)
    async with anyio.create_task_group() as tasks:
        await h.actors.start(tasks)
        tasks.cancel_scope.cancel()
        h.actors.evict(h.actors.entries[0], "gone")
    assert h.actors.evictions == 1
    assert h.actors.replacements == 0
    assert [e.name for e in h.actors.everyone()] == ["p-0.0"]
