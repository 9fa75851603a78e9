"""Rollout workers as Ray actors: a :class:`~agent_backend.rollout.pool.RolloutPool` scaled out.

:class:`RayRolloutWorkers` starts ``replicas`` :class:`RolloutWorker` actors
(a Ray pool file says where, how many and what each reserves); each runs
whole episodes with its own policy client and tool pool, and the pool on the
driver keeps the ledger, the groups and the delivery. An episode goes to the
least-loaded live worker with a free slot; when none has one it waits on the
driver, never in a dead actor's queue.

Faults follow the tool-side Ray pool (:mod:`agent_backend.backends.ray`): a
worker whose actor dies is evicted at once (a sentinel call per actor fails
the moment it dies, and so does every episode it was running), then
replaced, at most ``max_restarts`` times per replica. An episode that was
running on it becomes a failed record (``env_error``, the worker and Ray's
cause in ``error``), delivered with its group like any failed episode; the
other episodes go on. With no live worker left and no restart left, the
next episode raises :class:`~agent_backend.errors.BackendUnavailable` and
the run stops (its ledger consistent).

By reference (``RolloutPool.stream(..., as_refs=True)``), a worker returns
two objects per episode: a small
:class:`~agent_backend.rollout.runner.EpisodeSummary`, which the driver reads,
and the records, which stay in Ray's object store. They are a task's return
value, so the driver owns them (not the worker: a worker that dies later
does not take them along), and Ray frees them once the driver and every
actor it passed the ``ObjectRef`` to dropped it.

This module must never hand an episode to a worker known to be dead, never
let a Ray exception reach the caller, and never fetch a by-reference episode
into the driver. Ray runs on asyncio only.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import anyio
import anyio.abc
import anyio.to_thread
import orjson
import ray
import ray.exceptions

from agent_backend.backends.ray import (
    ACTOR_DEATHS,
    ActorSupervisor,
    RayPoolConfig,
    Replica,
    actor_options,
    describe_cause,
    describe_when_ready,
    import_function,
)
from agent_backend.dispatch import Dispatcher, builtin_tools
from agent_backend.errors import (
    NonFiniteLogprobs,
    RolloutError,
    clip,
)
from agent_backend.rollout.episode import EpisodeConfig, EpisodeIds, RewardFunction, run_episode
from agent_backend.rollout.logprobs import NonFiniteCounters, NonFiniteStats
from agent_backend.rollout.policy import Policy
from agent_backend.rollout.runner import EpisodeRunner, EpisodeSummary
from agent_backend.rollout.trajectory import Trajectory
from agent_backend.tools import Tool, ToolRegistry, tool_from_definition

__all__ = [
    "RayRolloutStatistics",
    "RayRolloutWorkers",
    "RolloutWorker",
    "RolloutWorkerInfo",
    "ToolFiles",
    "fetch_batch",
]

#: Ray concurrency slots a worker keeps beyond ``max_concurrency``: its sentinel, describe or
#: non_finite, and close.
_CONTROL_SLOTS: Final = 3
#: Seconds the workers get to close their sessions and policy clients before they are killed.
_CLOSE_TIMEOUT: Final = 15.0


# -- what the driver sends ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ToolFiles:
    """The tool files of a ``tools_dir``, read and checked on the driver: what a worker builds
    its registry from, on whichever node it runs (it never reads the driver's folder)."""

    files: tuple[tuple[str, bytes], ...]
    """``(file name, content)`` of every ``*.json`` file directly in the folder, sorted."""

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> ToolFiles:
        """Read ``directory``'s tool files; :class:`SchemaError` for a bad one (as
        ``ToolRegistry.from_dir``, which this checks them with)."""
        ToolRegistry.from_dir(directory)
        paths = sorted(path for path in Path(directory).glob("*.json") if path.is_file())
        return cls(tuple((path.name, path.read_bytes()) for path in paths))

    def tools(self) -> list[Tool]:
        """The tools the files define (in a worker), named after their file in errors."""
        tools: list[Tool] = []
        for name, content in self.files:
            data = orjson.loads(content)
            items = data if isinstance(data, list) else [data]
            pointers = [f"/{i}" for i in range(len(items))] if isinstance(data, list) else [""]
            tools.extend(
                tool_from_definition(item, source=name, pointer=pointer)
                for item, pointer in zip(items, pointers, strict=True)
            )
        return tools


# -- inside the actor -------------------------------------------------------------------------------


class RolloutWorker:
    """The code inside one Ray actor: runs episodes with its own policy client and tool pool.

    Public so that Ray can import it by name on any node; use it through
    :class:`RayRolloutWorkers`. Its policy client, tool pool and dispatcher are
    opened on the first episode, in one task that holds them for the actor's
    life (an async context must be left by the task that entered it), and
    closed by :meth:`close`.
    """

    def __init__(
        self,
        name: str,
        policy: Mapping[str, Any],
        tool_files: ToolFiles | None,
        functions: Sequence[tuple[str, str | None]],
        tool_pool: Any,
        episode: EpisodeConfig,
        reward: RewardFunction | None,
    ) -> None:
        self.name = name
        self._policy_options = dict(policy)
        self._tool_files = tool_files
        self._functions = list(functions)
        self._tool_pool = tool_pool
        self._episode = episode
        self._reward = reward
        self._ready: anyio.Event | None = None
        self._closing = anyio.Event()
        self._holder: Any = None
        self._error: BaseException | None = None
        self._parts: tuple[Policy, Dispatcher, list[dict[str, Any]]] | None = None
        self._counters = NonFiniteCounters()

    async def describe(self) -> dict[str, Any]:
        """Who and where this worker is (answers once the actor runs)."""
        import os
        import socket

        return {
            "name": self.name,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    async def wait_closed(self) -> None:
        """Never returns: its reference fails the moment the actor dies (the driver's sentinel)."""
        await anyio.Event().wait()

    async def _hold(self) -> None:
        from agent_backend.pool_file import load_pool
        from agent_backend.rollout.tokens import open_policy

        assert self._ready is not None
        try:
            registry = ToolRegistry(
                builtin_tools() if self._tool_files is None else self._tool_files.tools()
            )
            for path, tool_name in self._functions:
                registry.add_function(import_function(path), name=tool_name)
            async with (
                load_pool(self._tool_pool) as backend,
                Dispatcher(registry, backend) as dispatcher,
                open_policy(self._policy_options, counters=self._counters) as policy,
            ):
                self._parts = (policy, dispatcher, registry.to_openai())
                self._ready.set()
                await self._closing.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._parts = None
            self._ready.set()

    async def _open(self) -> tuple[Policy, Dispatcher, list[dict[str, Any]]]:
        import asyncio

        if self._ready is None:
            self._ready = anyio.Event()
            # The actor's own long-lived task (Ray runs every method on this loop); close() ends it.
            self._holder = asyncio.get_running_loop().create_task(self._hold())
        await self._ready.wait()
        if self._parts is None:
            raise RolloutError(f"rollout worker {self.name} could not start: {self._error!r}")
        return self._parts

    async def run_episode(self, prompt: Any, ids: EpisodeIds, version: int) -> list[Trajectory]:
        """One episode on this worker's node; its records, tagged with the worker's name."""
        policy, dispatcher, tools = await self._open()
        records = await run_episode(
            prompt,
            policy=policy,
            dispatcher=dispatcher,
            tools=tools,
            reward=self._reward,
            config=self._episode,
            ids=ids,
            policy_version=lambda: version,
        )
        return [r.model_copy(update={"extras": {**r.extras, "worker": self.name}}) for r in records]

    async def run_episode_by_reference(
        self, prompt: Any, ids: EpisodeIds, version: int
    ) -> tuple[EpisodeSummary, list[Trajectory]]:
        """:meth:`run_episode` and its summary. Called with two return objects: the caller
        reads the summary and leaves the records in the object store."""
        records = await self.run_episode(prompt, ids, version)
        return EpisodeSummary.of(records), records

    async def non_finite(self) -> NonFiniteStats:
        return self._counters.snapshot()

    async def close(self) -> None:
        """Close the policy client, the dispatcher (every session) and the tool pool."""
        self._closing.set()
        if self._holder is not None:
            with contextlib.suppress(BaseException):
                await self._holder


# -- the driver side --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutWorkerInfo:
    """One rollout worker, as the driver sees it now."""

    name: str
    """``POOL-rollout-REPLICA``, ``.GENERATION`` added for a replacement (``-0.1``): as records
    (``extras["worker"]``) and errors name it."""
    ray_name: str
    """The Ray actor's name (``ray.get_actor(ray_name)``, ``ray list actors``)."""
    state: Literal["starting", "live", "unavailable", "dead"]
    in_flight: int
    served: int
    """Episodes it returned (whatever their stop reason)."""
    cause: str | None
    """Why it died; None while it lives."""


@dataclasses.dataclass(frozen=True, slots=True)
class RayRolloutStatistics:
    workers_live: int
    workers_starting: int
    workers_dead: int
    """Replicas whose worker died and is not (yet) replaced."""
    episodes_in_flight: int
    episodes: int
    """Episodes that ended (with records or a failed record) since start."""
    episodes_lost: int
    """Of those, episodes whose worker died while running them (``env_error`` records)."""
    evictions: int
    restarts: int
    """Replacement workers started."""
    closed: bool


@dataclasses.dataclass(eq=False, slots=True, kw_only=True)
class _Worker(Replica):
    split: Any
    """``handle.run_episode_by_reference`` with two return objects: the summary, the records."""

    def info(self) -> RolloutWorkerInfo:
        return RolloutWorkerInfo(
            self.name, self.ray_name, self.state, self.in_flight, self.served, self.cause
        )


class RayRolloutWorkers(ActorSupervisor[_Worker], EpisodeRunner):
    """Rollout workers as Ray actors, for :class:`~agent_backend.rollout.pool.RolloutPool`
    (``workers=``): episodes scale out.

    A Ray pool file (``type = "ray"``, ``pools/ray.example.toml``) says where
    and how many: ``address`` (or a local Ray), ``replicas`` workers, each
    reserving ``num_cpus``/``num_gpus``/``resources``, with ``runtime_env``,
    running up to ``max_concurrency`` episodes at once, replaced at most
    ``max_restarts`` times when it dies. Every worker has its own policy
    client (``policy``: the keyword arguments of
    :class:`~agent_backend.rollout.policy.OpenAICompatiblePolicy`, URL
    included; with ``tokenizer`` a token-in/token-out policy instead:
    :func:`~agent_backend.rollout.tokens.open_policy`) and runs its episodes' tools on ``tool_pool`` (default: its own
    node, the local pool): the tool files of ``tools_dir`` (read here, when
    the workers are made, and sent to each worker: no node needs the
    folder; default: the built-ins, the package's own on every node), and
    the pool file's ``tools``, Python functions imported by each worker
    (shipped with ``runtime_env``, or installed) and run in it. ``reward``
    must pickle.

    Faults are in the module docstring; the workers' lifecycle, faults and
    queue are :class:`~agent_backend.backends.ray.ActorSupervisor`'s. A
    cancelled episode is cancelled on its worker too (``ray.cancel``), which
    closes its session there.
    """

    def __init__(
        self,
        config: Any,
        *,
        policy: Mapping[str, Any],
        tools_dir: str | Path | None = None,
        tool_pool: Any = None,
        episode: EpisodeConfig | None = None,
        reward: RewardFunction | None = None,
    ) -> None:
        from agent_backend.pool_file import DEFAULT_POOL

        if not isinstance(config, RayPoolConfig):
            raise TypeError(f"a Ray pool config, not {type(config).__name__}")
        if "url" not in policy:
            raise ValueError("policy needs the server's url")
        super().__init__(
            config,
            subject=f"the Ray rollout workers of pool {config.name!r}",
            plural=True,
            actor_noun="Ray rollout worker",
            closed_cause="the workers were closed",
        )
        self.episode = episode or EpisodeConfig()
        self._policy = dict(policy)
        self.tool_files = None if tools_dir is None else ToolFiles.read(tools_dir)
        """What the workers get of ``tools_dir`` (None: the built-in tools)."""
        self._tool_pool = tool_pool if tool_pool is not None else DEFAULT_POOL
        self._reward = reward
        self._token = secrets.token_hex(3)
        self._episodes = self._lost = 0

    # -- introspection ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<RayRolloutWorkers pool={self.config.name} [workers: {s.workers_live} live, "
            f"{s.workers_starting} starting, {s.workers_dead} dead | episodes: "
            f"{s.episodes_in_flight} in flight, {s.episodes_lost} lost] {self._state}>"
        )

    @property
    def workers(self) -> list[RolloutWorkerInfo]:
        """The current worker of every replica."""
        return [worker.info() for worker in self._actors.entries]

    @property
    def ray_names(self) -> list[str]:
        """The Ray names of every actor started so far, replaced ones included."""
        return list(dict.fromkeys(worker.ray_name for worker in self._actors.everyone()))

    @property
    def capacity(self) -> int:
        """Episodes the live workers run at once."""
        return self._actors.live() * self.config.max_concurrency

    def statistics(self) -> RayRolloutStatistics:
        states = self._actors.states()
        return RayRolloutStatistics(
            workers_live=states["live"],
            workers_starting=states["starting"],
            workers_dead=states["dead"],
            episodes_in_flight=self._actors.in_flight(),
            episodes=self._episodes,
            episodes_lost=self._lost,
            evictions=self._actors.evictions,
            restarts=self._actors.replacements,
            closed=self._state == "closed",
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def _started_twice(self) -> RolloutError:
        return RolloutError(f"the Ray rollout workers can be started once (they are {self._state})")

    def _spawn(self, index: int, generation: int, placement: dict[str, Any]) -> _Worker:
        config = self.config
        # Replacements only get a generation suffix: a first worker's name, which records
        # carry (extras["worker"]), stays what it was before workers were replaced.
        name = f"{config.name}-rollout-{index}" + (f".{generation}" if generation else "")
        ray_name = f"agent_backend/rollout/{config.name}/{self._token}/{index}.{generation}"
        options = actor_options(
            config,
            ray_name,
            control_slots=_CONTROL_SLOTS,
            runtime_env=self.shipped_runtime_env,
            **placement,
        )
        functions = [(tool.function, tool.name) for tool in config.tools]
        handle = (
            _worker_class()
            .options(**options)
            .remote(
                name,
                self._policy,
                self.tool_files,
                functions,
                self._tool_pool,
                self.episode,
                self._reward,
            )
        )
        split = handle.run_episode_by_reference.options(num_returns=2)
        worker = _Worker(
            index=index,
            generation=generation,
            name=name,
            ray_name=ray_name,
            handle=handle,
            split=split,
        )
        worker.sentinel = handle.wait_closed.remote()
        return worker

    async def _await_ready(self, worker: _Worker) -> Any:
        """Wait (at most ``start_timeout``) for ``worker``'s actor to run; its description."""
        return await describe_when_ready(
            worker.handle, label=f"rollout worker {worker.name}", config=self.config
        )

    async def _wind_down(self) -> None:
        """Let every live worker close its sessions and policy client (bounded) before the kill."""
        with anyio.move_on_after(_CLOSE_TIMEOUT):
            async with anyio.create_task_group() as group:
                for worker in self._actors.entries:
                    if worker.state == "live":
                        group.start_soon(self._close_worker, worker)

    @staticmethod
    async def _close_worker(worker: _Worker) -> None:
        with contextlib.suppress(Exception):
            await worker.handle.close.remote()

    # -- episodes --------------------------------------------------------------------------------

    supports_refs = True

    async def records(
        self, prompt: Any, ids: EpisodeIds, policy_version: Callable[[], int]
    ) -> list[Trajectory]:
        """:meth:`run_episode` at the policy version when it starts (:class:`EpisodeRunner`)."""
        return await self.run_episode(prompt, ids, policy_version())

    async def run_episode(self, prompt: Any, ids: EpisodeIds, version: int) -> list[Trajectory]:
        """One episode on the least-loaded live worker: its records (fetched into this process).

        A worker lost mid-episode gives an ``env_error`` record. Raises
        :class:`BackendUnavailable` when no worker is left (nor any restart),
        :class:`NonFiniteLogprobs` under the ``fail`` policy.
        """
        outcome = await self._submit(prompt, ids, version, by_reference=False)
        assert isinstance(outcome, list)
        return outcome

    async def run_episode_by_reference(
        self, prompt: Any, ids: EpisodeIds, version: int
    ) -> tuple[EpisodeSummary, ray.ObjectRef[list[Trajectory]]]:
        """:meth:`run_episode`, its records left in the object store: their summary and ref.

        This process owns the object (a failed record made here is put there
        too); Ray frees it once every reference to it is gone.
        """
        outcome = await self._submit(prompt, ids, version, by_reference=True)
        if isinstance(outcome, list):
            return EpisodeSummary.of(outcome), ray.put(outcome)
        return outcome

    async def _submit(
        self, prompt: Any, ids: EpisodeIds, version: int, *, by_reference: bool
    ) -> list[Trajectory] | tuple[EpisodeSummary, ray.ObjectRef[list[Trajectory]]]:
        """One episode on a worker: its records, or by reference its summary and records' ref
        (a failed record is always returned as records)."""
        worker = await self._acquire()
        try:
            if by_reference:
                first, second = worker.split.remote(prompt, ids, version)
            else:
                first = second = worker.handle.run_episode.remote(prompt, ids, version)
        except Exception as exc:  # the prompt does not pickle
            self._release(worker)
            self._episodes += 1
            error = f"the episode cannot be sent to a Ray worker: {type(exc).__name__}: {exc}"
            return self._failed(ids, version, "rollout_error", error)
        try:
            if by_reference:
                summary: EpisodeSummary = await first
                worker.served += 1
                return summary, second
            records: list[Trajectory] = await first
            worker.served += 1
            return records
        except ray.exceptions.RayTaskError as exc:  # the episode raised on a live worker
            await _drain(second)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, NonFiniteLogprobs):
                raise cause from None  # the "fail" policy: the run must stop
            error = describe_cause(exc) if cause is None else f"{type(cause).__name__}: {cause}"
            return self._failed(ids, version, "rollout_error", error)
        except ACTOR_DEATHS as exc:
            await _drain(second)
            cause_text = self._lose(worker, exc)
            self._lost += 1
            error = f"rollout worker {worker.name} was lost: {cause_text}"
            return self._failed(ids, version, "env_error", error)
        except ray.exceptions.RayError as exc:
            await _drain(second)
            error = f"Ray failed the episode on rollout worker {worker.name}: {describe_cause(exc)}"
            return self._failed(ids, version, "env_error", error)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.cancel(first)  # the episode stops on its worker too; its session closes there
            raise
        finally:
            self._release(worker)
            self._episodes += 1

    def _failed(self, ids: EpisodeIds, version: int, reason: Any, error: str) -> list[Trajectory]:
        return _failed_record(ids, version, reason, error, self.episode.failure_reward)

    async def non_finite(self) -> NonFiniteStats:
        """The non-finite logprob counts of every live worker, summed (a dead worker's are lost)."""
        totals: collections.Counter[str] = collections.Counter()
        for worker in self._actors.entries:
            if worker.state == "live":
                with contextlib.suppress(Exception):
                    stats = await worker.handle.non_finite.remote()
                    totals.update(dataclasses.asdict(stats))
        return NonFiniteStats(**totals)


async def _drain(ref: Any) -> None:
    """Read a failed task's other return object, or Ray logs its error as unhandled."""
    with contextlib.suppress(Exception):
        await ref


def fetch_batch(refs: Sequence[ray.ObjectRef[list[Trajectory]]]) -> list[Trajectory]:
    """In a trainer's Ray actor: the records of a batch by reference, in order (one ``ray.get``).

    In an async actor, ``[t for part in await asyncio.gather(*refs) for t in part]``
    does the same without blocking its event loop.
    """
    return [record for part in ray.get(list(refs)) for record in part]


def _failed_record(
    ids: EpisodeIds, version: int, reason: Any, error: str, reward: float
) -> list[Trajectory]:
    """The record of an episode that did not end on its worker (lost, or never sent)."""
    from agent_backend.rollout.trajectory import SegmentBuilder

    return SegmentBuilder().build(
        rollout_id=ids.rollout_id,
        group_id=ids.group_id,
        sample_idx=ids.sample_idx,
        prompt_index=ids.prompt_index,
        reward=reward,
        policy_version_start=version,
        policy_version_end=version,
        stop_reason=reason,
        num_turns=0,
        error=clip(error, 2000),
    )


@functools.cache
def _worker_class() -> Any:
    return ray.remote(RolloutWorker)
