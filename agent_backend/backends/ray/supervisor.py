"""One supervisor of a pool of Ray actors: shared by the Ray tool pool and the rollout workers.

:class:`ActorSet` holds the current actor of every replica and the ones it
replaced, and runs their faults: an actor whose death sentinel fails (or
that its owner saw die) is evicted once, killed, and replaced at most
``max_restarts`` times per replica, with a growing pause between failed
starts, in the owner's task group.

:class:`ActorSupervisor` is the base of both pools of actors
(:class:`~agent_backend.backends.ray.RayBackend`,
:class:`~agent_backend.rollout.ray_workers.RayRolloutWorkers`): the
lifecycle (``start()`` connects to Ray and waits for every actor;
``aclose()`` is idempotent, shielded, and releases everything even when
cancelled), a FIFO queue of callers waiting for a free slot, and the one way
they wait: on the queue, which every change of an actor's state or slots
serves (in order) or fails (the pool closed, every actor dead and out of
restarts). A subclass says how to spawn an actor and what "ready" means,
and keeps its own counters and the errors of its calls.

State changes here are synchronous and do no I/O; killing, waiting and
spawning happen after, in tasks. This module must never pick an actor that
is not live, never start a task outside the owner's task group, never leave
a waiter queued once it was cancelled, and never let a Ray exception out of
a task.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Final, Generic, Literal, Self, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import ray

from agent_backend.backends.ray.config import RayPoolConfig
from agent_backend.backends.ray.runtime import CONNECTION, connect, describe_cause, kill_actors
from agent_backend.errors import AgentBackendError, BackendUnavailable, PoolClosed, PoolError
from agent_backend.lifecycle import AsyncResource

__all__ = ["ActorSet", "ActorState", "ActorSupervisor", "Replica"]

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


@dataclasses.dataclass(eq=False, slots=True)
class _Waiter(Generic[A]):
    event: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    actor: A | None = None
    error: AgentBackendError | None = None


class ActorSupervisor(AsyncResource, Generic[A]):
    """A started pool of ``config.replicas`` Ray actors, their faults and a FIFO of waiters.

    Subclasses implement :meth:`_spawn` (create a replica's actor, no I/O
    awaited) and :meth:`_await_ready` (wait until it serves, raising an
    :class:`~agent_backend.errors.AgentBackendError` when it never will), and
    may hook :meth:`_prepare` (after connecting, before any actor),
    :meth:`_started` (with what each first actor's ``_await_ready`` returned)
    and :meth:`_wind_down` (at close, shielded, before the actors are killed).
    Calls take a slot with :meth:`_acquire` and give it back with
    :meth:`_release` (or :meth:`_release_when_done`); an actor seen dead is
    :meth:`_evict`-ed. ``subject`` names the pool in errors ("the Ray pool
    'x'"), ``actor_noun`` one of its actors ("actor").
    """

    def __init__(
        self,
        config: RayPoolConfig,
        *,
        subject: str,
        plural: bool = False,
        actor_noun: str,
        closed_cause: str,
    ) -> None:
        self.config = config
        self._subject = subject
        self._is = "are" if plural else "is"
        self._actor_noun = actor_noun
        self._state: Literal["new", "starting", "open", "closing", "closed"] = "new"
        self._done = anyio.Event()
        self._owns_ray = False
        self._stack = contextlib.AsyncExitStack()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._actors = ActorSet[A](
            replicas=config.replicas,
            max_restarts=config.max_restarts,
            max_concurrency=config.max_concurrency,
            spawn=self._spawn,
            await_ready=self._await_ready,
            changed=self._dispatch_waiters,
            closed_cause=closed_cause,
        )
        self._waiters: collections.deque[_Waiter[A]] = collections.deque()

    # -- what a subclass says ----------------------------------------------------------------------

    @abc.abstractmethod
    def _spawn(self, index: int, generation: int) -> A: ...

    @abc.abstractmethod
    async def _await_ready(self, actor: A) -> Any: ...

    async def _prepare(self) -> None:
        """After connecting to Ray, before any actor is spawned (e.g. check the cluster)."""

    def _started(self, described: list[Any]) -> None:
        """Every first actor is ready: ``described`` is what each ``_await_ready`` returned."""

    async def _wind_down(self) -> None:
        """At close, shielded, before the actors are killed (e.g. let them close cleanly)."""

    def _started_twice(self) -> AgentBackendError:
        return PoolError(f"{self._subject} was already started")

    # -- lifecycle ---------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    def is_closed(self) -> bool:
        return self._state in ("closing", "closed")

    async def start(self) -> None:
        """Connect to Ray (or start a local one) and start every actor; wait until they serve.

        A failed start leaves no actor, task or Ray connection behind, under
        ``async with`` or not.
        """
        if self._state != "new":
            raise self._started_twice()
        self._state = "starting"
        try:
            await anyio.to_thread.run_sync(self._connect)
            await self._prepare()
            self._tasks = await self._stack.enter_async_context(anyio.create_task_group())
            self._started(await self._actors.start(self._tasks))
        except BaseException:
            await self.aclose()
            raise
        self._state = "open"

    def _connect(self) -> None:
        """Join or start Ray, or use this process's connection (blocking: a worker thread)."""
        self._owns_ray = connect(self.config)

    async def aclose(self) -> None:
        """Fail the waiters, stop the background tasks, kill the actors; idempotent."""
        if self._state == "closed":
            return
        if self._state == "closing":
            await self._done.wait()
            return
        self._state = "closing"
        try:
            self._fail_waiters(self._closed_error())
            if self._tasks is not None:
                self._tasks.cancel_scope.cancel()
            # Exited here, not under the shield below: a task group's scope must be the
            # innermost one when it exits. Its tasks are cancelled, so this is quick.
            await self._stack.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._wind_down()
                    await self._actors.stop()
                    if self._owns_ray:
                        self._owns_ray = False
                        await anyio.to_thread.run_sync(CONNECTION.close)
                finally:
                    self._state = "closed"
                    self._done.set()

    # -- routing (sync but for the wait in _acquire) ------------------------------------------------

    def _closed_error(self) -> PoolClosed:
        return PoolClosed(f"{self._subject} {self._is} closed")

    def _check_open(self) -> None:
        if self._state == "open":
            return
        if self._state in ("closing", "closed"):
            raise self._closed_error()
        raise PoolError(f"{self._subject} {self._is} not started: use `async with`")

    def _exhausted_error(self) -> BackendUnavailable:
        return BackendUnavailable(
            f"every {self._actor_noun} of pool {self.config.name!r} is dead and out of restarts "
            f"(max_restarts={self.config.max_restarts}): {self._actors.causes()}",
            backend="ray",
        )

    async def _acquire(self) -> A:
        """A slot on the least-loaded live actor, at once or in FIFO order once one frees up."""
        self._check_open()
        if not self._waiters:
            actor = self._actors.pick()
            if actor is not None:
                actor.in_flight += 1
                return actor
        if self._actors.exhausted():
            raise self._exhausted_error()
        waiter = _Waiter[A]()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if waiter.actor is not None:
                self._release(waiter.actor)
            raise
        if waiter.error is not None:
            raise waiter.error
        assert waiter.actor is not None
        return waiter.actor

    def _release(self, actor: A) -> None:
        actor.in_flight -= 1
        self._dispatch_waiters()

    def _release_when_done(self, actor: A, ref: Any) -> None:
        """Give ``actor``'s slot back once the Ray task behind ``ref`` really ended (it was
        cancelled: the actor may still be running it)."""
        if self._tasks is not None and self._state == "open":
            self._tasks.start_soon(self._settle, actor, ref)
        else:
            self._release(actor)

    async def _settle(self, actor: A, ref: Any) -> None:
        try:
            with contextlib.suppress(Exception):
                await ref
        finally:
            self._release(actor)

    def _evict(self, actor: A, cause: str) -> None:
        self._actors.evict(actor, cause)

    def _dispatch_waiters(self) -> None:
        """Hand free slots to queued callers in FIFO order, or fail them all when no actor will
        ever serve again (sync: no I/O here)."""
        while self._waiters:
            actor = self._actors.pick()
            if actor is None:
                if self._actors.exhausted():
                    self._fail_waiters(self._exhausted_error())
                return
            waiter = self._waiters.popleft()
            actor.in_flight += 1
            waiter.actor = actor
            waiter.event.set()

    def _fail_waiters(self, error: AgentBackendError) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.error = error
            waiter.event.set()
