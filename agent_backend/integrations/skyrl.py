"""SkyRL's generator over agent_backend: :class:`AgentBackendGenerator`, :class:`SkyRLTokenSampler`.

SkyRL (NovaSky-AI/SkyRL; tested with ``skyrl`` 0.4.0) trains on what a
``GeneratorInterface.generate(input_batch)`` returns: for the prompts of one
batch (each repeated ``n_samples_per_prompt`` times in a row, with a
``TrajectoryID(instance_id, repetition_id)`` each) a ``GeneratorOutput`` of
token ids, loss masks, rollout logprobs, rewards and stop reasons, one row per
input prompt, in order, that its trainer validates
(``validate_generator_output``) and pads into tensors
(``convert_prompts_responses_to_batch_tensors``).

:class:`AgentBackendGenerator` is that generator. Each distinct prompt is a
GRPO group sampled by a :class:`~agent_backend.rollout.RolloutPool` (tools on
any pool, reward from agent_backend, one session per episode);
:func:`~agent_backend.rollout.episode_rows` then gives exactly one row per
input prompt: an episode that failed before its first turn, or has no record
(a group whose every episode failed, a rollout dropped for non-finite
logprobs), becomes a one-token row under mask 0, never a lost or extra row
(a surprise row count breaks the trainer's batch). In step-wise mode (SkyRL's
``step_wise_trajectories``) an
episode whose chat template rewrote history has one row per segment, in
order, ``is_last_step`` on its last, the episode's reward there.

Generation: with SkyRL's ``inference_engine_client`` and tokenizer, episodes
run token-in/token-out (:class:`~agent_backend.rollout.TokenPolicy`) over a
:class:`SkyRLTokenSampler`, which calls
``client.generate(InferenceEngineInput(prompt_token_ids=...))``: the engines
SkyRL syncs weights into after each step, so sampling stays on-policy
(with no new weights pushed to it, a policy server samples off-policy).
Any :class:`~agent_backend.rollout.Policy` can be given instead.

SkyRL requires Python 3.12; on 3.11 one of its modules (``skyrl.tinker.types``)
puts a ``typing.TypedDict`` in a pydantic model, which pydantic refuses before
3.12. While importing SkyRL on 3.11 this module lends ``typing`` the
``typing_extensions.TypedDict`` (the same class as 3.12's), and restores it
right after; nothing else of SkyRL needs 3.12.

This module must never return a count of rows other than SkyRL expects, a row
without tokens, or a NaN.
"""

from __future__ import annotations

import functools
import importlib
import sys
import typing
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry
from agent_backend.errors import PolicyError
from agent_backend.integrations._groups import placeholder_token, step_pool
from agent_backend.integrations._hosting import (
    HostedTools,
    PoolSource,
    check_tools_or_dispatcher,
    open_tools,
)
from agent_backend.lifecycle import AsyncResource
from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    NonFinitePolicy,
    Policy,
    SampledTokens,
    TokenPolicy,
    Trajectory,
    episode_rows,
    is_placeholder,
)
from agent_backend.rollout.episode import RewardFunction


def _import_skyrl() -> None:
    """Import SkyRL's generator module (on Python 3.11 too: see the module docstring)."""
    lend = sys.version_info < (3, 12)
    original = typing.TypedDict
    if lend:
        import typing_extensions

        setattr(typing, "TypedDict", typing_extensions.TypedDict)  # noqa: B010
    try:
        importlib.import_module("skyrl.train.generators.base")
    finally:
        if lend:
            setattr(typing, "TypedDict", original)  # noqa: B010


_import_skyrl()

from skyrl.backends.skyrl_train.inference_servers.base import (  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: E402
    InferenceEngineInput,
)
from skyrl.train.generators.base import (  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: E402
    GeneratorInput,
    GeneratorInterface,
    GeneratorOutput,
)
from skyrl.train.generators.utils import (  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: E402
    get_rollout_metrics,
)

__all__ = ["AgentBackendGenerator", "SkyRLTokenSampler"]

#: Stop reasons of episodes that ended as the policy or a limit decided (the others failed).
_FINISHED = frozenset({"stop", "length", "max_turns"})


class SkyRLTokenSampler:
    """A :class:`~agent_backend.rollout.TokenSampler` over SkyRL's inference engine client.

    ``sample`` sends one token-id prompt through
    ``client.generate(InferenceEngineInput(prompt_token_ids=[ids], sampling_params=...))``
    with the batch's ``sampling_params`` (vLLM's names, as SkyRL passes them),
    ``max_tokens`` lowered to the turn's budget, and ``logprobs`` asked for
    (SkyRL's default 1: the sampled token's logprob) when they say ``None``: a
    trainer needs them, and their absence raises :class:`PolicyError`, never
    a zeroed mask that stops training making progress. The client's failures become ``PolicyError``
    (the episode records ``rollout_error``).
    """

    def __init__(
        self,
        client: Any,
        *,
        sampling_params: Mapping[str, Any] | None = None,
        model: str | None = None,
    ) -> None:
        """
        Args:
            client: SkyRL's ``InferenceEngineInterface`` (the trainer's ``inference_engine_client``).
            sampling_params: sampling parameters in SkyRL's backend format
                (``get_sampling_params_for_backend``); ``n`` must be 1.
            model: the name the engines serve the policy by (a LoRA adapter's);
                None: the client's own ``model_name``.
        """
        params = dict(sampling_params or {})
        if params.get("n", 1) != 1:
            raise ValueError("SkyRL's sampling_params n must be 1 (samples are rows of the batch)")
        if params.get("logprobs") is None:
            params["logprobs"] = 1
        self.client = client
        self.sampling_params = params
        self.model = model

    def __repr__(self) -> str:
        return f"<SkyRLTokenSampler {type(self.client).__name__} model={self.model!r}>"

    async def sample(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> SampledTokens:
        params = dict(self.sampling_params)
        if max_tokens is not None:
            configured = params.get("max_tokens")
            params["max_tokens"] = max_tokens if configured is None else min(configured, max_tokens)
        request = InferenceEngineInput(
            prompt_token_ids=[[int(t) for t in prompt_ids]], sampling_params=params
        )
        try:
            output = await self.client.generate(request, model=self.model)
        except Exception as exc:
            raise PolicyError(
                f"SkyRL's inference engine client failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            ids = [int(t) for t in output["response_ids"][0]]
            logprobs = output.get("response_logprobs")
            finish = output["stop_reasons"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise PolicyError(
                f"SkyRL's inference engine answered without response_ids or stop_reasons: {exc!r}"
            ) from None
        if logprobs is None or not logprobs or logprobs[0] is None:
            raise PolicyError(
                "SkyRL's inference engine answered no response_logprobs, though asked "
                f"(logprobs={params['logprobs']}); a trainer cannot use a rollout without them"
            )
        values = list(logprobs[0])
        if len(values) != len(ids):
            raise PolicyError(
                f"SkyRL's inference engine answered {len(ids)} token ids but {len(values)} logprobs"
            )
        return SampledTokens(
            token_ids=ids,
            logprobs=[float(v) if isinstance(v, int | float) else None for v in values],
            finish_reason=str(finish) if finish else "stop",
        )


class AgentBackendGenerator(GeneratorInterface, AsyncResource):  # type: ignore[misc,unused-ignore]
    """A SkyRL generator that runs agent_backend episodes (module docstring).

    In a SkyRL experiment, return it from ``BasePPOExp.get_generator``::

        class Exp(BasePPOExp):
            def get_generator(self, cfg, tokenizer, inference_engine_client):
                return AgentBackendGenerator(
                    inference_engine_client=inference_engine_client,
                    tokenizer=tokenizer,
                    reward=ToolReward(("exec", {"command": "python -m pytest -q"})),
                    episode=EpisodeConfig(max_turns=cfg.generator.max_turns),
                    step_wise=cfg.generator.step_wise_trajectories,
                )

    The tools run on ``pool`` (default: this machine) or on a given
    ``dispatcher``. A dispatcher not yet opened, and the pool it was given
    or this generator loads, are opened on the first :meth:`generate`, in
    the trainer's event loop, and closed by :meth:`aclose` (call it in that
    loop); a dispatcher already open stays the caller's. A ``policy`` that
    holds connections (an async context manager, or a token policy whose
    sampler is one) is opened and closed with them, as
    :class:`~agent_backend.integrations.trl.TRLRollout` does: its connections
    belong to the loop that used them.
    """

    def __init__(
        self,
        *,
        inference_engine_client: Any = None,
        tokenizer: Any = None,
        policy: Policy | None = None,
        model: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        non_finite: NonFinitePolicy = "mask",
        tools: ToolRegistry | None = None,
        pool: PoolSource = DEFAULT_POOL,
        dispatcher: Dispatcher | None = None,
        reward: RewardFunction | None = None,
        episode: EpisodeConfig | None = None,
        step_wise: bool = False,
        token_level_rewards: bool = False,
        concurrency: int = 64,
        group_retries: int = 1,
        max_failed_groups: int | None = 8,
        placeholder_token_id: int | None = None,
    ) -> None:
        """
        Args:
            inference_engine_client: SkyRL's engine client; episodes then sample
                token-in/token-out through it (with ``tokenizer``). Not with ``policy``.
            tokenizer: SkyRL's tokenizer (a Hugging Face one, with its chat
                template), or a :class:`~agent_backend.rollout.ChatTemplate`.
            policy: any agent_backend policy to sample with instead of the engines.
            model: the served name of the policy (a LoRA adapter), for the client.
            chat_template_kwargs: passed to the chat template (``enable_thinking`` ...).
            non_finite: what a NaN/inf/missing logprob does (``mask``: the token is
                not trained on; ``drop``: the rollout is a mask-0 row; ``fail``: raise).
            tools: the tools offered and run (default: the built-ins); not with ``dispatcher``.
            pool: where the tools run, when no ``dispatcher`` is given.
            dispatcher: a dispatcher to use instead (open, or not yet opened).
            reward: scores each finished episode (:class:`~agent_backend.rollout.RewardInput`;
                its ``prompt`` is ``{"messages", "env_class", "env_extras", "trajectory_id"}``).
            episode: the limits of each episode; its ``failure_reward`` is a
                placeholder row's reward when its whole group has no real row.
            step_wise: one row per segment with ``is_last_step`` (SkyRL's
                ``generator.step_wise_trajectories``), instead of one per episode.
            token_level_rewards: rewards as one list per row (the reward on its
                last token) instead of one number per row.
            concurrency: episodes running at once in one :meth:`generate` call.
            group_retries: times a group whose every episode failed is sampled again.
            max_failed_groups: such groups in a row that raise
                :class:`~agent_backend.errors.RolloutError` (the engines or the pool
                are down); None: never, they become mask-0 rows.
            placeholder_token_id: the token of a mask-0 row (default: the tokenizer's
                pad token, else its eos token).
        """
        if (inference_engine_client is None) == (policy is None):
            raise ValueError("pass inference_engine_client (with tokenizer) or policy, one of them")
        check_tools_or_dispatcher(tools, dispatcher)
        template: ChatTemplate | None = None
        if inference_engine_client is not None:
            if tokenizer is None:
                raise ValueError("token-in/token-out over SkyRL's engines needs its tokenizer")
            template = (
                tokenizer
                if isinstance(tokenizer, ChatTemplate)
                else ChatTemplate(tokenizer, chat_template_kwargs=chat_template_kwargs)
            )
        token = (
            placeholder_token_id
            if placeholder_token_id is not None
            else placeholder_token(tokenizer)
        )
        if token is None or token < 0:
            raise ValueError(
                "a failed episode's row needs a token: pass placeholder_token_id= or a "
                "tokenizer with a pad or eos token"
            )
        self.client = inference_engine_client
        self.template = template
        self.policy = policy
        self.model = model
        self.non_finite: NonFinitePolicy = non_finite
        self.reward = reward
        self.episode = episode or EpisodeConfig()
        self.step_wise = step_wise
        self.token_level_rewards = token_level_rewards
        self.concurrency = concurrency
        self.group_retries = group_retries
        self.max_failed_groups = max_failed_groups
        self.placeholder_token_id: int = token
        # Opened in the trainer's event loop, by a task of its own: SkyRL's fully async trainer
        # calls generate() from several tasks, and what the pool and the dispatcher enter must
        # be left in the task that entered it.
        self._hosted = HostedTools(
            functools.partial(
                open_tools, tools=tools, pool=pool, dispatcher=dispatcher, policy=policy
            ),
            what="the SkyRL generator",
        )

    def __repr__(self) -> str:
        source = "engines" if self.client is not None else type(self.policy).__name__
        state = " closed" if self._hosted.is_closed() else ""
        return f"<AgentBackendGenerator {source} step_wise={self.step_wise}{state}>"

    async def aclose(self) -> None:
        """Close what the first :meth:`generate` opened (pool, dispatcher, policy); idempotent."""
        await self._hosted.aclose()

    def _policy_version(self, metadata: Any) -> int:
        """The engines' weight version (syncs so far), else the batch's global step."""
        synced = getattr(self.client, "weight_version", None)
        if isinstance(synced, int) and not isinstance(synced, bool):
            return synced
        return int(getattr(metadata, "global_step", 0) or 0)

    def _policy_for(self, sampling_params: Mapping[str, Any] | None) -> Policy:
        if self.policy is not None:
            return self.policy
        assert self.template is not None
        sampler = SkyRLTokenSampler(self.client, sampling_params=sampling_params, model=self.model)
        return TokenPolicy(sampler, self.template, non_finite=self.non_finite)

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        """SkyRL's ``generate``: one row per input prompt, in order (step-wise: per segment)."""
        dispatcher = await self._hosted.dispatcher()
        prompts = list(input_batch["prompts"])
        if not prompts:
            raise ValueError("SkyRL passed no prompts")
        count = len(prompts)
        trajectory_ids = input_batch.get("trajectory_ids")
        if trajectory_ids is not None and len(trajectory_ids) != count:
            raise ValueError(f"{len(trajectory_ids)} trajectory_ids for {count} prompts")
        if self.step_wise and trajectory_ids is None:
            raise ValueError("step-wise rows need the batch's trajectory_ids (SkyRL passes them)")
        n, keys = _groups(trajectory_ids, count)
        env_classes = input_batch.get("env_classes") or [None] * count
        env_extras = input_batch.get("env_extras") or [None] * count
        rows_of_groups = [i for i, key in enumerate(keys) if key[1] == 0]
        distinct = [
            {
                "messages": prompts[i],
                "env_class": env_classes[i],
                "env_extras": env_extras[i],
                "trajectory_id": None if trajectory_ids is None else trajectory_ids[i],
            }
            for i in rows_of_groups
        ]
        version = self._policy_version(input_batch.get("batch_metadata"))
        policy = self._policy_for(input_batch.get("sampling_params"))
        pool = step_pool(self, policy, dispatcher, n=n, version=version)
        records = await pool.collect(distinct)
        rows = episode_rows(
            records,
            expect=keys,
            placeholder_token_id=self.placeholder_token_id,
            failure_reward=self.episode.failure_reward,
        )
        steps = _steps(rows, records) if self.step_wise else [[row] for row in rows]
        return self._output(steps, trajectory_ids, pool.statistics().rollouts_dropped)

    def _output(
        self,
        steps: list[list[Trajectory]],
        trajectory_ids: Sequence[Any] | None,
        rollouts_dropped: int,
    ) -> GeneratorOutput:
        flat = [row for episode in steps for row in episode]
        last = [i == len(episode) - 1 for episode in steps for i in range(len(episode))]
        rewards: list[Any] = []
        for row, is_last in zip(flat, last, strict=True):
            reward = row.reward if is_last else 0.0
            if self.token_level_rewards:
                rewards.append([0.0] * (len(row.completion_ids) - 1) + [reward])
            else:
                rewards.append(reward)
        responses = [list(row.completion_ids) for row in flat]
        masks = [list(row.completion_mask) for row in flat]
        times = [row.timing.get("total", 0.0) for row in flat]
        splits = {
            "llm": [row.timing.get("policy", 0.0) for row in flat],
            "env": [
                sum(row.timing.get(k, 0.0) for k in ("tools", "env", "reward")) for row in flat
            ],
        }
        episodes = [episode[-1] for episode in steps]
        metrics = dict(
            get_rollout_metrics(
                responses,
                rewards,
                loss_masks=masks,
                trajectory_completion_times=[e.timing.get("total", 0.0) for e in episodes],
                trajectory_time_splits={
                    name: [values[i] for i, is_last in enumerate(last) if is_last]
                    for name, values in splits.items()
                },
            )
        )
        metrics.update(_our_metrics(episodes, rollouts_dropped))
        output: dict[str, Any] = {
            "prompt_token_ids": [list(row.prompt_ids) for row in flat],
            "response_ids": responses,
            "rewards": rewards,
            "loss_masks": masks,
            "stop_reasons": [row.stop_reason for row in flat],
            "rollout_metrics": metrics,
            "rollout_logprobs": [list(row.logprobs) for row in flat],
            "trajectory_ids": None
            if trajectory_ids is None
            else [trajectory_ids[i] for i, episode in enumerate(steps) for _ in episode],
            "trajectory_generation_times": times,
            "trajectory_time_splits": splits,
            "rollout_expert_indices": None,
            "rollout_sample_support": None,
            "is_last_step": last if self.step_wise else None,
            "env_metrics": [_env_metrics(row) for row in flat],
        }
        return typing.cast(GeneratorOutput, output)


def _groups(trajectory_ids: Sequence[Any] | None, count: int) -> tuple[int, list[tuple[int, int]]]:
    """The group size and each row's ``(group, sample)``: SkyRL's repetitions of one instance.

    Rows of one ``instance_id`` come in a row (``prepare_generator_input``);
    when every group has the same size ``n`` they are GRPO groups of ``n``,
    otherwise (or without ids) each row is a group of its own.
    """
    if trajectory_ids is None:
        return 1, [(i, 0) for i in range(count)]
    runs: list[int] = []
    previous: object = object()
    for tid in trajectory_ids:
        instance = getattr(tid, "instance_id", tid)
        if not runs or instance != previous:
            runs.append(0)
            previous = instance
        runs[-1] += 1
    if len(set(runs)) == 1:
        n = runs[0]
        return n, [(i // n, i % n) for i in range(count)]
    return 1, [(i, 0) for i in range(count)]


def _steps(rows: list[Trajectory], records: list[Trajectory]) -> list[list[Trajectory]]:
    """Each row's episode as its segments in order (a placeholder stays one step)."""
    segments: dict[tuple[int, int], list[Trajectory]] = {}
    for record in records:
        if record.prompt_ids and record.completion_ids:
            segments.setdefault((record.prompt_index, record.sample_idx), []).append(record)
    steps: list[list[Trajectory]] = []
    for row in rows:
        found = segments.get((row.prompt_index, row.sample_idx), [])
        if is_placeholder(row) or len(found) < 2:
            steps.append([row])
        else:
            steps.append(sorted(found, key=lambda s: s.segment_idx))
    return steps


def _env_metrics(row: Trajectory) -> dict[str, Any]:
    return {
        "stop_reason": row.stop_reason,
        "num_turns": row.num_turns,
        "tool_calls": row.tool_calls,
        "tool_failures": row.tool_failures,
        "placeholder": is_placeholder(row),
        "error": row.error,
        "policy_version": row.policy_version_start,
        "policy_version_end": row.policy_version_end,
        "turn_versions": [list(v) for v in row.turn_versions],
    }


def _our_metrics(episodes: Sequence[Trajectory], rollouts_dropped: int) -> dict[str, float]:
    """Per-batch counts, named so that SkyRL's concatenation aggregates them right.

    (``concatenate_generator_outputs`` averages keys with ``avg``/``mean``,
    takes the min/max of ``min``/``max`` keys and sums the others.)
    """
    count = len(episodes)
    reasons = Counter(e.stop_reason for e in episodes)
    metrics: dict[str, float] = {
        "agent_backend/episodes": float(count),
        "agent_backend/failed_episodes": float(
            sum(1 for e in episodes if e.stop_reason not in _FINISHED)
        ),
        "agent_backend/placeholder_rows": float(sum(1 for e in episodes if is_placeholder(e))),
        "agent_backend/rollouts_dropped": float(rollouts_dropped),
        "agent_backend/non_finite_logprobs": float(
            sum(int(e.extras.get("non_finite_logprobs", 0)) for e in episodes)
        ),
        "agent_backend/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "agent_backend/tool_failures": float(sum(e.tool_failures for e in episodes)),
        "agent_backend/avg_turns": sum(e.num_turns for e in episodes) / count,
    }
    for reason, n in sorted(reasons.items()):
        metrics[f"agent_backend/stop_reason/{reason}"] = float(n)
    return metrics
