"""How a rollout pool runs one episode: the :class:`EpisodeRunner` base and its two kinds.

:class:`~agent_backend.rollout.pool.RolloutPool` keeps the ledger, the
groups and the delivery; an episode runner runs each episode and hands back
an :class:`Episode`: the :class:`EpisodeSummary` the pool's bookkeeping
reads, and what a consumer gets (the records, or with batches by reference
one Ray ``ObjectRef`` to them).

* :class:`InProcessRunner`: :func:`~agent_backend.rollout.episode.run_episode`
  over a policy client and an open dispatcher, in this process.
* :class:`~agent_backend.rollout.ray_workers.RayRolloutWorkers`: episodes on
  Ray actors, records fetched here or left in Ray's object store.

This module must never import Ray nor :mod:`agent_backend.rollout.pool`: both
the pool and the Ray workers import it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from agent_backend.dispatch import Dispatcher
from agent_backend.rollout.episode import EpisodeConfig, EpisodeIds, RewardFunction, run_episode
from agent_backend.rollout.policy import Policy
from agent_backend.rollout.trajectory import Trajectory
from agent_backend.tools import ToolRegistry

__all__ = ["Episode", "EpisodeRunner", "EpisodeSummary", "InProcessRunner", "episode_runner"]


@dataclasses.dataclass(frozen=True, slots=True)
class EpisodeSummary:
    """What the pool's bookkeeping reads of a finished episode, without its records.

    Small and free of :class:`Trajectory` objects: with batches by reference,
    a Ray rollout worker returns it beside the records, which stay in Ray's
    object store, and the driver reads only this.
    """

    stop_reason: str
    error: str | None
    num_turns: int
    tool_calls: int
    tool_failures: int
    dropped: bool
    """Dropped for non-finite logprobs (the ``drop`` policy): counted, never delivered."""
    policy_version_start: int
    """The oldest ``policy_version_start`` of its records (what staleness is measured from)."""
    records: int
    """Its records (segments)."""
    history_rewrites: int = 0
    """Times its chat template rewrote history (chat mode): ``records - 1``."""

    @classmethod
    def of(cls, records: Sequence[Trajectory]) -> EpisodeSummary:
        first = records[0]
        return cls(
            stop_reason=first.stop_reason,
            error=first.error,
            num_turns=first.num_turns,
            tool_calls=first.tool_calls,
            tool_failures=first.tool_failures,
            dropped=bool(first.extras.get("dropped")),
            policy_version_start=min(t.policy_version_start for t in records),
            records=len(records),
            history_rewrites=int(first.extras.get("history_rewrites", 0)),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode, as a runner hands it to the pool."""

    summary: EpisodeSummary
    items: list[Any]
    """What a consumer gets of it: its records, or (by reference) one ObjectRef to them."""

    @classmethod
    def of(cls, records: list[Trajectory]) -> Episode:
        return cls(EpisodeSummary.of(records), records)


class EpisodeRunner(abc.ABC):
    """Runs the episodes of a :class:`~agent_backend.rollout.pool.RolloutPool`.

    A runner implements :meth:`records`, and :meth:`run_episode_by_reference` when it can
    leave the records in Ray's object store (``supports_refs``); :meth:`run`, what the
    pool calls, is the same for every runner.
    """

    episode: EpisodeConfig
    """The limits of each episode it runs."""
    supports_refs: ClassVar[bool] = False
    """True when it can leave the records in Ray's object store (``by_reference``)."""

    async def run(
        self,
        prompt: Any,
        ids: EpisodeIds,
        *,
        policy_version: Callable[[], int],
        by_reference: bool = False,
    ) -> Episode:
        """One episode of ``prompt``, failed or not (a failure is a record, never raised but
        for what must stop the run). ``policy_version`` reads the version now."""
        if not by_reference:
            return Episode.of(await self.records(prompt, ids, policy_version))
        if not self.supports_refs:
            raise ValueError(f"{type(self).__name__} has no records by reference")
        summary, ref = await self.run_episode_by_reference(prompt, ids, policy_version())
        return Episode(summary, [ref])

    @abc.abstractmethod
    async def records(
        self, prompt: Any, ids: EpisodeIds, policy_version: Callable[[], int]
    ) -> list[Trajectory]:
        """One episode's records, in this process."""

    async def run_episode_by_reference(
        self, prompt: Any, ids: EpisodeIds, version: int
    ) -> tuple[EpisodeSummary, Any]:
        """One episode sampled at policy ``version``: its summary, and one Ray ``ObjectRef``
        to its records (only where ``supports_refs``)."""
        raise NotImplementedError


class InProcessRunner(EpisodeRunner):
    """Episodes in this process: ``policy`` samples the turns, ``dispatcher`` (open) runs the
    tools, one session per episode; ``tools`` are the tools offered (default: the
    dispatcher's registry)."""

    def __init__(
        self,
        policy: Policy,
        dispatcher: Dispatcher,
        *,
        tools: ToolRegistry | Sequence[Mapping[str, Any]] | None = None,
        reward: RewardFunction | None = None,
        episode: EpisodeConfig | None = None,
    ) -> None:
        self.policy = policy
        self.dispatcher = dispatcher
        registry = tools if tools is not None else dispatcher.registry
        self.tools = (
            registry.to_openai()
            if isinstance(registry, ToolRegistry)
            else [dict(t) for t in registry]
        )
        self.reward = reward
        self.episode = episode or EpisodeConfig()

    async def records(
        self, prompt: Any, ids: EpisodeIds, policy_version: Callable[[], int]
    ) -> list[Trajectory]:
        return await run_episode(
            prompt,
            policy=self.policy,
            dispatcher=self.dispatcher,
            tools=self.tools,
            reward=self.reward,
            config=self.episode,
            ids=ids,
            policy_version=policy_version,
        )


def episode_runner(
    policy: Policy | None,
    dispatcher: Dispatcher | None,
    *,
    workers: EpisodeRunner | None,
    tools: ToolRegistry | Sequence[Mapping[str, Any]] | None,
    reward: RewardFunction | None,
    episode: EpisodeConfig | None,
) -> EpisodeRunner:
    """``workers`` when given (then the rest belongs to them and must not be given), else an
    :class:`InProcessRunner` over ``policy`` and ``dispatcher``; ValueError on a mix-up."""
    if workers is None:
        if policy is None or dispatcher is None:
            raise ValueError("a RolloutPool needs a policy and a dispatcher, or Ray workers")
        return InProcessRunner(policy, dispatcher, tools=tools, reward=reward, episode=episode)
    given = [
        name
        for name, value in (
            ("policy", policy),
            ("dispatcher", dispatcher),
            ("tools", tools),
            ("reward", reward),
            ("episode", episode),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"with Ray workers, {', '.join(given)} belong to the workers "
            "(RayRolloutWorkers(...)), not to the pool"
        )
    return workers
