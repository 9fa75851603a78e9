"""Many episodes at once: :class:`RolloutPool` turns prompts into delivered GRPO groups.

For every prompt it claims from the :class:`~agent_backend.rollout.ledger.ResumeLedger`,
the pool samples a group of ``n`` episodes (:func:`~agent_backend.rollout.episode.run_episode`),
at most ``concurrency`` episodes at a time over all groups, and delivers the
group either to a writer (:meth:`RolloutPool.run`: JSONL or Parquet on disk,
what ``agent-backend rollout`` does) or to a trainer (:meth:`RolloutPool.stream`:
an async iterator of batches; with Ray workers, optionally batches of Ray
``ObjectRef`` for a trainer running in Ray actors).

The bookkeeping follows the order that makes a crash harmless at any instant
(a resume position saved ahead of training loses the prompts in flight; one
that waits for dropped prompts to be trained never moves): a prompt is
claimed (in flight), its group sampled, then delivered, and only once the
consumer took it durably (the writer fsynced it, or the trainer asked for the
next batch) is it marked trained. At
delivery, a group older than ``max_staleness`` policy versions is dropped:
marked dropped in the ledger (done, never trained, never redone) and
counted, never delivered.

Failures are contained (one failed rollout must not abort a training step):
a failed episode is a recorded trajectory (its ``stop_reason`` and ``error``
say why) delivered with its group; it never cancels its siblings or the
step. A group whose every episode failed for the environment or the rollout
layer (``env_error``, ``rollout_error``) carries no signal: it is sampled
again up to ``group_retries`` times, then left for a later run (its prompt stays
untrained and is redone on resume). ``max_failed_groups`` such groups in a
row mean the infrastructure is down: the run stops with a
:class:`~agent_backend.errors.RolloutError`, its ledger consistent. A rollout
dropped for non-finite logprobs (the ``drop`` policy) is counted and not
delivered. The ``fail`` policy stops the run with
:class:`~agent_backend.errors.NonFiniteLogprobs`.

Everything runs in task groups scoped to :meth:`RolloutPool.run` and
:meth:`RolloutPool.stream`: no task outlives them, and leaving them (normally,
by error or cancellation) cancels the episodes still running, whose
sessions are closed on the way out.

The ledger is used from the event loop only; file I/O (writer, checkpoint)
runs in worker threads. The pool's bookkeeping reads only an
:class:`EpisodeSummary` of each episode, so that records kept in Ray's object
store (``stream(..., as_refs=True)``) are never fetched into this process.
The pool runs every episode through one
:class:`~agent_backend.rollout.runner.EpisodeRunner`, in this process or on
Ray workers (:mod:`agent_backend.rollout.ray_workers`, which imports Ray and
is loaded on first use): importing this module never imports Ray. This module must
never mark a prompt trained before its group was taken durably, nor count a
dropped group as trained.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, Self, TypeVar, overload

import anyio
import anyio.abc
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from agent_backend.dispatch import Dispatcher
from agent_backend.errors import RolloutError
from agent_backend.lifecycle import AsyncResource
from agent_backend.rollout import defaults
from agent_backend.rollout.bookkeeping import (
    FAILED_STOP_REASONS,
    Admission,
    Group,
    RolloutStatistics,
    Run,
    Tally,
)
from agent_backend.rollout.episode import EpisodeIds, RewardFunction, prompt_messages
from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.logprobs import NonFiniteCounters
from agent_backend.rollout.policy import Policy
from agent_backend.rollout.runner import Episode, EpisodeRunner, EpisodeSummary, episode_runner
from agent_backend.rollout.servers import PolicyServers, UpdateReport, servers_of
from agent_backend.rollout.trajectory import Trajectory
from agent_backend.rollout.weight_sync import InFlight
from agent_backend.rollout.writers import TrajectoryWriter
from agent_backend.tools import ToolRegistry

if TYPE_CHECKING:
    from ray import ObjectRef

    from agent_backend.rollout.episode import EpisodeConfig
    from agent_backend.rollout.ray_workers import RayRolloutWorkers, RolloutWorker

__all__ = [
    "FAILED_STOP_REASONS",
    "WRITER_POSITION",
    "EpisodeSummary",
    "RayRolloutWorkers",
    "RolloutPool",
    "RolloutStatistics",
    "RolloutStream",
    "RolloutWorker",
]

# Defined in agent_backend.rollout.ray_workers (which imports Ray and this module's runner, never
# this module), re-exported here on first use for the importers of their old home.
_RAY_NAMES: Final = frozenset({"RayRolloutWorkers", "RolloutWorker"})


def __getattr__(name: str) -> Any:
    if name in _RAY_NAMES:
        from agent_backend.rollout import ray_workers

        return getattr(ray_workers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The key of a checkpoint's ``extra`` that holds the writer's durable position.
WRITER_POSITION: Final[str] = "writer_position"


class RolloutPool(AsyncResource):
    """Runs GRPO groups of episodes concurrently and delivers them (module docstring).

    ``policy`` samples turns, ``dispatcher`` (open) runs the tools, one session
    per episode. Use :meth:`run` to write groups to disk, :meth:`stream` to
    feed a trainer in this process; :meth:`set_policy_version` after each
    weight update.
    """

    def __init__(
        self,
        policy: Policy | None,
        dispatcher: Dispatcher | None,
        *,
        workers: EpisodeRunner | None = None,
        tools: ToolRegistry | Sequence[Mapping[str, Any]] | None = None,
        reward: RewardFunction | None = None,
        n: int = defaults.N,
        concurrency: int = defaults.CONCURRENCY,
        episode: EpisodeConfig | None = None,
        max_staleness: int | None = None,
        policy_version: int = 0,
        group_retries: int = 1,
        max_failed_groups: int | None = 8,
        max_buffered_groups: int | None = None,
        counters: NonFiniteCounters | None = None,
        servers: PolicyServers | None = None,
        admission: bool = True,
    ) -> None:
        """
        Args:
            policy: samples the turns (:class:`~agent_backend.rollout.policy.Policy`).
            dispatcher: an open dispatcher; every episode opens its session on it.
            workers: started :class:`RayRolloutWorkers` (or another
                :class:`~agent_backend.rollout.runner.EpisodeRunner`) that run the episodes
                instead (then ``policy``, ``dispatcher``, ``tools``, ``reward`` and
                ``episode`` are the workers' own and must not be given here).
            tools: the tools offered (default: the dispatcher's registry).
            reward: scores each finished episode (default: 0.0).
            n: samples per prompt (the GRPO group size).
            concurrency: episodes running at once, over all groups.
            episode: the limits of each episode.
            max_staleness: most policy versions a group may lag at delivery; None: any.
                A group older is dropped when it is delivered (counted in ``groups_stale``);
                with ``admission``, :meth:`stream` also starts a group only if it will be
                trained in time (and delivers groups in the order they were started).
            policy_version: the version of the policy's weights now (default: the servers').
            group_retries: times a group whose every episode failed (env/rollout
                errors) is sampled again before it is left for a later run.
            max_failed_groups: such failed groups in a row that stop the run
                (a RolloutError: the policy server or the pool is down); None: never.
            max_buffered_groups: sampled groups waiting for the consumer before
                sampling pauses (default: as many as run at once); bounds staleness.
            counters: where non-finite logprobs are counted (default: the policy's).
            servers: the policy servers that :meth:`update_weights` updates (default: the
                policy's own, :class:`~agent_backend.rollout.servers.PolicyServers`).
            admission: staleness at admission in :meth:`stream` (see ``max_staleness``);
                False: only dropped at delivery.
        """
        if n < 1 or concurrency < 1:
            raise ValueError("n and concurrency must be at least 1")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (or None)")
        if group_retries < 0:
            raise ValueError("group_retries must be >= 0")
        if max_failed_groups is not None and max_failed_groups < 1:
            raise ValueError("max_failed_groups must be >= 1 (or None)")
        self.runner = episode_runner(
            policy, dispatcher, workers=workers, tools=tools, reward=reward, episode=episode
        )
        self.episode_config = self.runner.episode
        self.n = n
        self.concurrency = concurrency
        self.max_staleness = max_staleness
        self.group_retries = group_retries
        self.max_failed_groups = max_failed_groups
        self._groups_at_once = math.ceil(concurrency / n) + 1
        self.max_buffered_groups = (
            max_buffered_groups if max_buffered_groups is not None else self._groups_at_once
        )
        default_counters = getattr(policy, "counters", None)
        self.counters: NonFiniteCounters = counters or (
            default_counters
            if isinstance(default_counters, NonFiniteCounters)
            else NonFiniteCounters()
        )
        self.admission = admission
        self.servers = servers if servers is not None else servers_of(policy)
        if self.servers is not None and policy_version > self.servers.version:
            self.servers.set_version(policy_version)  # weights synced by the caller
        self._version = max(policy_version, self.servers.version if self.servers is not None else 0)
        self._admission: Admission | None = None
        # fast_acquire: a free slot is taken without a trip through the event loop (beside a
        # busy server one trip can take tens of ms); a freed slot still goes to the first waiter.
        self._limiter = anyio.Semaphore(concurrency, fast_acquire=True)
        self._run_id = secrets.token_hex(4)
        self._started: float | None = None
        self._tally = Tally()
        self._active = False
        self._closed = False

    # -- state ------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of the policy's weights now (recorded on every turn)."""
        if self.servers is not None:
            return self.servers.version
        return self._version

    def set_policy_version(self, version: int) -> None:
        """Record a weight update made by someone else (the trainer's own sync): turns sent
        from now on carry ``version``."""
        if version < self.policy_version:
            raise ValueError(f"policy versions only go up ({self.policy_version} -> {version})")
        if self.servers is not None:
            self.servers.set_version(version)
        self._moved(version)

    def _moved(self, version: int) -> None:
        moved = version != self._version
        self._version = version
        if moved and self._admission is not None:
            self._admission.updated()

    async def update_weights(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        version: int | None = None,
        in_flight: InFlight = "drain",
    ) -> UpdateReport:
        """Load ``checkpoint`` (a Hugging Face model directory) into every policy server and
        move to ``version`` (default: the current one + 1).

        ``in_flight`` says what happens to the turns being sampled: ``drain`` (they finish
        on the old weights; new turns wait), ``abort`` (they are aborted and sampled again
        on the new weights), ``continue`` (they go on, on the new weights; such a turn
        records both versions in ``turn_versions``). See
        :meth:`PolicyServers.update_weights <agent_backend.rollout.servers.PolicyServers.update_weights>`.
        Raises :class:`RolloutError` without policy servers (a policy of another kind, or
        Ray workers: each worker has its own clients).
        """
        if self.servers is None:
            raise RolloutError(
                "update_weights needs the policy servers: a policy over PolicyServers "
                "(OpenAICompatiblePolicy, VLLMTokenSampler) or RolloutPool(servers=...); "
                "with weights synced another way, call set_policy_version()"
            )
        report = await self.servers.update_weights(
            os.fspath(checkpoint), version=version, in_flight=in_flight
        )
        self._moved(report.version)
        return report

    async def restore_weights(self, checkpoint: str | os.PathLike[str], *, version: int) -> None:
        """After a resume: load the trainer's restored ``checkpoint`` into the policy servers
        and serve it as ``version`` (the step of the ledger's checkpoint), below the servers'
        version if the crashed run went further. Call before :meth:`stream`."""
        if self.servers is None:
            raise RolloutError("restore_weights needs the policy servers (see update_weights)")
        if self._active:
            raise RolloutError("restore_weights is for before a run, not during one")
        report = await self.servers.restore(os.fspath(checkpoint), version=version)
        self._version = report.version

    def update_weights_from_thread(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        version: int | None = None,
        in_flight: InFlight = "drain",
    ) -> UpdateReport:
        """:meth:`update_weights` from a worker thread of the pool's event loop (a trainer
        step run with ``anyio.to_thread.run_sync``, or a thread of a blocking portal)."""
        return anyio.from_thread.run(
            functools.partial(self.update_weights, checkpoint, version=version, in_flight=in_flight)
        )

    def statistics(self) -> RolloutStatistics:
        elapsed = 0.0 if self._started is None else time.perf_counter() - self._started
        return self._tally.statistics(
            elapsed=elapsed, non_finite=self.counters.snapshot(), policy_version=self.policy_version
        )

    def __repr__(self) -> str:
        state = " closed" if self._closed else (" running" if self._active else "")
        t = self._tally
        return (
            f"<RolloutPool n={self.n} [episodes: {t.episodes_running} running,"
            f" {t.episodes_done} done, {t.episodes_failed} failed | groups:"
            f" {t.groups_delivered} delivered, {t.groups_dropped} dropped]"
            f" version={self.policy_version}{state}>"
        )

    async def aclose(self) -> None:
        """Refuse new runs; idempotent. (Runs end with their own ``run``/``stream`` scope.)"""
        self._closed = True

    def _begin(self, prompts: Sequence[Any], ledger: ResumeLedger) -> None:
        if self._closed:
            raise RolloutError("the rollout pool is closed")
        if self._active:
            raise RolloutError("the rollout pool is already running (one run or stream at a time)")
        if ledger.num_prompts is not None and ledger.num_prompts != len(prompts):
            raise RolloutError(
                f"the ledger {ledger.path} is for {ledger.num_prompts} prompts, "
                f"and {len(prompts)} were given"
            )
        self._active = True
        if self._started is None:
            self._started = time.perf_counter()

    # -- sampling ---------------------------------------------------------------------------------

    def _stale(self, group: Group) -> str | None:
        """Why ``group`` is too old to deliver now, or None when it is fresh enough."""
        if self.max_staleness is None:
            return None
        version = self.policy_version
        lag = version - group.oldest_version
        if lag <= self.max_staleness:
            return None
        return (
            f"stale: sampled at policy version {group.oldest_version}, delivered at "
            f"{version} (max_staleness {self.max_staleness})"
        )

    async def _episode(
        self, run: Run, prompt: Any, index: int, sample: int, attempt: int
    ) -> Episode:
        group_id = f"{self._run_id}-p{index}" + (f"-a{attempt}" if attempt else "")
        ids = EpisodeIds(
            rollout_id=f"{group_id}-s{sample}",
            group_id=group_id,
            prompt_index=index,
            sample_idx=sample,
        )
        async with self._limiter:
            self._tally.episodes_running += 1
            try:
                episode = await self.runner.run(
                    prompt,
                    ids,
                    policy_version=lambda: self.policy_version,
                    by_reference=run.by_reference,
                )
            finally:
                self._tally.episodes_running -= 1
        self._tally.count(episode.summary)
        return episode

    async def _sample_group(self, run: Run, prompt: Any, index: int, attempt: int) -> Group:
        episodes: list[Episode | None] = [None] * self.n

        async def one(sample: int) -> None:
            episodes[sample] = await self._episode(run, prompt, index, sample, attempt)

        async with anyio.create_task_group() as group:
            for sample in range(self.n):
                group.start_soon(run.guard, one, sample)
        # A sample missing here failed its task, which cancelled the run: the group is not sent.
        return Group(index, [e for e in episodes if e is not None], attempts=attempt + 1)

    async def _run_group(
        self,
        run: Run,
        prompt: Any,
        index: int,
        seq: int,
        send: MemoryObjectSendStream[Group],
        slots: anyio.Semaphore,
    ) -> None:
        try:
            async with send:
                group = await self._sample_group(run, prompt, index, 0)
                for attempt in range(1, self.group_retries + 1):
                    if not group.all_failed():
                        break
                    group = await self._sample_group(run, prompt, index, attempt)
                group.seq = seq
                await send.send(group)
        finally:
            slots.release()

    async def _produce(self, run: Run, send: MemoryObjectSendStream[Group]) -> None:
        """Claim prompts as slots free up; each group samples in its own task."""
        slots = anyio.Semaphore(self._groups_at_once)
        async with send, anyio.create_task_group() as group:
            while True:
                # Every free slot is filled at once, without a trip through the event loop
                # per group: the episodes of a step start together, and their first
                # requests reach the server together, to be batched together.
                try:
                    slots.acquire_nowait()
                except anyio.WouldBlock:
                    await slots.acquire()
                admission = run.admission
                if admission is not None and not admission.room(self.policy_version):
                    self._tally.admission_waits += 1
                    while not admission.room(self.policy_version):
                        await admission.wait()
                claimed = run.ledger.claim(1)
                if not claimed:
                    slots.release()
                    break
                index = claimed[0]
                seq = admission.admit() if admission is not None else 0
                group.start_soon(
                    run.guard,
                    self._run_group,
                    run,
                    run.prompts[index],
                    index,
                    seq,
                    send.clone(),
                    slots,
                    name=f"rollout group {index}",
                )

    def _check_prompts(self, prompts: Sequence[Any]) -> None:
        for index, prompt in enumerate(prompts):
            try:
                prompt_messages(prompt)
            except ValueError as exc:
                raise RolloutError(f"prompt {index}: {exc}") from None

    # -- delivery to a writer ---------------------------------------------------------------------

    async def run(
        self,
        prompts: Sequence[Any],
        *,
        ledger: ResumeLedger,
        writer: TrajectoryWriter,
        on_group: Callable[[Sequence[Trajectory]], None] | None = None,
    ) -> RolloutStatistics:
        """Sample every pending prompt of ``ledger`` and write each group to ``writer``.

        Each delivered group is flushed (fsync), its prompt marked trained, and
        the ledger checkpointed with the writer's position under
        ``extra["writer_position"]`` (open the writer with ``truncate_to=`` it
        on resume; see :mod:`agent_backend.rollout.writers`). Stale groups are
        marked dropped and checkpointed too. ``on_group`` is called (in the
        event loop) with each delivered group, e.g. to update a progress bar.

        Returns the statistics at the end. Raises :class:`RolloutError` when
        ``max_failed_groups`` groups in a row failed, and whatever the writer
        or the ledger raise; the ledger stays consistent in every case (the
        prompts in flight are redone on resume).
        """
        self._check_prompts(prompts)
        self._begin(prompts, ledger)
        deferred: list[int] = []
        run = Run(prompts, ledger)
        try:
            send, receive = anyio.create_memory_object_stream[Group](self.max_buffered_groups)
            async with receive, anyio.create_task_group() as tasks:
                run.scope = tasks.cancel_scope
                tasks.start_soon(run.guard, self._produce, run, send, name="rollout producer")
                await run.guard(self._write_all, receive, ledger, writer, deferred, on_group)
        finally:
            self._active = False
            self._release(ledger, deferred)
        run.raise_first()
        return self.statistics()

    async def _write_all(
        self,
        receive: MemoryObjectReceiveStream[Group],
        ledger: ResumeLedger,
        writer: TrajectoryWriter,
        deferred: list[int],
        on_group: Callable[[Sequence[Trajectory]], None] | None,
    ) -> None:
        failed_in_a_row = 0
        async for group in receive:
            if group.all_failed():
                failed_in_a_row = self._defer(group, deferred, failed_in_a_row)
                continue
            failed_in_a_row = 0
            reason = self._drop_reason(group)
            records: list[Trajectory] = []
            if reason is not None:
                ledger.mark_dropped(group.index, reason)
                self._tally.groups_dropped += 1
                self._tally.groups_stale += reason.startswith("stale")
            else:
                records = group.deliverable()
                await anyio.to_thread.run_sync(writer.write_group, records)
                ledger.mark_trained([group.index])
                self._tally.groups_delivered += 1
            # Shielded: a group written and marked is also checkpointed, even on Ctrl-C
            # (a few milliseconds; otherwise it would be cut from the file and redone).
            with anyio.CancelScope(shield=True):
                await ledger.acheckpoint(extra={WRITER_POSITION: writer.position})
            if on_group is not None and records:
                on_group(records)

    def _drop_reason(self, group: Group) -> str | None:
        """Why ``group`` is dropped at delivery (``stale: ...`` or non-finite), or None."""
        stale = self._stale(group)
        if stale is not None:
            return stale
        if not group.deliverable():
            return "dropped: every rollout had non-finite logprobs"
        return None

    def _defer(self, group: Group, deferred: list[int], failed_in_a_row: int) -> int:
        self._tally.groups_failed += 1
        deferred.append(group.index)
        failed_in_a_row += 1
        if self.max_failed_groups is not None and failed_in_a_row >= self.max_failed_groups:
            first = group.episodes[0].summary
            raise RolloutError(
                f"{failed_in_a_row} groups in a row failed in every episode (each tried "
                f"{group.attempts} times); the last error: {first.stop_reason}: {first.error}"
            )
        return failed_in_a_row

    @staticmethod
    def _release(ledger: ResumeLedger, deferred: list[int]) -> None:
        """Give back the prompts this run claimed and did not finish: redone by a later run."""
        for index in ledger.in_flight():
            ledger.release(index)
        deferred.clear()

    # -- delivery to a trainer ------------------------------------------------------------------

    @overload
    def stream(
        self,
        prompts: Sequence[Any],
        *,
        ledger: ResumeLedger | None = None,
        groups_per_batch: int = 1,
        as_refs: Literal[False] = False,
    ) -> contextlib.AbstractAsyncContextManager[RolloutStream[Trajectory]]: ...

    @overload
    def stream(
        self,
        prompts: Sequence[Any],
        *,
        ledger: ResumeLedger | None = None,
        groups_per_batch: int = 1,
        as_refs: Literal[True],
    ) -> contextlib.AbstractAsyncContextManager[RolloutStream[ObjectRef[list[Trajectory]]]]: ...

    def stream(
        self,
        prompts: Sequence[Any],
        *,
        ledger: ResumeLedger | None = None,
        groups_per_batch: int = 1,
        as_refs: bool = False,
    ) -> contextlib.AbstractAsyncContextManager[RolloutStream[Any]]:
        """Batches of whole groups for a trainer.

        ::

            async with pool.stream(prompts, ledger=ledger, groups_per_batch=4) as batches:
                async for batch in batches:          # list[Trajectory]: 4 groups
                    train_on(batch)
                    await pool.update_weights(save(step))     # or set_policy_version(step)
                    batches.checkpoint(extra={"step": step})  # with the weights

        A batch's prompts are marked trained by ``batches.checkpoint()`` (or
        ``batches.mark_trained()``), else when the trainer asks for the next
        batch, or leaves the ``async with`` without an exception; a batch
        being trained when an exception ends the block stays in flight (and is
        redone after a resume). Staleness is checked when a group is put in a
        batch. The pool never checkpoints the ledger here: the trainer does,
        together with its weights, so that the two never disagree.

        ``as_refs=True`` (Ray workers only) makes each batch a list of Ray
        ``ObjectRef``, one per episode, each resolving to that episode's
        ``list[Trajectory]``: the records stay in Ray's object store, owned
        by this process, and are never fetched here; hand the refs to a
        trainer's Ray actor, which fetches them (``ray.get``). The bookkeeping is the
        same as for batches of records.
        """
        return self._stream(prompts, ledger, groups_per_batch, as_refs)

    async def collect(self, prompts: Sequence[Any]) -> list[Trajectory]:
        """Every record the groups of ``prompts`` deliver, in one list: one trainer step's worth.

        What a trainer that asks for a whole step at once (TRL's ``rollout_func``,
        SkyRL's ``generate``) needs; groups left or dropped simply have no
        records here (:func:`~agent_backend.rollout.trainers.episode_rows` makes
        rows of them). No ledger: the caller's trainer keeps its own position.
        """
        records: list[Trajectory] = []
        async with self.stream(prompts, groups_per_batch=max(1, len(prompts))) as batches:
            async for batch in batches:
                records.extend(batch)
        return records

    @contextlib.asynccontextmanager
    async def _stream(
        self,
        prompts: Sequence[Any],
        ledger: ResumeLedger | None,
        groups_per_batch: int,
        as_refs: bool,
    ) -> AsyncIterator[RolloutStream[Any]]:
        if groups_per_batch < 1:
            raise ValueError("groups_per_batch must be at least 1")
        if as_refs and not self.runner.supports_refs:
            raise ValueError(
                "batches by reference (as_refs=True) need Ray workers: RolloutPool(workers=...)"
            )
        self._check_prompts(prompts)
        if ledger is None:
            ledger = ResumeLedger(Path("<memory>"), num_prompts=len(prompts))
        self._begin(prompts, ledger)
        run = Run(prompts, ledger, by_reference=as_refs)
        if self.admission and self.max_staleness is not None:
            run.admission = Admission(self.max_staleness, groups_per_batch, self.policy_version)
        self._admission = run.admission
        # The trainer's own error, raised as itself after the task group (which would wrap it).
        trainer_error: BaseException | None = None
        try:
            send, receive = anyio.create_memory_object_stream[Group](self.max_buffered_groups)
            # The receiving end closes after the tasks ended, so a group being sent
            # at the end is cancelled, not refused (which would read as an error).
            async with receive, anyio.create_task_group() as tasks:
                run.scope = tasks.cancel_scope
                tasks.start_soon(run.guard, self._produce, run, send, name="rollout producer")
                stream: RolloutStream[Any] = RolloutStream(
                    self, receive, ledger, groups_per_batch, run.admission
                )
                try:
                    yield stream
                except BaseException as exc:
                    trainer_error = exc
                else:
                    stream._commit()
                tasks.cancel_scope.cancel()  # the trainer is done (or failed): stop sampling
        finally:
            self._active = False
            self._admission = None
            self._release(ledger, [])
        run.raise_first()  # a failed sampling task comes first: it is why the trainer was cancelled
        if trainer_error is not None:
            raise trainer_error


_Item = TypeVar("_Item")


class RolloutStream(Generic[_Item]):
    """The async iterator of :meth:`RolloutPool.stream`: batches of whole groups.

    A batch is a ``list[Trajectory]``, or with ``as_refs=True`` a list of
    ``ObjectRef``, one per episode, each resolving to its ``list[Trajectory]``.
    """

    def __init__(
        self,
        pool: RolloutPool,
        receive: MemoryObjectReceiveStream[Group],
        ledger: ResumeLedger,
        groups_per_batch: int,
        admission: Admission | None = None,
    ) -> None:
        self._pool = pool
        self._receive = receive
        self._admission = admission
        # Under admission, groups are delivered in the order they were admitted: those that
        # finished ahead of their turn wait here.
        self._early: dict[int, Group] = {}
        self._next_seq = 0
        self.ledger = ledger
        self._groups_per_batch = groups_per_batch
        self._taken: list[int] = []
        self._failed_in_a_row = 0
        self._deferred: list[int] = []
        self.batches = 0
        self.last_batch_records = 0
        """Records (segments) in the last batch: with refs, what its refs resolve to in all."""

    def __aiter__(self) -> Self:
        return self

    def mark_trained(self) -> None:
        """The trainer has trained on the last batch: mark its prompts trained now (else that
        happens when it asks for the next batch). Call before checkpointing the ledger with
        the weights that include it, or :meth:`checkpoint` does both."""
        self._commit()

    def checkpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """Mark the last batch trained and checkpoint the ledger with ``extra`` (blocking:
        a small file, fsynced). Call it where the trainer saves its weights, after training
        on the batch, so that a resume neither repeats it nor skips it."""
        self._commit()
        self.ledger.checkpoint(extra)

    async def acheckpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """:meth:`checkpoint` with the file written in a worker thread."""
        self._commit()
        await self.ledger.acheckpoint(extra)

    def _commit(self) -> None:
        """The trainer took the last batch: mark its prompts trained."""
        if self._taken:
            self.ledger.mark_trained(self._taken)
            self._pool._tally.groups_delivered += len(self._taken)
            self._taken = []

    async def _next_group(self) -> Group | None:
        """The next group to consider: as it finished, or under admission in admission order."""
        if self._admission is None:
            try:
                return await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return None
        while self._next_seq not in self._early:
            try:
                group = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if not self._early:
                    return None
                self._next_seq = min(self._early)  # a gap: a group cancelled with its run
                break
            self._early[group.seq] = group
        self._next_seq += 1
        return self._early.pop(self._next_seq - 1)

    async def __anext__(self) -> list[_Item]:
        self._commit()
        pool = self._pool
        admission = self._admission
        if admission is not None:
            admission.batch_asked()
        groups: list[Group] = []
        while len(groups) < self._groups_per_batch:
            group = await self._next_group()
            if group is None:
                break
            if group.all_failed():
                if admission is not None:
                    admission.waste()
                self._failed_in_a_row = pool._defer(group, self._deferred, self._failed_in_a_row)
                continue
            self._failed_in_a_row = 0
            reason = pool._drop_reason(group)
            if reason is not None:
                if admission is not None:
                    admission.waste()
                self.ledger.mark_dropped(group.index, reason)
                pool._tally.groups_dropped += 1
                pool._tally.groups_stale += reason.startswith("stale")
                continue
            groups.append(group)
        if not groups:
            raise StopAsyncIteration
        if admission is not None:
            admission.batch_taken()
        self._taken = [g.index for g in groups]
        self.batches += 1
        self.last_batch_records = sum(
            e.summary.records for g in groups for e in g.episodes if not e.summary.dropped
        )
        return [item for g in groups for item in g.deliverable()]
