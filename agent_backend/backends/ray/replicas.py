"""The replicas of a pool of Ray actors: which actor serves each, and their faults.

:class:`ActorSet` holds the current actor of every replica and the ones it
replaced, and runs their faults: an actor whose death sentinel fails (or
that its owner saw die) is evicted once, killed, and replaced at most
``max_restarts`` times per replica, in the owner's background tasks. Nodes are
failure domains: an actor that died with its node takes every actor of the
pool on that node with it at once, and an actor Ray reports *unavailable*
(its connection lost, its node not yet known dead) takes its node's actors
out of rotation until a probe pinned to that node says whether the node
lives (then each actor is asked in turn) or died (then all are evicted),
within ``unavailable_timeout``. Only the real death of a running actor
spends a restart: a replacement that could not be placed or died while
starting (a node lost before Ray marked it dead) is tried again, away from
the nodes known dead, with a growing pause. Its owner
(:class:`~agent_backend.backends.ray.supervisor.ActorSupervisor`) says how to
spawn an actor, what "ready" means, and what to do when the set changes.

State changes here are synchronous and do no I/O; killing, waiting and
spawning happen after, in tasks. This module must never pick an actor that
is not live, never start a task outside the owner's background tasks, and never
let a Ray exception out of a task.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Final, Generic, Literal, TypeVar

import anyio
import anyio.to_thread
import ray

from agent_backend.backends.ray.runtime import (
    describe_cause,
    kill_actors,
    node_died,
    probe_node,
    remove_placement_groups,
)
from agent_backend.errors import AgentBackendError, ConfigError
from agent_backend.lifecycle import BackgroundTasks

__all__ = ["ActorSet", "ActorState", "Replica"]

ActorState = Literal["starting", "live", "unavailable", "dead"]

#: Seconds :meth:`ActorSet.stop` waits for Ray to report the killed actors dead.
_STOP_WAIT: Final = 10.0
#: Longest pause, in seconds, between failed starts of a replica's replacement.
_MAX_BACKOFF: Final = 5.0
#: Seconds between questions to an actor Ray still reports unavailable while its node lives.
_ASK_PAUSE: Final = 0.5


@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class Replica:
    """One actor of a replica, as :class:`ActorSet` tracks it; owners subclass it with their
    own fields (the Ray tool pool's actors, the rollout workers)."""

    index: int
    """The replica it serves."""
    generation: int
    """0 for the replica's first actor, then one more per replacement."""
    name: str
    """As errors and records name it."""
    ray_name: str
    """Its name in Ray (unique per pool instance)."""
    handle: Any
    sentinel: Any = None
    """A never-ending call on the actor: it fails the moment the actor dies."""
    state: ActorState = "starting"
    in_flight: int = 0
    served: int = 0
    cause: str | None = None
    node_id: str | None = None
    """The Ray node it runs on, once it has started (from what ``await_ready`` returned)."""
    placement_group: Any = None
    """Its own placement group (``bundles``), removed when it is retired."""


A = TypeVar("A", bound=Replica)

#: What :meth:`ActorSet.start`'s and the replacements' ``spawn`` take: the replica, the
#: generation, and the nodes to keep away from (known dead, or out while Ray decides).
Spawn = Callable[[int, int, frozenset[str]], A]


class ActorSet(Generic[A]):
    """The actors of ``replicas`` replicas: current ones in :attr:`entries`, replaced ones in
    :attr:`retired`, and a restart budget of ``max_restarts`` per replica.

    ``spawn(index, generation, avoid)`` creates a replica's actor (``starting``,
    no I/O awaited) on a node not in ``avoid``; ``await_ready(actor)`` waits
    until it serves, raising an :class:`~agent_backend.errors.AgentBackendError`
    when it never will (its result may name the actor's ``node_id``);
    ``changed()`` is called (synchronously) whenever an actor changes state.
    ``closed_cause`` is what :meth:`stop` records as the cause of the actors it kills;
    ``probe(node_id)`` says whether a node lives (None) or why not
    (:func:`~agent_backend.backends.ray.runtime.probe_node`).
    """

    def __init__(
        self,
        *,
        replicas: int,
        max_restarts: int,
        max_concurrency: int,
        spawn: Spawn[A],
        await_ready: Callable[[A], Awaitable[Any]],
        changed: Callable[[], None],
        closed_cause: str,
        unavailable_timeout: float = 30.0,
        probe: Callable[[str], Awaitable[str | None]] = probe_node,
    ) -> None:
        self._replicas = replicas
        self._max_restarts = max_restarts
        self._max_concurrency = max_concurrency
        self._spawn = spawn
        self._await_ready = await_ready
        self._changed = changed
        self._closed_cause = closed_cause
        self._unavailable_timeout = unavailable_timeout
        self._probe = probe
        self._tasks: BackgroundTasks | None = None
        self.entries: list[A] = []
        """The current actor of each replica (index = replica)."""
        self.retired: list[A] = []
        """Actors replaced by a newer generation, oldest first."""
        self.restarts = [0] * replicas
        """Real deaths replaced, per replica (what ``max_restarts`` bounds)."""
        self._generations = [0] * replicas
        self.evictions = 0
        self.replacements = 0
        self.dead_nodes: set[str] = set()
        """Nodes known dead: no replacement goes there."""
        self.judged_nodes: set[str] = set()
        """Nodes out of rotation while a probe finds out whether they live."""

    # -- introspection ---------------------------------------------------------------------------

    def everyone(self) -> list[A]:
        """Every actor started so far: replaced ones, then the current ones."""
        return [*self.retired, *self.entries]

    def states(self) -> collections.Counter[ActorState]:
        return collections.Counter(entry.state for entry in self.entries)

    def in_flight(self) -> int:
        return sum(entry.in_flight for entry in self.entries)

    def live(self) -> int:
        return sum(entry.state == "live" for entry in self.entries)

    def causes(self) -> str:
        """``NAME: cause; ...`` of the current actors that died, for an error message."""
        return "; ".join(f"{entry.name}: {entry.cause}" for entry in self.entries if entry.cause)

    def avoided(self) -> frozenset[str]:
        """Nodes a new actor must not go to now."""
        return frozenset(self.dead_nodes | self.judged_nodes)

    # -- routing (sync) --------------------------------------------------------------------------

    def pick(self) -> A | None:
        """The least-loaded live actor with a free slot (fewest served breaks ties)."""
        limit = self._max_concurrency
        free = [e for e in self.entries if e.state == "live" and e.in_flight < limit]
        return min(free, key=lambda e: (e.in_flight, e.served)) if free else None

    def exhausted(self) -> bool:
        """No actor is live, starting or unavailable, and no replica may be replaced any more."""
        return all(entry.state == "dead" for entry in self.entries) and not any(
            self.restarts[entry.index] < self._max_restarts for entry in self.entries
        )

    def evict(self, entry: A, cause: str) -> None:
        """Mark ``entry`` dead (once) and, while the owner's background tasks are open, schedule its
        retirement and (budget allowing) its replacement. A death that names the actor's node
        as dead evicts every actor of the set on that node too."""
        if entry.state == "dead":
            return
        if entry.node_id is not None and node_died(cause):
            self.lose_node(entry.node_id, cause)
            return
        self._evict_one(entry, cause)

    def _evict_one(self, entry: A, cause: str) -> None:
        if entry.state == "dead":
            return
        running = entry.state in ("live", "unavailable")
        entry.state, entry.cause = "dead", cause
        self.evictions += 1
        tasks = self._tasks
        if tasks is not None and tasks.is_open():
            # Only the real death of a running actor spends a restart.
            replace = running and self.restarts[entry.index] < self._max_restarts
            if replace:
                self.restarts[entry.index] += 1
                self.replacements += 1
            tasks.start_soon(self._retire, entry, replace)
        self._changed()

    def lose_node(self, node_id: str, cause: str) -> None:
        """``node_id`` died: evict every current actor on it at once; keep replacements away."""
        self.dead_nodes.add(node_id)
        self.judged_nodes.discard(node_id)
        for entry in list(self.entries):
            if entry.node_id == node_id and entry.state != "dead":
                self._evict_one(entry, cause)
        self._changed()

    def suspect(self, entry: A, cause: str) -> None:
        """Ray reports ``entry`` unavailable (connection lost): take its node's actors out of
        rotation and find out, bounded, whether the node (and then each actor) lives."""
        if entry.state != "live":
            return  # already judged, dead, or not serving yet
        node = entry.node_id
        if node is not None and node in self.dead_nodes:
            self.lose_node(node, cause)
            return
        suspects = [e for e in self.entries if node is not None and e.node_id == node]
        suspects = [e for e in suspects if e.state == "live"] or [entry]
        for each in suspects:
            each.state = "unavailable"
        entry.cause = cause
        if node is None or node not in self.judged_nodes:
            if node is not None:
                self.judged_nodes.add(node)
            self._start_judging(node, suspects)
        self._changed()

    def _start_judging(self, node: str | None, suspects: list[A]) -> None:
        tasks = self._tasks
        if tasks is not None and tasks.is_open():
            tasks.start_soon(self._judge, node, suspects)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, tasks: BackgroundTasks) -> list[Any]:
        """Spawn every replica's first actor, wait until all are ready, mark them live and watch
        them in ``tasks``; what ``await_ready`` returned for each, in replica order.

        The first failure is raised; the actors stay in :attr:`entries` for :meth:`stop`.
        """
        self.entries = [self._spawn(index, 0, frozenset()) for index in range(self._replicas)]
        results: list[Any] = [None] * self._replicas
        failures: list[AgentBackendError] = []

        async def ready(entry: A) -> None:
            try:
                results[entry.index] = await self._ready(entry)
            except AgentBackendError as exc:
                failures.append(exc)

        async with anyio.create_task_group() as group:
            for entry in self.entries:
                group.start_soon(ready, entry)
        if failures:
            raise failures[0]
        self._tasks = tasks
        for entry in self.entries:
            entry.state = "live"
            tasks.start_soon(self._watch, entry)
        return results

    async def _ready(self, entry: A) -> Any:
        result = await self._await_ready(entry)
        if isinstance(result, dict) and isinstance(result.get("node_id"), str):
            entry.node_id = result["node_id"]
        return result

    async def stop(self) -> None:
        """Mark every actor dead, kill them all and wait (bounded) until Ray reports each dead.

        Meant for the owner's ``aclose()``, shielded, after its background tasks have ended.
        """
        everyone = self.everyone()
        for entry in everyone:
            if entry.state != "dead":
                entry.state, entry.cause = "dead", self._closed_cause
        if not everyone or not ray.is_initialized():
            return
        await anyio.to_thread.run_sync(kill_actors, [entry.handle for entry in everyone])
        with anyio.move_on_after(_STOP_WAIT):
            for entry in everyone:
                with contextlib.suppress(Exception):
                    await entry.sentinel
        groups = [entry.placement_group for entry in everyone if entry.placement_group is not None]
        if groups:
            await anyio.to_thread.run_sync(remove_placement_groups, groups)

    # -- faults ----------------------------------------------------------------------------------

    async def _watch(self, entry: A) -> None:
        try:
            await entry.sentinel
        except ray.exceptions.ActorUnavailableError as exc:
            self.suspect(entry, describe_cause(exc))
        except Exception as exc:
            self.evict(entry, describe_cause(exc))

    async def _judge(self, node: str | None, suspects: list[A]) -> None:
        """Decide, within ``unavailable_timeout``, whether ``node`` and its ``suspects`` live."""
        verdict: str | None = None  # None: the node lives (or is not known)
        with anyio.move_on_after(self._unavailable_timeout):
            if node is not None:
                verdict = await self._probe(node)
                self.judged_nodes.discard(node)  # known alive or dead now
            if verdict is None:
                async with anyio.create_task_group() as group:
                    for entry in suspects:
                        group.start_soon(self._ask, entry)
        if node is not None:
            self.judged_nodes.discard(node)
        if verdict is not None and node is not None:
            self.lose_node(node, verdict)
            return
        for entry in suspects:
            if entry.state == "unavailable":
                self._evict_one(
                    entry, f"unavailable for {self._unavailable_timeout:g}s: {entry.cause}"
                )
        self._changed()

    async def _ask(self, entry: A) -> None:
        """``entry``'s node lives: the actor is back (live, watched again) or dead (evicted);
        asked again while Ray still reports it unavailable (the judge's timeout bounds it)."""
        while entry.state == "unavailable":
            try:
                await entry.handle.describe.remote()
            except ray.exceptions.ActorUnavailableError:
                await anyio.sleep(_ASK_PAUSE)
                continue
            except Exception as exc:
                self.evict(entry, describe_cause(exc))
                return
            entry.state, entry.cause = "live", None
            entry.sentinel = entry.handle.wait_closed.remote()
            assert self._tasks is not None
            self._tasks.start_soon(self._watch, entry)
            self._changed()

    async def _retire(self, entry: A, replace: bool) -> None:
        await anyio.to_thread.run_sync(kill_actors, [entry.handle])
        if entry.placement_group is not None:
            await anyio.to_thread.run_sync(remove_placement_groups, [entry.placement_group])
        index = entry.index
        attempt = 0
        while replace:
            attempt += 1
            self._generations[index] += 1
            new = self._spawn(index, self._generations[index], self.avoided())
            self.retired.append(self.entries[index])
            self.entries[index] = new
            self._changed()
            try:
                await self._ready(new)
            except AgentBackendError as exc:
                new.state, new.cause = "dead", str(exc)
                await anyio.to_thread.run_sync(kill_actors, [new.handle])
                if new.placement_group is not None:
                    await anyio.to_thread.run_sync(remove_placement_groups, [new.placement_group])
                self._changed()
                if isinstance(exc, ConfigError):
                    # Its code or runtime_env cannot load there: a real failure, not a race.
                    if self.restarts[index] >= self._max_restarts:
                        break
                    self.restarts[index] += 1
                # Not placed in time, or died while starting (its node lost before Ray
                # marked it dead): try again, away from the nodes known dead, at no cost.
                await anyio.sleep(min(0.5 * attempt, _MAX_BACKOFF))
                continue
            if new.node_id in self.dead_nodes:  # placed on a node that died meanwhile
                new.state, new.cause = "dead", "its node died while it started"
                await anyio.to_thread.run_sync(kill_actors, [new.handle])
                self._changed()
                continue
            new.state = "live"
            assert self._tasks is not None
            self._tasks.start_soon(self._watch, new)
            self._changed()
            return
        self._changed()
