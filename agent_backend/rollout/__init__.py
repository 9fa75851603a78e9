"""RL rollouts: multi-turn episodes with tools, trainer-ready trajectories, resume bookkeeping.

docs/rollouts.md (running rollouts, TRL and verl) and docs/rollout-records.md
(the record, the ledger, the writers). The names below are imported lazily
(PEP 562), so ``agent-backend --help`` does not pay for the rollout layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_backend.rollout.chat_template import ChatTemplate
    from agent_backend.rollout.episode import (
        EpisodeConfig,
        RewardInput,
        ToolReward,
        run_episode,
    )
    from agent_backend.rollout.ledger import ResumeLedger
    from agent_backend.rollout.logprobs import NonFinitePolicy, check_logprobs
    from agent_backend.rollout.policy import AssistantTurn, OpenAICompatiblePolicy, Policy
    from agent_backend.rollout.pool import RolloutPool, RolloutStatistics
    from agent_backend.rollout.ray_workers import RayRolloutWorkers
    from agent_backend.rollout.runner import EpisodeRunner, EpisodeSummary, InProcessRunner
    from agent_backend.rollout.servers import PolicyServers, UpdateReport
    from agent_backend.rollout.tokens import (
        SampledTokens,
        TokenPolicy,
        TokenSampler,
        VLLMTokenSampler,
    )
    from agent_backend.rollout.trainers import (
        batches,
        episode_rows,
        is_placeholder,
        to_trl,
        to_verl_fields,
    )
    from agent_backend.rollout.trajectory import SegmentBuilder, StopReason, Trajectory
    from agent_backend.rollout.weight_sync import (
        InFlight,
        SGLangWeights,
        VLLMWeights,
        WeightSync,
        check_checkpoint,
        untie_for_vllm,
    )
    from agent_backend.rollout.writers import JsonlWriter, ParquetWriter, open_writer

__all__ = [
    "AssistantTurn",
    "ChatTemplate",
    "EpisodeConfig",
    "EpisodeRunner",
    "EpisodeSummary",
    "InFlight",
    "InProcessRunner",
    "JsonlWriter",
    "NonFinitePolicy",
    "OpenAICompatiblePolicy",
    "ParquetWriter",
    "Policy",
    "PolicyServers",
    "RayRolloutWorkers",
    "ResumeLedger",
    "RewardInput",
    "RolloutPool",
    "RolloutStatistics",
    "SGLangWeights",
    "SampledTokens",
    "SegmentBuilder",
    "StopReason",
    "TokenPolicy",
    "TokenSampler",
    "ToolReward",
    "Trajectory",
    "UpdateReport",
    "VLLMTokenSampler",
    "VLLMWeights",
    "WeightSync",
    "batches",
    "check_checkpoint",
    "check_logprobs",
    "episode_rows",
    "is_placeholder",
    "open_writer",
    "run_episode",
    "to_trl",
    "to_verl_fields",
    "untie_for_vllm",
]

_HOME = {
    "AssistantTurn": "policy",
    "OpenAICompatiblePolicy": "policy",
    "Policy": "policy",
    "EpisodeConfig": "episode",
    "RewardInput": "episode",
    "ToolReward": "episode",
    "run_episode": "episode",
    "ResumeLedger": "ledger",
    "NonFinitePolicy": "logprobs",
    "check_logprobs": "logprobs",
    "RolloutPool": "pool",
    "RolloutStatistics": "pool",
    "RayRolloutWorkers": "ray_workers",
    "PolicyServers": "servers",
    "UpdateReport": "servers",
    "InFlight": "weight_sync",
    "SGLangWeights": "weight_sync",
    "VLLMWeights": "weight_sync",
    "WeightSync": "weight_sync",
    "check_checkpoint": "weight_sync",
    "untie_for_vllm": "weight_sync",
    "EpisodeRunner": "runner",
    "EpisodeSummary": "runner",
    "InProcessRunner": "runner",
    "batches": "trainers",
    "episode_rows": "trainers",
    "is_placeholder": "trainers",
    "to_trl": "trainers",
    "to_verl_fields": "trainers",
    "ChatTemplate": "chat_template",
    "SampledTokens": "tokens",
    "TokenPolicy": "tokens",
    "TokenSampler": "tokens",
    "VLLMTokenSampler": "tokens",
    "SegmentBuilder": "trajectory",
    "StopReason": "trajectory",
    "Trajectory": "trajectory",
    "JsonlWriter": "writers",
    "ParquetWriter": "writers",
    "open_writer": "writers",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
