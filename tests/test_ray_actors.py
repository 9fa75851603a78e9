"""ActorSet's replica state machine, with fake actors: no Ray (killing a fake is a no-op)."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator
from typing import Any, Literal

import anyio
import pytest

from agent_backend.backends.ray.replicas import ActorSet
from agent_backend.errors import AgentBackendError, BackendUnavailable, ConfigError
from agent_backend.lifecycle import BackgroundTasks

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


class _Describe:
    """``handle.describe`` of a fake actor: ``.remote()`` answers, or raises what it is told."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def remote(self) -> Any:
        async def answer() -> str:
            await anyio.lowlevel.checkpoint()
            if self.error is not None:
                raise self.error
            return "described"

        return answer()


class _Handle:
    def __init__(self) -> None:
        self.describe = _Describe()
        self.wait_closed = self

    def remote(self) -> _Sentinel:  # wait_closed.remote(): a new sentinel
        return _Sentinel()


@dataclasses.dataclass(eq=False)
class _Entry:
    index: int
    generation: int
    name: str
    handle: Any = dataclasses.field(default_factory=_Handle)
    sentinel: _Sentinel = dataclasses.field(default_factory=_Sentinel)
    state: Literal["starting", "live", "unavailable", "dead"] = "starting"
    in_flight: int = 0
    served: int = 0
    cause: str | None = None
    node_id: str | None = None
    placement_group: Any = None
    avoid: frozenset[str] = frozenset()


class _Harness:
    def __init__(
        self,
        *,
        replicas: int,
        max_restarts: int,
        max_concurrency: int = 2,
        nodes: tuple[str, ...] = ("n1",),
    ) -> None:
        self.spawned: list[_Entry] = []
        self.broken: dict[tuple[int, int], AgentBackendError] = {}
        """(replica, generation) pairs whose actor never gets ready, and the error it raises."""
        self.nodes = nodes
        self.dead_nodes: set[str] = set()
        self.probes: list[str] = []
        self.probe_gate = anyio.Event()
        self.probe_gate.set()
        self._changed = anyio.Event()
        self.actors = ActorSet[_Entry](
            replicas=replicas,
            max_restarts=max_restarts,
            max_concurrency=max_concurrency,
            spawn=self.spawn,
            await_ready=self.await_ready,
            changed=self.changed,
            closed_cause="closed",
            unavailable_timeout=5,
            probe=self.probe,
        )

    def spawn(self, index: int, generation: int, avoid: frozenset[str]) -> _Entry:
        entry = _Entry(index, generation, f"p-{index}.{generation}", avoid=avoid)
        self.spawned.append(entry)
        return entry

    async def await_ready(self, entry: _Entry) -> dict[str, str]:
        await anyio.lowlevel.checkpoint()
        error = self.broken.get((entry.index, entry.generation))
        if error is not None:
            raise error
        # Round robin over the nodes not avoided, as a scheduler would.
        usable = [node for node in self.nodes if node not in entry.avoid]
        return {"name": entry.name, "node_id": usable[entry.index % len(usable)]}

    async def probe(self, node: str) -> str | None:
        self.probes.append(node)
        await self.probe_gate.wait()
        return "its node has died (test)" if node in self.dead_nodes else None

    def changed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def settle(self, predicate: Any) -> None:
        with anyio.fail_after(10):
            while not predicate():
                await self._changed.wait()


async def test_start_returns_each_ready_result_in_replica_order() -> None:
    h = _Harness(replicas=3, max_restarts=1)
    async with BackgroundTasks("test") as tasks:
        described = await h.actors.start(tasks)
        assert [d["name"] for d in described] == ["p-0.0", "p-1.0", "p-2.0"]
        assert all(e.node_id == "n1" for e in h.actors.entries)
        assert h.actors.states() == {"live": 3}
        assert h.actors.live() == 3


async def test_pick_is_least_loaded_then_least_served_and_never_full_or_dead() -> None:
    h = _Harness(replicas=3, max_restarts=0, max_concurrency=1)
    async with BackgroundTasks("test") as tasks:
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


async def test_a_dead_actor_is_evicted_once_and_replaced_with_the_next_generation() -> None:
    h = _Harness(replicas=2, max_restarts=2)
    async with BackgroundTasks("test") as tasks:
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


async def test_a_replacement_that_did_not_start_is_tried_again_at_no_cost() -> None:
    h = _Harness(replicas=1, max_restarts=2)
    h.broken = {(0, 1): BackendUnavailable("p-0.1 did not start", backend="ray")}
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.entries[0].generation == 2)
        await h.settle(lambda: h.actors.entries[0].state == "live")
        # One real death, one replica replaced: the start that failed spent nothing.
        assert (h.actors.restarts, h.actors.replacements) == ([1], 1)
        assert h.spawned[1].state == "dead"
        assert h.spawned[1].cause == "p-0.1 did not start"
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.entries[0].generation == 3)
        await h.settle(lambda: h.actors.entries[0].state == "live")
        assert not h.actors.exhausted()
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.exhausted())
        assert (h.actors.restarts, h.actors.replacements, h.actors.evictions) == ([2], 2, 3)
        assert h.actors.causes() == "p-0.3: RuntimeError: the actor died"


async def test_a_replacement_whose_code_cannot_load_spends_the_budget() -> None:
    h = _Harness(replicas=1, max_restarts=2)
    h.broken = {(0, 1): ConfigError("cannot import", key="tools.0.function")}
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        h.actors.entries[0].sentinel.died.set()
        await h.settle(lambda: h.actors.entries[0].generation == 2)
        await h.settle(lambda: h.actors.entries[0].state == "live")
        assert h.actors.restarts == [2]
        assert h.actors.entries[0].generation == 2


async def test_a_dead_node_evicts_all_its_actors_at_once_and_replacements_avoid_it() -> None:
    h = _Harness(replicas=4, max_restarts=1, nodes=("n1", "n2"))
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        on_n1 = [e for e in h.actors.entries if e.node_id == "n1"]
        assert len(on_n1) == 2
        # Its death says its node died; the sibling's sentinel has not fired yet.
        h.actors.evict(on_n1[0], "ActorDiedError: The actor died because its node has died.")
        assert all(e.state == "dead" for e in on_n1)
        assert h.actors.dead_nodes == {"n1"}
        await h.settle(lambda: h.actors.live() == 4)
        fresh = [h.actors.entries[e.index] for e in on_n1]
        assert all(e.avoid == frozenset({"n1"}) and e.node_id == "n2" for e in fresh)
        assert (h.actors.restarts.count(1), h.actors.replacements) == (2, 2)


async def test_unavailable_actors_leave_rotation_until_their_node_is_judged_alive() -> None:
    h = _Harness(replicas=3, max_restarts=1, nodes=("n1", "n2"))
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        on_n1 = [e for e in h.actors.entries if e.node_id == "n1"]
        on_n2 = [e for e in h.actors.entries if e.node_id == "n2"]
        h.probe_gate = anyio.Event()
        h.actors.suspect(on_n1[0], "ActorUnavailableError: temporarily unavailable")
        assert all(e.state == "unavailable" for e in on_n1)
        assert h.actors.pick() in on_n2  # calls go to the other node meanwhile
        assert h.actors.avoided() == {"n1"}
        h.probe_gate.set()
        await h.settle(lambda: all(e.state == "live" for e in on_n1))
        assert h.probes == ["n1"]
        assert (h.actors.evictions, h.actors.replacements) == (0, 0)
        assert h.actors.avoided() == frozenset()


async def test_unavailable_actors_whose_node_is_judged_dead_are_evicted_together() -> None:
    h = _Harness(replicas=3, max_restarts=1, nodes=("n1", "n2"))
    h.dead_nodes = {"n1"}
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        on_n1 = [e for e in h.actors.entries if e.node_id == "n1"]
        h.actors.suspect(on_n1[0], "ActorUnavailableError: temporarily unavailable")
        await h.settle(lambda: h.actors.live() == 3 and all(e.state == "dead" for e in on_n1))
        assert all("its node has died" in (e.cause or "") for e in on_n1)
        assert all(h.actors.entries[e.index].node_id == "n2" for e in on_n1)


async def test_an_actor_unavailable_past_the_timeout_is_declared_dead() -> None:
    h = _Harness(replicas=1, max_restarts=1)
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
        first = h.actors.entries[0]
        first.handle.describe.error = _unavailable()
        h.actors._unavailable_timeout = 0.2
        h.actors.suspect(first, "ActorUnavailableError: temporarily unavailable")
        await h.settle(lambda: first.state == "dead")
        assert (first.cause or "").startswith("unavailable for 0.2s")
        await h.settle(lambda: h.actors.live() == 1)
        assert h.actors.replacements == 1


def _unavailable() -> BaseException:
    import ray.exceptions

    return ray.exceptions.ActorUnavailableError("connection lost", None)


async def test_no_replacement_once_the_owners_background_tasks_closed() -> None:
    h = _Harness(replicas=1, max_restarts=3)
    async with BackgroundTasks("test") as tasks:
        await h.actors.start(tasks)
    h.actors.evict(h.actors.entries[0], "gone")
    assert (h.actors.evictions, h.actors.replacements) == (1, 0)
    assert h.actors.replacements == 0
    assert [e.name for e in h.actors.everyone()] == ["p-0.0"]
