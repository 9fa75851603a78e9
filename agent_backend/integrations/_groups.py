"""What the trainer adapters share: the pool of one training step, the placeholder row's token.

TRL's ``rollout_func`` and SkyRL's ``generate`` each sample the groups of one
training step with a pool of their own: fresh group ids each step, the
trainer's group size and weights version, and the adapter's settings (reward,
episode limits, concurrency, how failed groups are retried). :func:`step_pool`
makes that pool the same way for both. :func:`placeholder_token` is the token
of the one-token row that stands for a failed episode.

It imports no trainer and holds no state.
"""

from __future__ import annotations

from typing import Any, Protocol

from agent_backend import Dispatcher
from agent_backend.rollout import EpisodeConfig, Policy, RolloutPool
from agent_backend.rollout.episode import RewardFunction

__all__ = ["GroupSettings", "placeholder_token", "step_pool"]


class GroupSettings(Protocol):
    """An adapter's settings for the groups it samples (its constructor's arguments)."""

    reward: RewardFunction | None
    episode: EpisodeConfig
    concurrency: int
    group_retries: int
    max_failed_groups: int | None


def step_pool(
    settings: GroupSettings, policy: Policy, dispatcher: Dispatcher, *, n: int, version: int
) -> RolloutPool:
    """The pool of one training step: groups of ``n`` sampled at weights ``version``."""
    return RolloutPool(
        policy,
        dispatcher,
        reward=settings.reward,
        n=n,
        concurrency=settings.concurrency,
        episode=settings.episode,
        policy_version=version,
        group_retries=settings.group_retries,
        max_failed_groups=settings.max_failed_groups,
    )


def placeholder_token(tokenizer: Any) -> int | None:
    """The pad token id of a tokenizer (or of the one a processor or ChatTemplate wraps), else
    its eos token id; None when it has neither."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0:
            return value
    return None
