"""One supervisor of a pool of Ray actors: shared by the Ray tool pool and the rollout workers.

:class:`ActorSupervisor` is the base of both pools of actors
(:class:`~agent_backend.backends.ray.RayBackend`,
:class:`~agent_backend.rollout.ray_workers.RayRolloutWorkers`): the
lifecycle (``start()`` connects to Ray and waits for every actor;
``aclose()`` is idempotent, shielded, and releases everything even when
cancelled), a FIFO queue of callers waiting for a free slot, and the one way
to wait on the pool's state: :meth:`ActorSupervisor.wait_until`, woken at
every change of an actor's state, of a slot or of the queue. The replicas
and their faults are :class:`~agent_backend.backends.ray.replicas.ActorSet`'s.
A subclass says how to spawn an actor and what "ready" means, and keeps its
own counters and the errors of its calls.

This module must never hand a slot of an actor that is not live, never
leave a waiter queued once it was cancelled, and never let the close be cut
short by a cancellation.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Generic, Literal, Self, TypeVar

import anyio
import anyio.to_thread
import ray.exceptions

from agent_backend.backends.ray.config import RayPoolConfig
from agent_backend.backends.ray.packages import ship_runtime_env
from agent_backend.backends.ray.replicas import ActorSet, Replica
from agent_backend.backends.ray.runtime import (
    CONNECTION,
    connect,
    describe_cause,
    pool_placement_group,
    remove_placement_groups,
    replica_placement_group,
)
from agent_backend.errors import AgentBackendError, BackendUnavailable, PoolClosed, PoolError
from agent_backend.lifecycle import AsyncResource, BackgroundTasks

__all__ = ["ActorSupervisor"]

A = TypeVar("A", bound=Replica)


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
        self.shipped_runtime_env: dict[str, Any] | None = None
        """The ``runtime_env`` every actor gets (``actor_options(..., runtime_env=)``): the
        config's, its local ``working_dir``/``py_modules`` uploaded at start (packages.py)."""
        self._background = BackgroundTasks(f"agent-backend {subject}")
        """The actors' watchers, judges, replacements and slot settlers."""
        self._actors = ActorSet[A](
            replicas=config.replicas,
            max_restarts=config.max_restarts,
            max_concurrency=config.max_concurrency,
            spawn=self._spawn_placed,
            await_ready=self._await_ready,
            changed=self._dispatch_waiters,
            closed_cause=closed_cause,
            unavailable_timeout=config.unavailable_timeout,
        )
        self._pool_group: Any = None
        """The pool-wide placement group of ``strategy = "pack"``."""
        self._waiters: collections.deque[_Waiter[A]] = collections.deque()
        self._changed: anyio.Event | None = None
        """Set (and dropped) at every change of an actor's state, a slot or the queue; made by
        the first waiter after a change (most changes, a slot taken or given back twice per
        call, have nobody waiting, and an Event costs a sniffio lookup)."""

    # -- what a subclass says ----------------------------------------------------------------------

    @abc.abstractmethod
    def _spawn(self, index: int, generation: int, placement: dict[str, Any]) -> A:
        """Create replica ``index``'s actor with ``actor_options(..., **placement)``."""

    def _spawn_placed(self, index: int, generation: int, avoid: frozenset[str]) -> A:
        """Where the actor goes (its own placement group, the pool's, or away from ``avoid``),
        then :meth:`_spawn`."""
        group = None
        if self._pool_group is not None:
            placement: dict[str, Any] = {"placement_group": self._pool_group, "bundle_index": index}
        else:
            group = replica_placement_group(self.config)
            placement = {"placement_group": group} if group is not None else {"avoid_nodes": avoid}
        actor = self._spawn(index, generation, placement)
        actor.placement_group = group
        return actor

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

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, checked again at every change of an actor's
        state, of a slot or of the queue; bound it with ``anyio.fail_after``."""
        while not condition():
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

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
            self._pool_group = await anyio.to_thread.run_sync(pool_placement_group, self.config)
            await self._background.open()
            self._started(await self._actors.start(self._background))
        except BaseException:
            await self.aclose()
            raise
        self._state = "open"

    def _connect(self) -> None:
        """Join or start Ray, or use this process's connection, then upload the pool's local
        code (blocking: a worker thread)."""
        self._owns_ray = connect(self.config)
        self.shipped_runtime_env = ship_runtime_env(self.config.runtime_env)

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
            # The background tasks are cancelled, so this is quick; they belong to a task of
            # their own, so any task may close the pool (a pool set closes each in its own).
            await self._background.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self._wind_down()
                    await self._actors.stop()
                    if self._pool_group is not None:
                        group, self._pool_group = self._pool_group, None
                        await anyio.to_thread.run_sync(remove_placement_groups, [group])
                    if self._owns_ray:
                        self._owns_ray = False
                        await anyio.to_thread.run_sync(CONNECTION.close)
                finally:
                    self._state = "closed"
                    self._done.set()
                    self._notify()

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
                self._notify()
                return actor
        if self._actors.exhausted():
            raise self._exhausted_error()
        waiter = _Waiter[A]()
        self._waiters.append(waiter)
        self._notify()
        try:
            await waiter.event.wait()
        except BaseException:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
                self._notify()
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
        if self._state == "open" and self._background.is_open():
            self._background.start_soon(self._settle, actor, ref)
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

    def _lose(self, actor: A, exc: BaseException) -> str:
        """``actor`` failed a call with one of ``ACTOR_DEATHS``: evicted, or (Ray reports it
        only unavailable) out of rotation with its node's actors until Ray says more; the cause."""
        cause = describe_cause(exc)
        if isinstance(exc, ray.exceptions.ActorUnavailableError):
            self._actors.suspect(actor, cause)
        else:
            self._actors.evict(actor, cause)
        return cause

    def _dispatch_waiters(self) -> None:
        """Hand free slots to queued callers in FIFO order, or fail them all when no actor will
        ever serve again (sync: no I/O here)."""
        self._notify()
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
