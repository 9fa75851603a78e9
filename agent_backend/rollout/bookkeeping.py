"""What a rollout pool counts and carries: its statistics, a sampled group, one run's errors.

Plain data and synchronous bookkeeping for :mod:`agent_backend.rollout.pool`
(which re-exports :class:`RolloutStatistics` and :data:`FAILED_STOP_REASONS`):
the :class:`Tally` of episodes and groups, a :class:`Group` of episodes as
sampled, and the :class:`Run` that keeps the first failure of a run's tasks.
This module must never do I/O nor import Ray.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import anyio

from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.logprobs import NonFiniteStats
from agent_backend.rollout.runner import Episode, EpisodeSummary

__all__ = [
    "FAILED_STOP_REASONS",
    "INFRA_FAILURES",
    "Admission",
    "Group",
    "RolloutStatistics",
    "Run",
    "Tally",
]

#: Stop reasons of episodes that failed (the others ended as the policy or a limit decided).
FAILED_STOP_REASONS: Final[frozenset[str]] = frozenset(
    {"timeout", "tool_error", "env_error", "rollout_error"}
)
#: Stop reasons that are the infrastructure's failures: a group made only of these carries no
#: learning signal.
INFRA_FAILURES: Final[frozenset[str]] = frozenset({"env_error", "rollout_error"})


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutStatistics:
    """What a pool did so far (a snapshot: :meth:`RolloutPool.statistics`)."""

    episodes_done: int
    """Episodes finished, whatever their stop reason."""
    episodes_failed: int
    """Of those, episodes that failed (timeout, tool_error, env_error, rollout_error)."""
    episodes_running: int
    groups_delivered: int
    """Groups taken durably by the writer or the trainer (their prompts are trained)."""
    groups_dropped: int
    """Groups dropped at delivery, as stale or with every rollout dropped (their prompts are
    dropped, never trained)."""
    groups_failed: int
    """Groups whose every episode failed, even after retries: left for a later run."""
    rollouts_dropped: int
    """Episodes dropped for non-finite logprobs (the ``drop`` policy); not delivered."""
    turns: int
    tool_calls: int
    tool_failures: int
    elapsed: float
    """Seconds since the first run or stream of this pool started (0 before)."""
    stop_reasons: Mapping[str, int]
    non_finite: NonFiniteStats
    policy_version: int
    history_rewrites: int = 0
    """Times a chat template re-rendered history differently from what was sampled (chat
    mode; each started a new segment). Token-in/token-out runs have none."""
    episodes_split: int = 0
    """Episodes that came back as more than one record because of those rewrites."""
    groups_stale: int = 0
    """Of ``groups_dropped``, those dropped as older than ``max_staleness``: sampled for
    nothing (admission by staleness keeps this at 0)."""
    admission_waits: int = 0
    """Times a group waited for the trainer's next weights before it was started."""

    @property
    def tool_calls_per_second(self) -> float:
        return self.tool_calls / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def episodes_per_second(self) -> float:
        return self.episodes_done / self.elapsed if self.elapsed > 0 else 0.0


@dataclasses.dataclass(slots=True)
class Tally:
    """The pool's running counts, named as :class:`RolloutStatistics` reports them."""

    episodes_done: int = 0
    episodes_failed: int = 0
    episodes_running: int = 0
    groups_delivered: int = 0
    groups_dropped: int = 0
    groups_failed: int = 0
    rollouts_dropped: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    stop_reasons: Counter[str] = dataclasses.field(default_factory=Counter)
    history_rewrites: int = 0
    episodes_split: int = 0
    groups_stale: int = 0
    admission_waits: int = 0

    def count(self, summary: EpisodeSummary) -> None:
        """An episode ended."""
        self.episodes_done += 1
        self.turns += summary.num_turns
        self.tool_calls += summary.tool_calls
        self.tool_failures += summary.tool_failures
        self.stop_reasons[summary.stop_reason] += 1
        if summary.history_rewrites:
            self.history_rewrites += summary.history_rewrites
            self.episodes_split += 1
        if summary.stop_reason in FAILED_STOP_REASONS:
            self.episodes_failed += 1
        if summary.dropped:
            self.rollouts_dropped += 1

    def statistics(
        self, *, elapsed: float, non_finite: NonFiniteStats, policy_version: int
    ) -> RolloutStatistics:
        counts = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        counts["stop_reasons"] = dict(self.stop_reasons)
        return RolloutStatistics(
            **counts, elapsed=elapsed, non_finite=non_finite, policy_version=policy_version
        )


@dataclasses.dataclass(slots=True)
class Group:
    index: int
    episodes: list[Episode]
    attempts: int
    seq: int = 0
    """The order in which the group was admitted (its place in delivery, under admission)."""

    @property
    def oldest_version(self) -> int:
        return min((e.summary.policy_version_start for e in self.episodes), default=0)

    def all_failed(self) -> bool:
        return bool(self.episodes) and all(
            e.summary.stop_reason in INFRA_FAILURES and not e.summary.dropped for e in self.episodes
        )

    def deliverable(self) -> list[Any]:
        """What to deliver: every episode's records (or refs) but those dropped for non-finite
        logprobs."""
        return [item for e in self.episodes if not e.summary.dropped for item in e.items]


class Run:
    """One run or stream: its prompts and ledger, and the first failure of any of its tasks.

    A task that fails records its error and cancels the whole run (every task
    is started through :meth:`guard`), so the error comes out of ``run()`` or
    ``stream()`` as itself, not wrapped in nested exception groups.
    """

    def __init__(
        self, prompts: Sequence[Any], ledger: ResumeLedger, *, by_reference: bool = False
    ) -> None:
        self.prompts = prompts
        self.ledger = ledger
        self.by_reference = by_reference
        self.scope: anyio.CancelScope | None = None
        self.errors: list[Exception] = []
        self.admission: Admission | None = None
        """Staleness at admission, for a stream with ``max_staleness`` (None: none)."""

    async def guard(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            await function(*args)
        except Exception as exc:
            self.errors.append(exc)
            if self.scope is not None:
                self.scope.cancel()

    def raise_first(self) -> None:
        if self.errors:
            first = self.errors[0]
            if len(self.errors) > 1:
                first.add_note(f"{len(self.errors) - 1} more error(s) ended this run too")
            raise first


class Admission:
    """Staleness at admission: a group is started only if it will be trained within
    ``max_staleness`` policy versions of the weights that sample it.

    The trainer takes batches of ``groups_per_batch`` groups, in the order the groups were
    admitted (:attr:`Group.seq`), and moves the policy at most one version per batch (an
    update after training on it). Batch ``j`` of the stream is then taken at version at most
    ``base + j - skipped`` (``skipped``: batches asked for with no update since the one
    before). A group admitted at version ``v = base + u`` as the ``i``-th group that takes
    a place in a batch lands in batch ``i // groups_per_batch``; admitting only while
    ``i < (u + skipped + max_staleness + 1) * groups_per_batch`` keeps its lag at most
    ``max_staleness``. Wasted groups (failed in every episode, dropped) take no place.
    """

    def __init__(self, max_staleness: int, groups_per_batch: int, base: int) -> None:
        self.max_staleness = max_staleness
        self.groups_per_batch = groups_per_batch
        self.base = base
        self.admitted = 0
        self.wasted = 0
        self.skipped = 0
        self.batches = 0
        self._updated = False
        self._changed = anyio.Event()

    def room(self, version: int) -> bool:
        versions_ahead = version - self.base + self.skipped + self.max_staleness + 1
        return self.admitted - self.wasted < versions_ahead * self.groups_per_batch

    def admit(self) -> int:
        """Take a place; the group's ``seq``."""
        seq = self.admitted
        self.admitted += 1
        return seq

    def waste(self) -> None:
        """A group admitted will take no place in a batch."""
        self.wasted += 1
        self.changed()

    def updated(self) -> None:
        """The policy moved to a new version."""
        self._updated = True
        self.changed()

    def batch_asked(self) -> None:
        """The trainer asks for its next batch (called before the batch is formed)."""
        if self.batches and not self._updated:
            self.skipped += 1  # trained on the last batch without moving the weights
            self.changed()

    def batch_taken(self) -> None:
        self.batches += 1
        self._updated = False

    def changed(self) -> None:
        """The version moved or a place freed: wake the producer."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait(self) -> None:
        await self._changed.wait()
