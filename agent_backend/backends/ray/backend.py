"""The Ray backend: Python tools on a pool of Ray actors that hold CPUs and GPUs.

A pool (``type = "ray"``) is ``replicas`` identical actors, each declared
with ``num_cpus``/``num_gpus``/custom ``resources`` and running up to
``max_concurrency`` calls at once. Each actor imports the pool's tools
(``module:function``, sync or async) once, when it starts. A call goes to the
least-loaded live actor; when all are busy it waits in a FIFO queue, and the
wait counts against the call's timeout.

Results at or above ``inline_limit`` bytes stay in the object store and come
back as a :class:`~agent_backend.backends.ray.payload.PayloadRef` owned by
the driver (see that module for ownership and lifetime); smaller ones come
back inline.

Faults: an actor that dies is evicted at once (a sentinel call per actor
fails the moment it dies) and replaced, at most ``max_restarts`` times per
replica. A call it was running is retried once on another actor when the
tool is declared ``idempotent``, else it fails with
:class:`~agent_backend.errors.WorkerLost` naming the actor and the cause. A
tool's own exception comes back as itself when it is one of ours and
pickles, else as :class:`~agent_backend.errors.ToolFailed` (type, message,
HTTP status): the actor returns errors as values, so nothing unpicklable
ever crosses the boundary.

This module must never hand a call to an actor known to be dead, never wait
for resources no actor has, never let a Ray exception reach the caller, and
never fetch a by-reference result into the driver. Ray runs on asyncio only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final, cast

import anyio
import anyio.abc
import anyio.to_thread
import ray
import ray.exceptions

from agent_backend.backends._errors import map_exceptions
from agent_backend.backends.ray.actor import (
    ERROR,
    VALUE,
    Outcome,
    Request,
    ToolActor,
    tool_failure,
)
from agent_backend.backends.ray.config import RayPoolConfig, RayToolConfig
from agent_backend.backends.ray.frames import decode, encode
from agent_backend.backends.ray.payload import PayloadRef, contains_payloads
from agent_backend.backends.ray.placement import alive_nodes
from agent_backend.backends.ray.replicas import Replica
from agent_backend.backends.ray.reports import RayActorInfo, RayResult, RayStatistics
from agent_backend.backends.ray.runtime import (
    ACTOR_DEATHS,
    actor_options,
    check_cluster,
    describe_cause,
    describe_when_ready,
    tool_shortage,
)
from agent_backend.backends.ray.supervisor import ActorSupervisor
from agent_backend.dispatch.backend import Backend, Host, HostedResult
from agent_backend.errors import (
    AgentBackendError,
    BackendError,
    BackendUnavailable,
    PoolError,
    ResourceUnavailable,
    ToolArgumentError,
    ToolFailed,
    ToolTimeout,
    UnknownToolError,
    WorkerLost,
    clip,
)
from agent_backend.tools.tool import Tool

__all__ = ["RayActorInfo", "RayBackend", "RayResult", "RayStatistics"]

#: Ray concurrency slots an actor keeps beyond ``max_concurrency``: its death sentinel and describe().
_CONTROL_SLOTS: Final = 2


# -- mapping Ray's errors ---------------------------------------------------------------------------


def _task_error(exc: BaseException, tool: str) -> AgentBackendError:
    """A failed actor task (the tool already returns its own errors: so Ray's serialization of
    the arguments or the result, as a rule) as the error it carries or a :class:`ToolFailed`."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, AgentBackendError):
        return cause
    if isinstance(cause, BaseException):
        return tool_failure(cause, tool=tool)
    return ToolFailed(describe_cause(exc), tool=tool, error_type=type(exc).__name__)


# -- the driver side --------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class _Actor(Replica):
    run: Any
    """``handle.run`` with two return objects: the outcome, and the by-reference result."""
    pid: int | None = None
    node: str | None = None
    gpu_ids: tuple[str, ...] = ()

    def info(self) -> RayActorInfo:
        return RayActorInfo(
            self.name,
            self.ray_name,
            self.state,
            self.in_flight,
            self.served,
            self.pid,
            self.node,
            self.gpu_ids,
            self.cause,
            self.node_id,
        )


class _ActorDied(Exception):
    def __init__(self, cause: str, *, unavailable: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.unavailable = unavailable
        """Ray lost the actor's connection and has not said it died: the call may have run."""


class RayBackend(ActorSupervisor[_Actor], Backend):
    """A pool of Ray actors hosting Python tools; ``await pool.call(tool, arguments)``.

    Ray actors run Python functions, not shell commands, so :attr:`hosts` is
    empty and :meth:`call` is the way in. The actors' lifecycle, faults and
    queue are :class:`~agent_backend.backends.ray.supervisor.ActorSupervisor`'s.
    """

    kind: ClassVar[str] = "ray"

    def __init__(self, config: RayPoolConfig) -> None:
        super().__init__(
            config,
            subject=f"the Ray pool {config.name!r}",
            actor_noun="actor",
            closed_cause="the pool was closed",
        )
        self._pool_id = uuid.uuid4().hex[:8]
        self._tools: dict[str, Tool] = {}
        self._specs: dict[str, RayToolConfig] = {}
        self._unsatisfiable: dict[str, ResourceUnavailable] = {}
        self._payloads: weakref.WeakSet[PayloadRef] = weakref.WeakSet()
        self._calls = self._retries = 0

    @classmethod
    def from_config(cls, config: RayPoolConfig) -> RayBackend:
        return cls(config)

    # -- introspection ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        s = self.statistics()
        state = "" if self._state == "open" else f" {self._state}"
        return (
            f"<RayBackend pool={self.config.name} [actors: {s.actors_live} live, "
            f"{s.actors_starting} starting, {s.actors_dead} dead | calls: {s.calls_in_flight} "
            f"in flight, {s.calls_queued} queued | payloads: {s.payloads}]{state}>"
        )

    @property
    def hosts(self) -> Sequence[Host]:
        return ()

    capacity_unit = "actor"

    def capacity(self) -> tuple[int, int]:
        """Live actors, of all the pool's replicas (those starting or dead and not replaced yet)."""
        s = self.statistics()
        total = s.actors_live + s.actors_starting + s.actors_unavailable + s.actors_dead
        return s.actors_live, total

    def pick_host(self) -> Host:
        raise BackendUnavailable(
            "the Ray backend runs Python tools (RayBackend.call), not commands", backend="ray"
        )

    def hosted_tools(self) -> Sequence[Tool]:
        """The pool's tools, for a :class:`~agent_backend.dispatch.Dispatcher` to route to :meth:`call`."""
        if self._state in ("new", "starting"):
            raise PoolError(
                f"Ray pool {self.config.name!r} learns its tools from its actors when it starts: "
                "open it (`async with pool`) before giving it to a Dispatcher"
            )
        return self.tools

    async def call_hosted(
        self,
        tool: str,
        arguments: Mapping[str, Any] | str,
        *,
        timeout: float,  # noqa: ASYNC109 - the call's limit, as in call()
    ) -> HostedResult:
        result = await self.call(tool, arguments, timeout=timeout)
        payload = result.payload
        summary = None
        if payload is not None:  # the model sees what was kept, not the bytes
            summary = {"payload": {"id": payload.id, **dataclasses.asdict(payload.info)}}
        return HostedResult(result.value, result.actor, summary)

    @property
    def tools(self) -> Sequence[Tool]:
        """The pool's tools as the actors loaded them (definitions only: they run remotely)."""
        return tuple(self._tools.values())

    def actors(self) -> list[RayActorInfo]:
        return [actor.info() for actor in self._actors.entries]

    def statistics(self) -> RayStatistics:
        states = self._actors.states()
        return RayStatistics(
            actors_live=states["live"],
            actors_starting=states["starting"],
            actors_dead=states["dead"],
            calls_in_flight=self._actors.in_flight(),
            calls_queued=len(self._waiters),
            calls=self._calls,
            retries=self._retries,
            evictions=self._actors.evictions,
            restarts=self._actors.replacements,
            payloads=sum(1 for payload in self._payloads if not payload.is_released()),
            closed=self._state == "closed",
            actors_unavailable=states["unavailable"],
            nodes_lost=len(self._actors.dead_nodes),
        )

    # -- lifecycle -------------------------------------------------------------------------------

    async def _prepare(self) -> None:
        check_cluster(self.config, await anyio.to_thread.run_sync(alive_nodes))

    def _spawn(self, index: int, generation: int, placement: dict[str, Any]) -> _Actor:
        config = self.config
        name = f"{config.name}-{index}.{generation}"
        ray_name = f"agent_backend/{config.name}/{self._pool_id}/{index}.{generation}"
        options = actor_options(
            config,
            ray_name,
            control_slots=_CONTROL_SLOTS,
            runtime_env=self.shipped_runtime_env,
            **placement,
        )
        handle = (
            _actor_class()
            .options(**options)
            .remote(
                name, [(tool.function, tool.name) for tool in config.tools], config.inline_limit
            )
        )
        actor = _Actor(
            index=index,
            generation=generation,
            name=name,
            ray_name=ray_name,
            handle=handle,
            run=handle.run.options(num_returns=2),
        )
        actor.sentinel = handle.wait_closed.remote()
        return actor

    async def _await_ready(self, actor: _Actor) -> dict[str, Any]:
        """Wait for ``actor`` to have started and loaded its tools; its description."""
        info = await describe_when_ready(
            actor.handle, label=f"actor {actor.name}", config=self.config
        )
        if info["load_error"] is not None:
            raise info["load_error"]
        actor.pid, actor.node = info["pid"], info["node"]
        actor.gpu_ids = tuple(info["gpu_ids"])
        return info  # type: ignore[no-any-return]

    def _started(self, described: list[Any]) -> None:
        """Learn the tools from the first actor's description (every actor loads the same)."""
        for spec, tool in zip(self.config.tools, described[0]["tools"], strict=True):
            self._specs[tool["name"]] = spec
            shortage = tool_shortage(self.config, tool["name"], spec)
            if shortage is not None:
                self._unsatisfiable[tool["name"]] = shortage
            self._tools[tool["name"]] = Tool(
                name=tool["name"],
                description=tool["description"],
                parameters=tool["parameters"],
                source=tool["source"],
                # An ExecutionSpec block: a Dispatcher's default limit is the pool's.
                meta={"x-agent-backend": {"backend": "ray", "timeout": self.config.call_timeout}},
            )

    async def _wind_down(self) -> None:
        for payload in list(self._payloads):
            payload.release()

    # -- calls -----------------------------------------------------------------------------------

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any] | str | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the call's limit; it also cancels the Ray task
    ) -> RayResult:
        """Run ``tool`` on the least-loaded live actor and return its result.

        ``arguments`` is the arguments object (a mapping, or its JSON text); it
        may hold :class:`PayloadRef` values anywhere, which the actor resolves
        before the tool runs. Raises :class:`UnknownToolError`,
        :class:`ResourceUnavailable` (at once, when no actor has what the tool
        declares), :class:`ToolArgumentError`, :class:`ToolFailed` or the
        tool's own project error, :class:`WorkerLost`, :class:`ToolTimeout`,
        :class:`BackendUnavailable` and :class:`PayloadLost`.
        """
        self._check_open()
        spec = self._specs.get(tool)
        if spec is None:
            raise UnknownToolError(tool, available=list(self._specs))
        shortage = self._unsatisfiable.get(tool)
        if shortage is not None:
            raise ResourceUnavailable(
                shortage.message,
                needed=shortage.needed,
                available=shortage.available,
                backend="ray",
            )
        arguments = {} if arguments is None else arguments
        has_payloads = not isinstance(arguments, str) and contains_payloads(arguments)
        limit = self.config.call_timeout if timeout is None else timeout
        if not limit > 0:
            raise ValueError("timeout must be positive")
        started = time.monotonic()
        attempts = 0
        try:
            # Checked and repaired here, with the schema the actors described, rather than in
            # the actor (ToolActor.Request): a model's bad arguments never take a slot, and the
            # actor, which Ray runs at low priority, does less per call. (Arguments with
            # payloads are a mapping: contains_payloads said so.)
            prepared = (
                cast(Mapping[str, Any], arguments)
                if has_payloads
                else self._tools[tool].prepare(arguments)
            )
            with anyio.move_on_after(limit):
                while True:
                    attempts += 1
                    actor = await self._acquire()
                    try:
                        value = await self._run_on(actor, tool, prepared, has_payloads)
                    except _ActorDied as died:
                        if died.unavailable:
                            # Out of rotation with its node's actors until Ray says more.
                            self._actors.suspect(actor, died.cause)
                        else:
                            self._evict(actor, died.cause)
                        if spec.idempotent and attempts == 1:
                            self._retries += 1
                            continue
                        what = "was lost (it may have run)" if died.unavailable else "died"
                        raise WorkerLost(
                            f"actor {actor.name} of pool {self.config.name!r} {what} during a "
                            f"call of {tool!r}: {died.cause}",
                            worker=actor.name,
                            cause=died.cause,
                            backend="ray",
                            host=actor.node,
                        ) from None
                    return RayResult(tool, value, actor.name, time.monotonic() - started, attempts)
            raise ToolTimeout(
                f"call of {tool!r} on pool {self.config.name!r} did not finish within {limit:g}s",
                timeout=limit,
                backend="ray",
            )
        finally:
            self._calls += 1

    async def _run_on(
        self, actor: _Actor, tool: str, arguments: Mapping[str, Any], has_payloads: bool
    ) -> Any:
        """One attempt on ``actor``, which holds a slot taken for it; the slot is given back."""
        request: Request = (tool, arguments, has_payloads)
        try:
            # Prepared arguments are JSON values: pickled here, Ray carries bytes (frames.py).
            # Payload stand-ins hold object references, which only Ray's serializer tracks.
            encoded = None if has_payloads else encode(request)
            outcome_ref, result_ref = actor.run.remote(request if encoded is None else encoded)
        except Exception as exc:
            self._release(actor)
            raise ToolArgumentError(
                f"the arguments cannot be sent to a Ray actor: {clip(str(exc), 300)}", tool=tool
            ) from None
        try:
            with map_exceptions(
                {ray.exceptions.RayError: BackendError},
                message=f"Ray failed a call of {tool!r} on {actor.name}",
                backend="ray",
                host=actor.node,
            ):
                try:
                    outcome: Outcome | bytes = await outcome_ref
                except ray.exceptions.ActorUnavailableError as exc:
                    raise _ActorDied(describe_cause(exc), unavailable=True) from None
                except ACTOR_DEATHS as exc:
                    raise _ActorDied(describe_cause(exc)) from None
                except ray.exceptions.RayTaskError as exc:
                    raise _task_error(exc, tool) from None
        except (_ActorDied, AgentBackendError):
            self._release(actor)
            # The task is over and both its returns hold the error: read the second too, or
            # Ray logs it as an "unhandled error" when the reference goes.
            with contextlib.suppress(Exception):
                await result_ref
            raise
        except BaseException:
            # Timed out or cancelled: stop the task, and keep the slot until it really ends.
            with contextlib.suppress(Exception):
                ray.cancel(outcome_ref)
            self._release_when_done(actor, outcome_ref)
            raise
        actor.served += 1
        self._release(actor)
        if isinstance(outcome, bytes):
            try:
                outcome = cast(Outcome, decode(outcome))
            except Exception as exc:  # the result's class cannot be imported here, say
                raise BackendError(
                    f"the result of {tool!r} from {actor.name} cannot be read in the driver: "
                    f"{type(exc).__name__}: {clip(str(exc), 300)}",
                    backend="ray",
                    host=actor.node,
                ) from None
        kind, body = outcome
        if kind == VALUE:
            return body
        if kind == ERROR:
            raise body
        payload = PayloadRef(result_ref, body, producer=actor.name, tool=tool)
        self._payloads.add(payload)
        return payload


@functools.cache
def _actor_class() -> Any:
    return ray.remote(ToolActor)
