"""The replicas of a pool of Ray actors: which actor serves each, and their faults.

:class:`ActorSet` holds the current actor of every replica and the ones it
replaced, and runs their faults: an actor whose death sentinel fails (or
that its owner saw die) is evicted once, killed, and replaced at most
``max_restarts`` times per replica, with a growing pause between failed
starts, in the owner's task group. Its owner
(:class:`~agent_backend.backends.ray.supervisor.ActorSupervisor`) says how to
spawn an actor, what "ready" means, and what to do when the set changes.

State changes here are synchronous and do no I/O; killing, waiting and
spawning happen after, in tasks. This module must never pick an actor that
is not live, never start a task outside the owner's task group, and never
let a Ray exception out of a task.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Final, Generic, Literal, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import ray

from agent_backend.backends.ray.runtime import describe_cause, kill_actors
from agent_backend.errors import AgentBackendError

__all__ = ["ActorSet", "ActorState", "Replica"]

ActorState = Literal["starting", "live", "dead"]

#: Seconds :meth:`ActorSet.stop` waits for Ray to report the killed actors dead.
_STOP_WAIT: Final = 10.0
#: Longest pause, in seconds, between failed starts of a replica's replacement.
_MAX_BACKOFF: Final = 5.0


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


A = TypeVar("A", bound=Replica)


class ActorSet(Generic[A]):
    """The actors of ``replicas`` replicas: current ones in :attr:`entries`, replaced ones in
    :attr:`retired`, and a restart budget of ``max_restarts`` per replica.

    ``spawn(index, generation)`` creates a replica's actor (``starting``, no
    I/O awaited); ``await_ready(actor)`` waits until it serves, raising an
    :class:`~agent_backend.errors.AgentBackendError` when it never will;
    ``changed()`` is called (synchronously) whenever an actor changes state.
    ``closed_cause`` is what :meth:`stop` records as the cause of the actors it kills.
    """

    def __init__(
        self,
        *,
        replicas: int,
        max_restarts: int,
        max_concurrency: int,
        spawn: Callable[[int, int], A],
        await_ready: Callable[[A], Awaitable[Any]],
        changed: Callable[[], None],
        closed_cause: str,
    ) -> None:
        self._replicas = replicas
        self._max_restarts = max_restarts
        self._max_concurrency = max_concurrency
        self._spawn = spawn
        self._await_ready = await_ready
        self._changed = changed
        self._closed_cause = closed_cause
        self._tasks: anyio.abc.TaskGroup | None = None
        self.entries: list[A] = []
        """The current actor of each replica (index = replica)."""
        self.retired: list[A] = []
        """Actors replaced by a newer generation, oldest first."""
        self.restarts = [0] * replicas
        """Replacements started, per replica."""
        self.evictions = 0
        self.replacements = 0

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

    # -- routing (sync) --------------------------------------------------------------------------

    def pick(self) -> A | None:
        """The least-loaded live actor with a free slot (fewest served breaks ties)."""
        limit = self._max_concurrency
        free = [e for e in self.entries if e.state == "live" and e.in_flight < limit]
        return min(free, key=lambda e: (e.in_flight, e.served)) if free else None

    def exhausted(self) -> bool:
        """No actor is live or starting, and no replica may be replaced any more."""
        return all(entry.state == "dead" for entry in self.entries) and not any(
            self.restarts[entry.index] < self._max_restarts for entry in self.entries
        )

    def evict(self, entry: A, cause: str) -> None:
        """Mark ``entry`` dead (once) and, while the owner's task group runs, schedule its
        retirement and (budget allowing) its replacement."""
        if entry.state == "dead":
            return
        entry.state, entry.cause = "dead", cause
        self.evictions += 1
        tasks = self._tasks
        if tasks is not None and not tasks.cancel_scope.cancel_called:
            replace = self.restarts[entry.index] < self._max_restarts
            tasks.start_soon(self._retire, entry, replace)
        self._changed()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self, tasks: anyio.abc.TaskGroup) -> list[Any]:
        """Spawn every replica's first actor, wait until all are ready, mark them live and watch
        them in ``tasks``; what ``await_ready`` returned for each, in replica order.

        The first failure is raised; the actors stay in :attr:`entries` for :meth:`stop`.
        """
        self.entries = [self._spawn(index, 0) for index in range(self._replicas)]
        results: list[Any] = [None] * self._replicas
        failures: list[AgentBackendError] = []

        async def ready(entry: A) -> None:
            try:
                results[entry.index] = await self._await_ready(entry)
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

    async def stop(self) -> None:
        """Mark every actor dead, kill them all and wait (bounded) until Ray reports each dead.

        Meant for the owner's ``aclose()``, shielded, after its task group has exited.
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

    # -- faults ----------------------------------------------------------------------------------

    async def _watch(self, entry: A) -> None:
        try:
            await entry.sentinel
        except Exception as exc:
            self.evict(entry, describe_cause(exc))

    async def _retire(self, entry: A, replace: bool) -> None:
        await anyio.to_thread.run_sync(kill_actors, [entry.handle])
        index = entry.index
        while replace and self.restarts[index] < self._max_restarts:
            self.restarts[index] += 1
            self.replacements += 1
            new = self._spawn(index, self.restarts[index])
            self.retired.append(self.entries[index])
            self.entries[index] = new
            self._changed()
            try:
                await self._await_ready(new)
            except AgentBackendError as exc:
                new.state, new.cause = "dead", str(exc)
                await anyio.to_thread.run_sync(kill_actors, [new.handle])
                self._changed()
                await anyio.sleep(min(0.5 * self.restarts[index], _MAX_BACKOFF))
                continue
            new.state = "live"
            assert self._tasks is not None
            self._tasks.start_soon(self._watch, new)
            self._changed()
            return
        self._changed()
