"""One episode: the policy proposes tool calls, tools run, results go back, a reward scores it.

:func:`run_episode` takes the prompt's messages, a :class:`~agent_backend.rollout.policy.Policy`
and a :class:`~agent_backend.dispatch.Dispatcher`, and runs turns until the
policy answers without tool calls, ``max_turns``, the token budget or the
episode's timeout. Every tool call of the episode runs in **one session**
(its own workspace on one host), opened at the start and closed on every
way out: normal end, failure, timeout and cancellation (an error that skips
cleanup leaks a sandbox per episode). Tool
results, and the model-facing errors of bad calls, go back to the policy as
``tool`` messages.

The reward is a Python callable (sync, run in a worker thread, or async)
that gets a :class:`RewardInput`, the episode's open session included, so it
can run the tests in the workspace; :class:`ToolReward` is such a callable
that runs one tool call there and scores its result.

The episode is assembled into :class:`~agent_backend.rollout.trajectory.Trajectory`
records by a :class:`~agent_backend.rollout.trajectory.SegmentBuilder`: the
mask is 1 only on tokens the policy sampled; tool output and template
tokens come from the next turn's prompt ids, masked 0. With a chat-completions
policy, a chat template that rewrites history starts a new segment (one more
record, counted in ``extras["history_rewrites"]``); a
:class:`~agent_backend.rollout.tokens.TokenPolicy` (token in, token out) never
re-renders history, so its episodes have one record, always.

Failures are data: a policy, tool, environment or reward failure ends the
episode with ``stop_reason`` ``rollout_error``, ``tool_error``, ``env_error``
or ``timeout`` and ``error`` set; :func:`run_episode` never raises for them.
What it does raise: cancellation from outside (the session is still closed),
and :class:`~agent_backend.errors.NonFiniteLogprobs` when the policy's
non-finite policy is ``fail`` (asked for explicitly: the run must stop).

``timing`` holds the seconds spent in the policy (``policy``), in tool calls
(``tools``), opening and closing the session (``env``), in the reward
(``reward``), and in all (``total``); what ``total`` has beyond the others
is the rollout layer's own overhead (bench/rollout_bench.py measures it).

This module must never leave a session open, never raise for a failed
episode, and never put a token the policy did not sample under mask 1.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

import anyio
import anyio.to_thread

from agent_backend.dispatch import CallLike, Dispatcher, Session, ToolResult
from agent_backend.errors import (
    AgentBackendError,
    BackendError,
    NonFiniteLogprobs,
    PolicyError,
    RolloutError,
    ToolFailed,
    ToolTimeout,
    clip,
)
from agent_backend.rollout import defaults
from agent_backend.rollout.policy import AssistantTurn, Policy
from agent_backend.rollout.trajectory import SegmentBuilder, StopReason, Trajectory
from agent_backend.tools import ToolCall, ToolRegistry, call_function

__all__ = [
    "EpisodeConfig",
    "EpisodeIds",
    "RewardFunction",
    "RewardInput",
    "RewardValue",
    "ToolReward",
    "prompt_messages",
    "run_episode",
]

logger = logging.getLogger("agent_backend.rollout")

_ERROR_LIMIT = 2000
#: Stop reasons after which the reward is computed; the others are failures (reward: failure_reward).
_SCORED: frozenset[str] = frozenset({"stop", "length", "max_turns"})

RewardValue: TypeAlias = float | Mapping[str, float]
"""A reward: one number, or named components (the reward is then their sum)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EpisodeConfig:
    """Limits of one episode (all keyword, all optional)."""

    max_turns: int = defaults.MAX_TURNS
    """Policy turns at most; tool calls of the last turn are not run (nobody would read them)."""
    max_tokens_per_turn: int | None = None
    """Tokens one turn may sample (the policy's own limit applies too)."""
    max_total_tokens: int | None = None
    """Token budget of the episode: prompt + completion (tool output included) of a segment."""
    timeout: float | None = defaults.EPISODE_TIMEOUT
    """Seconds the whole episode may take (policy, tools, reward); None: no limit."""
    tool_timeout: float | None = None
    """Seconds one tool call may take (None: the tool's or the dispatcher's default)."""
    max_tool_failures: int | None = None
    """End the episode with ``tool_error`` after this many failed tool results in a row."""
    parallel_tool_calls: bool = True
    """Run the calls of one turn concurrently (results stay in call order)."""
    reward_timeout: float | None = defaults.REWARD_TIMEOUT
    """Seconds the reward may take."""
    failure_reward: float = 0.0
    """The reward of an episode that failed (timeout, tool_error, env_error, rollout_error)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        for name in ("timeout", "tool_timeout", "reward_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive (or None)")
        if not math.isfinite(self.failure_reward):
            raise ValueError("failure_reward must be finite")


@dataclasses.dataclass(frozen=True, slots=True)
class EpisodeIds:
    """Where an episode belongs: its ids in the trajectory records."""

    rollout_id: str
    group_id: str
    prompt_index: int = 0
    sample_idx: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class RewardInput:
    """What a reward function sees of a finished episode."""

    prompt: Any
    """The prompt as given to :func:`run_episode` (a dataset row keeps its other fields: answer...)."""
    messages: list[dict[str, Any]]
    """The whole conversation, final assistant message included."""
    final_text: str
    """The prose of the last assistant turn."""
    stop_reason: StopReason
    num_turns: int
    tool_calls: int
    tool_failures: int
    session: Session
    """The episode's session, still open: run checks in its workspace."""


RewardFunction: TypeAlias = Callable[[RewardInput], RewardValue | Awaitable[RewardValue]]


class ToolReward:
    """A reward that runs one tool call in the episode's session and scores its result.

    ``ToolReward(("exec", {"command": "python -m pytest -q"}))`` gives 1.0 when
    the call succeeds (exit status 0) and 0.0 otherwise; pass ``score`` to read
    something else from the :class:`~agent_backend.dispatch.ToolResult`.
    """

    def __init__(
        self,
        call: CallLike,
        *,
        score: Callable[[ToolResult], RewardValue] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.call = call
        self.score = score or (lambda result: 1.0 if result.ok else 0.0)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<ToolReward {clip(repr(self.call), 80)}>"

    async def __call__(self, episode: RewardInput) -> RewardValue:
        result = await episode.session.call(self.call, timeout=self.timeout)
        return self.score(result)


def prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    """The messages of a prompt: a list of messages, ``{"messages": [...]}``, or ``{"prompt": ...}``.

    ``{"prompt": "text"}`` is one user message. Raises ``ValueError`` for anything else.
    """
    if isinstance(prompt, Mapping):
        if "messages" in prompt:
            prompt = prompt["messages"]
        elif isinstance(prompt.get("prompt"), str):
            return [{"role": "user", "content": prompt["prompt"]}]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, Sequence)
        and prompt
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in prompt)
    ):
        return [dict(m) for m in prompt]
    raise ValueError(
        "a prompt is a list of chat messages, {'messages': [...]} or {'prompt': 'text'}; "
        f"got {clip(repr(prompt), 120)}"
    )


def _error_text(exc: BaseException) -> str:
    return clip(f"{type(exc).__name__}: {exc}", _ERROR_LIMIT)


def _classify(exc: Exception) -> StopReason:
    """The stop reason of an exception that ended an episode."""
    if isinstance(exc, (ToolTimeout, ToolFailed)):
        return "tool_error"  # the tool's backend stuck or the tool itself raised
    if isinstance(exc, (RolloutError, PolicyError)):
        return "rollout_error"
    if isinstance(exc, (BackendError, AgentBackendError)):
        return "env_error"  # no host, lost worker, closed or reaped session, bad config
    return "rollout_error"  # a bug here or in a reward function: recorded, logged


def _reward_value(value: Any) -> tuple[float, dict[str, float]]:
    if isinstance(value, Mapping):
        rewards = {str(k): float(v) for k, v in value.items()}
        total = math.fsum(rewards.values())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        rewards, total = {}, float(value)
    else:
        raise TypeError(f"a reward is a number or a mapping of numbers, not {type(value).__name__}")
    if not math.isfinite(total) or not all(math.isfinite(v) for v in rewards.values()):
        raise ValueError(f"the reward is not finite: {value!r}")
    return total, rewards


class _Episode:
    """The mutable state of one running episode (plain data; :func:`run_episode` drives it)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.builder = SegmentBuilder()
        self.turns = 0
        self.tool_calls = 0
        self.tool_failures = 0
        self.failures_in_a_row = 0
        self.non_finite = 0
        self.finish_reasons: list[str] = []
        self.final_text = ""
        self.stop_reason: StopReason | None = None
        self.error: str | None = None
        self.dropped = False
        self.policy_time = 0.0
        self.tool_time = 0.0
        self.env_time = 0.0
        self.reward_time = 0.0
        self.version_end: int | None = None
        self.version_first: int | None = None
        self.last_versions: tuple[int, int] | None = None
        self.host: str | None = None
        self.hosts: dict[str, str] = {}

    def stop(self, reason: StopReason, error: str | None = None) -> None:
        if self.stop_reason is None:  # the first reason wins
            self.stop_reason = reason
            self.error = error

    def fail(self, reason: StopReason, error: str) -> None:
        """A failure overrides how the turns ended (a reward that raised after a clean stop)."""
        self.stop_reason = reason
        self.error = error


async def run_episode(
    prompt: Any,
    *,
    policy: Policy,
    dispatcher: Dispatcher,
    tools: ToolRegistry | Sequence[Mapping[str, Any]] | None = None,
    reward: RewardFunction | None = None,
    config: EpisodeConfig | None = None,
    ids: EpisodeIds | None = None,
    policy_version: Callable[[], int] | None = None,
    session: Session | None = None,
) -> list[Trajectory]:
    """Run one episode; its trajectory records (one per segment), failed or not.

    Args:
        prompt: the prompt's messages, or a dataset row holding them
            (:func:`prompt_messages`); the row is passed on to the reward.
        policy: samples the assistant turns; a :class:`~agent_backend.rollout.tokens.TokenPolicy`
            gets one token stream per episode (``for_episode()``).
        dispatcher: an open dispatcher; the episode's session is opened on it.
        tools: the tools the policy is offered: a registry (default: the
            dispatcher's) or OpenAI tool dicts (compute them once for many episodes).
        reward: scores a finished episode (see :class:`RewardInput`); None: 0.0.
        config: limits (:class:`EpisodeConfig`).
        ids: the ids written into the records (default: fresh ones).
        policy_version: the current policy (weights) version, read at the start
            and after each turn (default: always 0).
        session: the episode's session, open, of ``dispatcher`` (a fork of a
            prepared one: ``await prepared.fork(n)`` starts a group's episodes
            from one workspace); closed when the episode ends, as one opened
            here would be. None: a new session.
    """
    config = config or EpisodeConfig()
    for_episode = getattr(policy, "for_episode", None)
    if callable(for_episode):
        # This episode's own view: its token stream (TokenPolicy), its server (both kinds).
        policy = for_episode()
    if ids is None:
        import secrets

        token = secrets.token_hex(6)
        ids = EpisodeIds(rollout_id=f"r-{token}", group_id=f"g-{token}")
    version = policy_version or (lambda: 0)
    started = time.perf_counter()
    version_start = version()
    try:
        messages = prompt_messages(prompt)
    except ValueError as exc:
        episode = _Episode([])
        episode.stop("rollout_error", _error_text(exc))
        return _build(episode, ids, version_start, 0.0, {}, started, config)
    if tools is None:
        tools = dispatcher.registry
    schema = tools.to_openai() if isinstance(tools, ToolRegistry) else [dict(t) for t in tools]
    episode = _Episode(messages)
    reward_total: float = config.failure_reward
    rewards: dict[str, float] = {}
    try:
        if session is None:
            session = dispatcher.session()
        opened = time.perf_counter()
        try:
            if not session.is_open():
                await session.open()
        finally:
            episode.env_time += time.perf_counter() - opened
        try:
            with anyio.move_on_after(config.timeout) as deadline:
                await _turns(episode, policy, session, schema, config, version)
                if reward is not None and episode.stop_reason in _SCORED:
                    reward_total, rewards = await _score(episode, reward, prompt, session, config)
                elif reward is None and episode.stop_reason in _SCORED:
                    reward_total = 0.0
            if deadline.cancelled_caught:
                episode.stop("timeout", f"the episode did not finish within {config.timeout:g} s")
                reward_total, rewards = config.failure_reward, {}
        finally:
            # Where the episode ran, pool by pool (on several pools, a workspace is made on
            # the first call routed to it, so it is known only now).
            episode.hosts = {pool: host for pool, (host, _) in session.workspaces().items()}
            episode.host = session.host.name if session.host is not None else None
            closing = time.perf_counter()
            await session.aclose()  # idempotent, shielded inside: also on cancellation
            episode.env_time += time.perf_counter() - closing
    except NonFiniteLogprobs:
        raise  # the "fail" policy: the run must stop, not record and go on
    except Exception as exc:
        kind = _classify(exc)
        if kind == "rollout_error" and not isinstance(exc, AgentBackendError):
            logger.warning("episode %s failed", ids.rollout_id, exc_info=True)
        episode.fail(kind, _error_text(exc))
        reward_total, rewards = config.failure_reward, {}
    if episode.stop_reason not in _SCORED:
        reward_total, rewards = config.failure_reward, {}
    return _build(episode, ids, version_start, reward_total, rewards, started, config)


async def _turns(
    episode: _Episode,
    policy: Policy,
    session: Session,
    schema: list[dict[str, Any]],
    config: EpisodeConfig,
    version: Callable[[], int],
) -> None:
    budget = config.max_total_tokens
    while True:
        max_tokens = config.max_tokens_per_turn
        if budget is not None:
            remaining = budget - episode.builder.context_tokens
            if remaining <= 0:
                episode.stop("length", None)
                return
            max_tokens = remaining if max_tokens is None else min(max_tokens, remaining)
        began = time.perf_counter()
        sent = version()
        try:
            turn = await policy.generate(episode.messages, schema, max_tokens=max_tokens)
        finally:
            episode.policy_time += time.perf_counter() - began
        # The versions the policy's servers saw when they sampled it; a policy that does not
        # know them: the pool's version when the turn was asked for and when it came.
        versions = turn.versions
        if versions is None:
            last = episode.last_versions
            # A policy that gave versions before and none now (a turn it did not sample,
            # such as an empty one at the length limit): its last answered version.
            versions = (last[1], last[1]) if last is not None else (sent, version())
        else:
            episode.last_versions = versions
        episode.version_end = (
            versions[1] if episode.version_end is None else max(episode.version_end, versions[1])
        )
        episode.version_first = (
            versions[0]
            if episode.version_first is None
            else (min(episode.version_first, versions[0]))
        )
        _record_turn(episode, turn, versions)
        if turn.drop_error is not None:
            episode.dropped = True
            episode.stop("rollout_error", turn.drop_error)
            return
        if budget is not None and episode.builder.context_tokens >= budget:
            episode.stop("length", None)
            return
        if turn.finish_reason == "length":
            episode.stop("length", None)  # cut off: its calls (if any) are incomplete
            return
        if not turn.tool_calls:
            episode.stop("stop", None)
            return
        if episode.turns >= config.max_turns:
            episode.stop("max_turns", None)
            return
        await _run_tools(episode, session, turn.tool_calls, config)
        if (
            config.max_tool_failures is not None
            and episode.failures_in_a_row >= config.max_tool_failures
        ):
            episode.stop(
                "tool_error",
                f"{episode.failures_in_a_row} tool calls in a row failed "
                f"(max_tool_failures={config.max_tool_failures})",
            )
            return


def _record_turn(episode: _Episode, turn: AssistantTurn, versions: tuple[int, int]) -> None:
    episode.builder.add_turn(
        turn.prompt_ids, turn.completion_ids, turn.logprobs, mask=turn.mask, versions=versions
    )
    episode.messages.append(turn.message)
    episode.turns += 1
    episode.non_finite += turn.non_finite
    episode.finish_reasons.append(turn.finish_reason)
    episode.final_text = turn.text


async def _run_tools(
    episode: _Episode, session: Session, calls: Sequence[ToolCall], config: EpisodeConfig
) -> None:
    began = time.perf_counter()
    try:
        if config.parallel_tool_calls and len(calls) > 1:
            results = await session.call_many(calls, timeout=config.tool_timeout)
        else:
            results = [await session.call(call, timeout=config.tool_timeout) for call in calls]
    finally:
        episode.tool_time += time.perf_counter() - began
    for call, result in zip(calls, results, strict=True):
        episode.messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "name": call.name,
                "content": result.to_model_message(),
            }
        )
        episode.tool_calls += 1
        if result.ok:
            episode.failures_in_a_row = 0
        else:
            episode.tool_failures += 1
            episode.failures_in_a_row += 1


async def _score(
    episode: _Episode,
    reward: RewardFunction,
    prompt: Any,
    session: Session,
    config: EpisodeConfig,
) -> tuple[float, dict[str, float]]:
    assert episode.stop_reason is not None
    given = RewardInput(
        prompt=prompt,
        messages=episode.messages,
        final_text=episode.final_text,
        stop_reason=episode.stop_reason,
        num_turns=episode.turns,
        tool_calls=episode.tool_calls,
        tool_failures=episode.tool_failures,
        session=session,
    )
    began = time.perf_counter()
    try:
        with anyio.fail_after(config.reward_timeout):
            # Awaited, or in a worker thread abandoned at the timeout (a thread cannot be killed).
            value = await call_function(reward, (given,))
    except TimeoutError:
        raise RolloutError(
            f"the reward did not finish within {config.reward_timeout:g} s"
        ) from None
    except AgentBackendError:
        raise  # the environment (a reward tool's session or host) failed: env_error
    except Exception as exc:
        raise RolloutError(f"the reward function raised {_error_text(exc)}") from exc
    finally:
        episode.reward_time += time.perf_counter() - began
    try:
        return _reward_value(value)
    except (TypeError, ValueError) as exc:
        raise RolloutError(f"bad reward: {exc}") from None


def _build(
    episode: _Episode,
    ids: EpisodeIds,
    version_start: int,
    reward: float,
    rewards: dict[str, float],
    started: float,
    config: EpisodeConfig,
) -> list[Trajectory]:
    if episode.stop_reason is None:  # defensive: every path sets one
        episode.stop("rollout_error", "the episode ended without a stop reason")
    assert episode.stop_reason is not None
    timing = {
        "policy": episode.policy_time,
        "tools": episode.tool_time,
        "env": episode.env_time,
        "reward": episode.reward_time,
        "total": time.perf_counter() - started,
    }
    extras: dict[str, Any] = {"finish_reasons": episode.finish_reasons}
    if episode.builder.rewrites:
        extras["history_rewrites"] = episode.builder.rewrites
    if episode.non_finite:
        extras["non_finite_logprobs"] = episode.non_finite
    if episode.dropped:
        extras["dropped"] = True
    if episode.host is not None:
        extras["host"] = episode.host
    if len(episode.hosts) > 1 or (episode.hosts and episode.host is None):
        extras["hosts"] = episode.hosts  # pool name -> host, when not all on the default pool
    if episode.version_first is not None:  # the weights of the first sampled token
        version_start = episode.version_first
    version_end = episode.version_end if episode.version_end is not None else version_start
    fields: dict[str, Any] = {
        "rollout_id": ids.rollout_id,
        "group_id": ids.group_id,
        "sample_idx": ids.sample_idx,
        "prompt_index": ids.prompt_index,
        "reward": reward,
        "rewards": rewards,
        "policy_version_start": version_start,
        "policy_version_end": max(version_end, version_start),
        "stop_reason": episode.stop_reason,
        "num_turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "tool_failures": episode.tool_failures,
        "messages": episode.messages,
        "error": episode.error,
        "timing": timing,
        "extras": extras,
    }
    try:
        records = episode.builder.build(**fields)
    except ValueError as exc:  # pydantic's ValidationError included: never raise for an episode
        logger.warning("episode %s: its record did not validate", ids.rollout_id, exc_info=True)
        fields.update(
            stop_reason="rollout_error",
            error=_error_text(exc),
            reward=config.failure_reward,
            rewards={},
            messages=[],
            extras={"invalid_record": True},
        )
        records = SegmentBuilder().build(**fields)
    # The total covers building the records too (a copy: the records are frozen, and valid).
    total = {**timing, "total": time.perf_counter() - started}
    return [record.model_copy(update={"timing": total}) for record in records]
