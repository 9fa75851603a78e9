"""verl's agent loop over agent_backend: :class:`AgentBackendAgentLoop` (``agent_name: agent_backend``).

verl (0.9.x; tested with 0.9.1) samples multi-turn rollouts in *agent loops*:
its ``AgentLoopWorker`` instantiates the loop a dataset row names (the row's
``agent_name``, else ``rollout.agent.default_agent_loop``) from an entry of
verl's agent loop registry, calls ``run(sampling_params, **row)`` once per
row, pads the ``AgentLoopOutput`` it returns (unpadded ``prompt_ids``,
``response_ids``, ``response_mask``, ``response_logprobs``) into the batch,
puts ``reward_score`` into ``rm_scores`` on the last response token, and
keeps ``extra_fields`` as ``non_tensor_batch`` columns. The trainer then
unions that batch with its own, which holds its own ``uid`` (the GRPO group).

:class:`AgentBackendAgentLoop` is such a loop. Each ``run`` is one
agent_backend episode (:func:`~agent_backend.rollout.run_episode`) with the
tools running on an agent_backend pool, in one session per episode:

* **Generation is verl's own.** :class:`VerlTokenSampler` is a
  :class:`~agent_backend.rollout.TokenSampler` over the loop's
  ``server_manager.generate`` (token ids in, token ids and logprobs out), and
  :class:`~agent_backend.rollout.TokenPolicy` with a
  :class:`~agent_backend.rollout.ChatTemplate` of verl's tokenizer runs the
  turns without ever re-rendering the past. So verl's weight sync, its load
  balancing and sticky sessions apply unchanged: the rollout stays on-policy.
* **The tools run on a pool opened once per worker process** (per event
  loop): a :class:`~agent_backend.Dispatcher` over the pool file and tools the
  agent loop config names, held by a task of its own
  (:mod:`agent_backend.integrations._hosting`: verl instantiates a loop per
  row, and gives loops no shutdown hook; :func:`close_dispatchers` closes
  them, and a local pool cleans up after a killed process by itself).
* **Exactly one valid row per call**, whatever happened
  (:func:`~agent_backend.rollout.episode_rows`): an episode that failed before
  its first turn becomes a one-token placeholder under mask 0; a rollout
  dropped for non-finite logprobs keeps its tokens under mask 0. The reward
  is agent_backend's when the config names one (``reward`` or
  ``reward_command``); otherwise ``reward_score`` stays None and verl's own
  reward scores the row.
* **No column of the trainer's is overwritten**: ``extra_fields`` (the
  episode's ``stop_reason``, ``error``, counts, ``min/max_global_steps``)
  never hold ``uid`` nor any other field of the input row, so the trainer's
  ``DataProto.union`` finds equal columns.

This module imports verl (it subclasses verl's ``AgentLoopBase``); nothing
else in agent_backend imports it. It must never raise from ``run`` for a
failed episode (only for a bad config, and ``NonFiniteLogprobs`` under the
``fail`` policy), never return a row without a response token, and never
emit a column the trainer's batch already has.
"""

from __future__ import annotations

import logging
import numbers
import os
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Final

from agent_backend import Dispatcher
from agent_backend.config import import_object
from agent_backend.errors import PolicyError
from agent_backend.integrations._hosting import PerLoop, ToolsSpec
from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    NonFinitePolicy,
    SampledTokens,
    TokenPolicy,
    ToolReward,
    Trajectory,
    episode_rows,
    is_placeholder,
    run_episode,
)
from agent_backend.rollout.episode import EpisodeIds, RewardFunction

try:
    with warnings.catch_warnings():
        # verl.single_controller imports ray.experimental.state, which warns on import (Ray 2.x).
        warnings.filterwarnings(
            "ignore",
            message="Ray state API is no longer experimental",
            category=DeprecationWarning,
        )
        from omegaconf import DictConfig, ListConfig, OmegaConf
        from verl.experimental.agent_loop.agent_loop import (
            AgentLoopBase,
            AgentLoopMetrics,
            AgentLoopOutput,
            register,
        )
        from verl.utils.import_utils import resolve_config_path
except ImportError as exc:
    raise ImportError(
        f"agent_backend.integrations.verl needs verl 0.9 and its agent loop's imports ({exc}): "
        "pip install 'verl>=0.9,<0.10' cachetools"
    ) from exc

__all__ = [
    "AGENT_NAME",
    "AgentBackendAgentLoop",
    "ToolsSpec",
    "VerlTokenSampler",
    "close_dispatchers",
    "shared_dispatcher",
    "to_agent_loop_output",
]

logger = logging.getLogger("agent_backend.integrations.verl")

#: The ``agent_name`` this loop is registered under in verl's agent loop registry.
AGENT_NAME: Final = "agent_backend"

#: ``extra_fields`` every row carries (verl keeps a stable set of columns across loops).
_VERL_EXTRA_KEYS: Final = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps")


# -- generation: verl's server manager as a TokenSampler ------------------------------------------


class VerlTokenSampler:
    """A :class:`~agent_backend.rollout.TokenSampler` over verl's ``server_manager.generate``.

    One per episode: it keeps the episode's request id (verl routes the turns
    of one request id to the same server, for its prefix cache), the length
    of the first prompt (the episode's response budget counts from there) and
    the weights versions (``global_steps``) its turns were sampled with.

    Every request asks for logprobs (an answer without them, or with a
    different count, is a :class:`~agent_backend.errors.PolicyError`: never a
    silently zeroed mask that stops training making progress) and for at most what is left of
    ``response_length`` after the tokens since the first prompt, so the row
    fits verl's padded width; when nothing is left, the turn is an empty
    ``length`` completion and the server is not asked. An aborted request, or
    a server manager that raises, is a ``PolicyError`` too: the episode
    records it as ``rollout_error``.
    """

    def __init__(
        self,
        server_manager: Any,
        *,
        sampling_params: Mapping[str, Any],
        prompt_length: int,
        response_length: int,
        end_of_turn_id: int,
        request_id: str | None = None,
        priority: int = 0,
    ) -> None:
        if prompt_length < 1 or response_length < 1:
            raise ValueError("prompt_length and response_length must be at least 1")
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params)
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.end_of_turn_id = end_of_turn_id
        self.request_id = request_id or uuid.uuid4().hex
        self.priority = priority
        self.first_prompt_length: int | None = None
        self.turns = 0
        self.num_preempted: int | None = None
        self.min_global_steps: int | None = None
        self.max_global_steps: int | None = None

    def __repr__(self) -> str:
        return (
            f"<VerlTokenSampler request={self.request_id} [turns: {self.turns} | steps: "
            f"{self.min_global_steps}..{self.max_global_steps}]>"
        )

    async def sample(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> SampledTokens:
        prompt = [int(t) for t in prompt_ids]
        if self.first_prompt_length is None:
            if len(prompt) > self.prompt_length:
                raise PolicyError(
                    f"the prompt is {len(prompt)} tokens, more than rollout.prompt_length="
                    f"{self.prompt_length}: raise it, or filter long prompts out "
                    "(data.filter_overlong_prompts)"
                )
            self.first_prompt_length = len(prompt)
        left = self.first_prompt_length + self.response_length - len(prompt)
        limit = left if max_tokens is None else min(max_tokens, left)
        if limit <= 0:
            high = self.max_global_steps
            return SampledTokens(
                token_ids=[],
                logprobs=[],
                finish_reason="length",
                versions=None if high is None else (high, high),
            )
        params = {**self.sampling_params, "max_tokens": limit, "logprobs": True}
        try:
            output = await self.server_manager.generate(
                request_id=self.request_id,
                prompt_ids=prompt,
                sampling_params=params,
                priority=self.priority,
            )
        except Exception as exc:  # a Ray actor error, a server error: the episode records it
            raise PolicyError(
                f"verl's server manager failed: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        self.turns += 1
        versions = self._note(output)
        stop = getattr(output, "stop_reason", None)
        if stop in ("aborted", "abort"):
            raise PolicyError("verl's rollout server aborted the request", retryable=True)
        ids = [int(t) for t in getattr(output, "token_ids", None) or []]
        logprobs = getattr(output, "log_probs", None)
        if logprobs is None or len(logprobs) != len(ids):
            raise PolicyError(
                f"verl's server answered {len(ids)} token ids and "
                f"{'no' if logprobs is None else len(logprobs)} logprobs; they were asked for "
                "(sampling_params logprobs=True) and must align one to one"
            )
        ended = bool(ids) and ids[-1] == self.end_of_turn_id
        # vLLM's server says "completed" for a stop and for the length limit alike.
        finish = "length" if stop == "length" or (len(ids) >= limit and not ended) else "stop"
        return SampledTokens(
            token_ids=ids,
            logprobs=[float(v) if v is not None else None for v in logprobs],
            finish_reason=finish,
            versions=versions,
        )

    def _note(self, output: Any) -> tuple[int, int] | None:
        """Count what verl's answer says; the weights versions (``global_steps``) of its turn."""
        preempted = getattr(output, "num_preempted", None)
        if preempted is not None:
            self.num_preempted = (self.num_preempted or 0) + int(preempted)
        extra = getattr(output, "extra_fields", None) or {}
        low = extra.get("min_global_steps", extra.get("global_steps"))
        high = extra.get("max_global_steps", extra.get("global_steps"))
        if low is not None:
            low = int(low)
            self.min_global_steps = (
                low if self.min_global_steps is None else min(self.min_global_steps, low)
            )
        if high is not None:
            high = int(high)
            self.max_global_steps = (
                high if self.max_global_steps is None else max(self.max_global_steps, high)
            )
        if low is None or high is None:
            return None
        return low, max(low, high)


# -- tools: one dispatcher per worker process ----------------------------------------------------


_HOSTED = PerLoop(ToolsSpec.open)


async def shared_dispatcher(spec: ToolsSpec) -> Dispatcher:
    """The open dispatcher for ``spec`` in this event loop, opened on first use.

    A pool that fails to open raises here (a :class:`~agent_backend.ConfigError`
    for a bad file); the next call tries again.
    """
    return await _HOSTED.dispatcher(spec)


async def close_dispatchers() -> None:
    """Close the dispatchers (and their pools) this event loop opened; idempotent."""
    await _HOSTED.aclose()


# -- the agent loop --------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """An OmegaConf value as plain Python (hydra passes nested config as DictConfig/ListConfig)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _resolved(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else resolve_config_path(os.fspath(path))


def _verl_num_turns(record: Trajectory, prompt_messages: int) -> int:
    """Turns as verl counts them: the prompt, each assistant turn, each round of tool results."""
    turns = 1
    previous = ""
    for message in record.messages[prompt_messages:]:
        role = str(message.get("role", ""))
        if role == "assistant" or (role == "tool" and previous != "tool"):
            turns += 1
        previous = role
    return turns


def to_agent_loop_output(
    record: Trajectory,
    *,
    response_length: int,
    prompt_messages: int,
    scored: bool,
    with_logprobs: bool = True,
    sampler: VerlTokenSampler | None = None,
    reserved: frozenset[str] = frozenset(),
) -> AgentLoopOutput:
    """verl's ``AgentLoopOutput`` for one row (:func:`~agent_backend.rollout.episode_rows`'s).

    The response is cut to ``response_length`` (``extra_fields["truncated"]``);
    a dropped rollout keeps its tokens under mask 0; ``reward_score`` is the
    record's reward when ``scored`` (else None: verl's reward scores the row).
    ``extra_fields`` never holds a name in ``reserved`` (the row's own
    columns) nor ``uid``.
    """
    ids = list(record.completion_ids)
    mask = list(record.completion_mask)
    logprobs = list(record.logprobs)
    truncated = len(ids) > response_length
    if truncated:
        ids, mask, logprobs = (
            ids[:response_length],
            mask[:response_length],
            logprobs[:response_length],
        )
    placeholder = record.extras.get("placeholder")
    if record.extras.get("dropped"):  # dropped for non-finite logprobs: nothing of it is trained
        mask = [0] * len(mask)
        logprobs = [0.0] * len(logprobs)
    timing = record.timing
    metrics = AgentLoopMetrics(
        generate_sequences=float(timing.get("policy", 0.0)),
        tool_calls=float(timing.get("tools", 0.0)),
        compute_score=float(timing.get("reward", 0.0)) if scored else 0.0,
        num_preempted=-1
        if sampler is None or sampler.num_preempted is None
        else sampler.num_preempted,
    )
    extra: dict[str, Any] = {
        "turn_scores": [],
        "tool_rewards": [],
        "min_global_steps": None if sampler is None else sampler.min_global_steps,
        "max_global_steps": None if sampler is None else sampler.max_global_steps,
        "stop_reason": record.stop_reason,
        "error": record.error,
        "rollout_id": record.rollout_id,
        "tool_calls": record.tool_calls,
        "tool_failures": record.tool_failures,
        "rewards": dict(record.rewards),
        "non_finite_logprobs": int(record.extras.get("non_finite_logprobs", 0)),
        "placeholder": placeholder,
        "truncated": truncated,
        "turn_versions": [list(v) for v in record.turn_versions],
    }
    clash = (reserved | {"uid"}) & extra.keys()
    for key in clash:
        if key not in _VERL_EXTRA_KEYS:
            logger.debug("extra field %r is a column of the input row: not emitted", key)
        del extra[key]
    return AgentLoopOutput(
        prompt_ids=list(record.prompt_ids),
        response_ids=ids,
        response_mask=mask,
        response_logprobs=logprobs if with_logprobs else None,
        reward_score=float(record.reward) if scored else None,
        num_turns=_verl_num_turns(record, prompt_messages),
        metrics=metrics,
        extra_fields=extra,
    )


@register(AGENT_NAME)
class AgentBackendAgentLoop(AgentLoopBase):
    """verl agent loop running one agent_backend episode per row (module docstring).

    Named by verl's agent loop config, an entry of the YAML file
    ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` points to::

        - name: agent_backend
          _target_: agent_backend.integrations.verl.AgentBackendAgentLoop
          pool: pools/local.toml          # where the tools run (default: this machine)
          tools_dir: schemas/tools        # tool schema files (default: the built-ins)
          reward_command: "python -m pytest -q"

    Importing this module also registers it under ``agent_backend`` with
    defaults (verl's ``register``). Every option below is a key of that entry.
    verl's own tools (``multi_turn.tool_config_path``) are not used.
    """

    def __init__(
        self,
        *args: Any,
        pool: str | None = None,
        tools_dir: str | None = None,
        registry: str | None = None,
        dispatcher_options: Mapping[str, Any] | None = None,
        reward: str | None = None,
        reward_command: str | None = None,
        max_turns: int | None = None,
        max_tokens_per_turn: int | None = None,
        timeout: float | None = 600.0,
        tool_timeout: float | None = None,
        max_tool_failures: int | None = None,
        parallel_tool_calls: bool = True,
        reward_timeout: float | None = 300.0,
        failure_reward: float = 0.0,
        non_finite: NonFinitePolicy = "mask",
        end_of_turn: str | None = None,
        tools: Any = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            pool: a pool file (TOML) for the tools; relative paths as verl resolves its
                config files (the working directory, then verl's project root).
            tools_dir: a folder of tool schema files (default: the built-in tools).
            registry: ``module:attribute``, a :class:`~agent_backend.ToolRegistry` or a
                function returning one (Python tools); ``tools_dir`` is loaded into it.
            dispatcher_options: keyword arguments of :class:`~agent_backend.Dispatcher`.
            reward: ``module:function`` scoring an episode (gets a
                :class:`~agent_backend.rollout.RewardInput`; its ``prompt`` is the row).
            reward_command: a shell command run in the episode's workspace at its end:
                exit 0 is 1.0. With neither, verl's own reward scores the rows.
            max_turns: policy turns per episode (default: ``multi_turn.max_assistant_turns``,
                else 16).
            max_tokens_per_turn, timeout, tool_timeout, max_tool_failures,
            parallel_tool_calls, reward_timeout, failure_reward: as
                :class:`~agent_backend.rollout.EpisodeConfig`.
            non_finite: NaN/inf logprobs: ``mask`` the token (default), ``drop`` the
                rollout (its row stays, under mask 0), ``fail`` (raise: the step stops).
            end_of_turn: the token ending an assistant turn (default: the tokenizer's eos).
            tools: verl's own tool list (passed by verl's worker; not used).
        """
        super().__init__(*args, **kwargs)
        del tools  # verl's tools (multi_turn.tool_config_path); agent_backend runs its own
        if reward is not None and reward_command is not None:
            raise ValueError("give reward or reward_command, not both")
        self.tools_spec = ToolsSpec(
            pool=_resolved(pool),
            tools_dir=_resolved(tools_dir),
            registry=registry,
            dispatcher_options=tuple(sorted(dict(_plain(dispatcher_options) or {}).items())),
        )
        self.reward: RewardFunction | None = None
        if reward_command is not None:
            self.reward = ToolReward(("exec", {"command": str(reward_command)}))
        elif reward is not None:
            self.reward = import_object(reward)
        if non_finite not in ("mask", "drop", "fail"):
            raise ValueError(f"non_finite must be mask, drop or fail, not {non_finite!r}")
        self.non_finite: NonFinitePolicy = non_finite
        rollout = self.rollout_config
        if max_turns is None:
            max_turns = rollout.multi_turn.get("max_assistant_turns") or 16
        self.episode = EpisodeConfig(
            max_turns=int(max_turns),
            max_tokens_per_turn=max_tokens_per_turn,
            timeout=timeout,
            tool_timeout=tool_timeout,
            max_tool_failures=max_tool_failures,
            parallel_tool_calls=parallel_tool_calls,
            reward_timeout=reward_timeout,
            failure_reward=float(failure_reward),
        )
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.with_logprobs = bool(rollout.get("calculate_log_probs", True))
        self.template = ChatTemplate(
            self.tokenizer,
            chat_template_kwargs=_plain(self.apply_chat_template_kwargs) or None,
            end_of_turn=end_of_turn,
        )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.placeholder_token_id = int(pad) if pad is not None else self.template.end_of_turn_id

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode for one dataset row (``kwargs``: the row's ``non_tensor_batch`` fields)."""
        dispatcher = await shared_dispatcher(self.tools_spec)
        messages = [dict(m) for m in _plain(kwargs["raw_prompt"])]
        priority = kwargs.get("priority", 0)
        sampler = VerlTokenSampler(
            self.server_manager,
            sampling_params=sampling_params,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            end_of_turn_id=self.template.end_of_turn_id,
            priority=int(priority) if priority is not None else 0,
        )
        policy = TokenPolicy(sampler, self.template, non_finite=self.non_finite)
        index = kwargs.get("index", 0)  # the dataset's row index (numpy or Python int)
        prompt_index = max(int(index), 0) if isinstance(index, numbers.Integral) else 0
        uid = kwargs.get("uid")
        ids = EpisodeIds(
            rollout_id=f"verl-{sampler.request_id}",
            group_id=str(uid) if uid is not None else f"verl-{prompt_index}",
            prompt_index=prompt_index,
        )
        prompt = {**{k: v for k, v in kwargs.items() if k != "raw_prompt"}, "messages": messages}
        records = await run_episode(
            prompt,
            policy=policy,
            dispatcher=dispatcher,
            reward=self.reward,
            config=self.episode,
            ids=ids,
        )
        [row] = episode_rows(
            records,
            expect=[(ids.prompt_index, ids.sample_idx)],
            placeholder_token_id=self.placeholder_token_id,
            failure_reward=self.episode.failure_reward,
        )
        if is_placeholder(row):
            logger.info("row %s is a placeholder: %s", row.rollout_id, row.extras["placeholder"])
        return to_agent_loop_output(
            row,
            response_length=self.response_length,
            prompt_messages=len(messages),
            scored=self.reward is not None,
            with_logprobs=self.with_logprobs,
            sampler=sampler,
            reserved=frozenset(kwargs),
        )
