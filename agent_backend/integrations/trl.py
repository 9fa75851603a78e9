"""TRL's ``GRPOTrainer(rollout_func=...)`` over agent_backend: :class:`TRLRollout`.

TRL (1.0 and later; tested with 1.16) calls ``rollout_func(prompts, trainer)``
synchronously with the prompts of one generation batch, each repeated
``num_generations`` times in a row by its sampler, and wants back exactly one
completion per entry, in order: ``prompt_ids``, ``completion_ids`` and
``logprobs``, plus extra keys: ``env_mask`` multiplies into its loss mask, the
others reach the reward functions as keyword arguments.

:class:`TRLRollout` is that function. It runs an event loop on a private
thread (a blocking portal), opens the tool pool, the dispatcher and the policy
on it, and on each call samples one GRPO group per distinct prompt (``n =
num_generations``, so a group is the samples of one prompt in one step) with a
:class:`~agent_backend.rollout.RolloutPool`, at most ``concurrency`` episodes
at a time. :func:`~agent_backend.rollout.episode_rows` turns whatever came back
into one row per entry: an episode that failed before its first turn, or
has no record (a group the pool withheld because every episode failed, or
dropped for non-finite logprobs), becomes a one-token placeholder under mask 0
(TRL raises on an extra row, a missing one or a row with no tokens).
:func:`trl_reward` hands TRL the episode rewards back.

This module never imports TRL (TRL calls it), and never returns a count other
than ``len(prompts)`` nor a row without tokens.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio.from_thread
from anyio.from_thread import BlockingPortal

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry
from agent_backend.errors import RolloutError
from agent_backend.integrations._groups import placeholder_token, step_pool
from agent_backend.integrations._hosting import PoolSource, check_tools_or_dispatcher, open_tools
from agent_backend.lifecycle import SyncResource
from agent_backend.rollout import (
    EpisodeConfig,
    InFlight,
    Policy,
    PolicyServers,
    RolloutStatistics,
    Trajectory,
    UpdateReport,
    episode_rows,
    to_trl,
    untie_for_vllm,
)
from agent_backend.rollout.episode import RewardFunction
from agent_backend.rollout.servers import servers_of
from agent_backend.rollout.trainers import trl_reward

__all__ = ["TRLRollout", "trl_reward"]


class TRLRollout(SyncResource):
    """A TRL ``rollout_func`` running agent episodes: ``GRPOTrainer(rollout_func=TRLRollout(...))``.

    ::

        with TRLRollout(policy, tools=registry, reward=reward) as rollout:
            trainer = GRPOTrainer(model=..., reward_funcs=trl_reward, rollout_func=rollout, ...)
            trainer.train()

    The tools run on ``pool`` (a pool file, or a config; default: this
    machine), or pass a ``dispatcher`` not yet opened (its pool not started
    either) to choose its options. Both are opened on the adapter's own event
    loop and closed by :meth:`close`, and so is the policy when it is an async
    context manager (a :class:`~agent_backend.rollout.TokenPolicy`: its
    sampler), since its connections belong to that loop. A dispatcher already open belongs to the event loop that
    opened it: pass that loop's ``portal`` with it; it stays the caller's.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        tools: ToolRegistry | None = None,
        pool: PoolSource = DEFAULT_POOL,
        dispatcher: Dispatcher | None = None,
        portal: BlockingPortal | None = None,
        reward: RewardFunction | None = None,
        episode: EpisodeConfig | None = None,
        concurrency: int = 64,
        group_retries: int = 1,
        max_failed_groups: int | None = 8,
    ) -> None:
        """
        Args:
            policy: samples the turns (any :class:`~agent_backend.rollout.Policy`).
            tools: the tools offered and run (default: the built-ins); not with ``dispatcher``.
            pool: where the tools run, when no ``dispatcher`` is given.
            dispatcher: a dispatcher to use instead, not yet opened (or open, with ``portal``).
            portal: the blocking portal of the event loop an open ``dispatcher`` runs on.
            reward: scores each finished episode (see :class:`~agent_backend.rollout.RewardInput`).
            episode: the limits of each episode; its ``failure_reward`` is a placeholder's
                reward when its whole group has no real row.
            concurrency: episodes running at once.
            group_retries: times a group whose every episode failed is sampled again.
            max_failed_groups: such groups in a row, in one call, that raise
                :class:`~agent_backend.errors.RolloutError` (the policy server or
                the pool is down); None: never, they become placeholders.
        """
        check_tools_or_dispatcher(tools, dispatcher)
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.policy = policy
        self.reward = reward
        self.episode = episode or EpisodeConfig()
        self.concurrency = concurrency
        self.group_retries = group_retries
        self.max_failed_groups = max_failed_groups
        self.last_statistics: RolloutStatistics | None = None
        """What the pool of the last call did (episodes, failures, tool calls, stop reasons)."""
        self._closed = False
        if portal is None and dispatcher is not None and dispatcher.statistics().state == "open":
            raise ValueError(
                "an open dispatcher runs on the event loop that opened it: pass that "
                "loop's portal= too, or pass the dispatcher unopened"
            )
        self._stack = contextlib.ExitStack()
        try:
            if portal is None:
                portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
            self._portal = portal
            # The pool, the dispatcher and what of the policy holds connections, opened (and
            # later closed) on the loop that uses them.
            tools_open = open_tools(tools=tools, pool=pool, dispatcher=dispatcher, policy=policy)
            self.dispatcher: Dispatcher = self._stack.enter_context(
                portal.wrap_async_context_manager(tools_open)
            )
        except BaseException:
            self._stack.close()
            raise

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<TRLRollout policy={type(self.policy).__name__} {self.dispatcher!r}{state}>"

    def close(self) -> None:
        """Close the policy, the dispatcher and the pool this adapter opened, and its loop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stack.close()

    # -- weights ------------------------------------------------------------------------------

    def _servers(self) -> PolicyServers:
        servers = servers_of(self.policy)
        if servers is None:
            raise RolloutError(
                "the policy samples from no PolicyServers (an in-process sampler, or TRL's "
                "own vLLM): there are no servers to update"
            )
        return servers

    def update_weights(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        version: int | None = None,
        in_flight: InFlight = "drain",
    ) -> UpdateReport:
        """Load ``checkpoint`` into the policy servers and move to ``version`` (blocking; from
        the trainer's thread): :meth:`PolicyServers.update_weights <agent_backend.rollout.PolicyServers.update_weights>`
        on the adapter's event loop."""
        if self._closed:
            raise RolloutError("the TRL rollout is closed")
        servers = self._servers()
        return self._portal.call(
            functools.partial(
                servers.update_weights, os.fspath(checkpoint), version=version, in_flight=in_flight
            )
        )

    def weight_sync_callback(
        self, directory: str | os.PathLike[str], *, keep: int = 2, in_flight: InFlight = "drain"
    ) -> Any:
        """A ``transformers.TrainerCallback`` that, after every optimizer step, saves the
        model under ``directory/step-N`` (``save_pretrained``; the output layer named for
        vLLM when embeddings are tied) and loads it into the policy servers as version
        ``N = state.global_step``: the next step's rollouts sample the trained weights.
        The ``keep`` newest checkpoints are kept (a server probed back may need the last).

        ``GRPOTrainer(..., rollout_func=rollout, callbacks=[rollout.weight_sync_callback(dir)])``.
        """
        from transformers import TrainerCallback  # TRL's stack: present wherever TRL runs

        if keep < 1:
            raise ValueError("keep must be at least 1")
        root = Path(directory)
        self._servers()  # fail now, not after the first step
        rollout = self

        class WeightSyncCallback(TrainerCallback):
            """Pushes the trained weights to the policy servers after each optimizer step."""

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                model = kwargs.get("model")
                if model is None:
                    raise RolloutError("the trainer passed no model to on_step_end")
                model = getattr(model, "module", model)  # unwrapped (DDP, accelerate)
                step = int(state.global_step)
                path = root / f"step-{step}"
                model.save_pretrained(str(path))
                untie_for_vllm(path)
                rollout.update_weights(path, version=step, in_flight=in_flight)
                saved = sorted(
                    (p for p in root.glob("step-*") if p.name[5:].isdigit()),
                    key=lambda p: int(p.name[5:]),
                )
                for old in saved[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)

        return WeightSyncCallback()

    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func(prompts, trainer)``: one completion per entry of ``prompts``, in order.

        ``prompts`` are TRL's raw prompts (lists of chat messages, or strings:
        one user message), ``num_generations`` copies of each in a row. The
        placeholder token is the trainer tokenizer's pad token (else its eos).
        """
        if self._closed:
            raise RolloutError("the TRL rollout is closed")
        n = _group_size(prompts, trainer)
        distinct = list(prompts[::n])
        version = int(getattr(getattr(trainer, "state", None), "global_step", 0))
        token = _placeholder_token(trainer)
        records = self._portal.call(self._sample, distinct, n, version)
        rows = episode_rows(
            records,
            expect=[(i // n, i % n) for i in range(len(prompts))],
            placeholder_token_id=token,
            failure_reward=self.episode.failure_reward,
        )
        return to_trl(rows)

    async def _sample(self, prompts: list[Any], n: int, version: int) -> list[Trajectory]:
        # A pool per call: fresh group ids each step, and TRL's group size (train or eval).
        pool = step_pool(self, self.policy, self.dispatcher, n=n, version=version)
        records = await pool.collect(prompts)
        self.last_statistics = pool.statistics()
        return records


def _group_size(prompts: Sequence[Any], trainer: Any) -> int:
    """TRL's ``num_generations`` (``num_generations_eval`` in eval), checked against ``prompts``."""
    n = getattr(trainer, "num_generations", 1)
    if not getattr(getattr(trainer, "model", None), "training", True):
        n = getattr(trainer, "num_generations_eval", None) or n
    n = int(n)
    if not prompts or len(prompts) % n:
        raise ValueError(f"TRL passed {len(prompts)} prompts, not a multiple of {n} generations")
    for i in range(0, len(prompts), n):
        if any(prompts[j] != prompts[i] for j in range(i + 1, i + n)):
            raise ValueError(
                f"TRL's prompts {i}..{i + n - 1} are not {n} copies of one prompt: "
                "rollout_func expects each prompt repeated num_generations times in a row"
            )
    return n


def _placeholder_token(trainer: Any) -> int:
    """The pad token id of the trainer's tokenizer, else its eos token id."""
    token = placeholder_token(getattr(trainer, "processing_class", None))
    if token is not None:
        return token
    raise ValueError(
        "the trainer's processing_class has neither a pad nor an eos token id: "
        "a failed episode needs one for its placeholder row"
    )
