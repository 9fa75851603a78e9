"""Trajectories in the shapes trainers take: TRL's ``rollout_func`` output, verl's batch fields.

* :func:`to_trl` returns the dict TRL's ``GRPOTrainer`` expects back from a
  ``rollout_func``: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one
  list per completion), plus ``env_mask`` (the key TRL multiplies into its
  completion loss mask: 1 on sampled tokens, 0 on tool/template tokens), the
  same values as ``completion_mask``, and the other record fields as extra
  keys, which TRL forwards to reward functions as keyword arguments
  (:func:`trl_reward` reads ``reward`` back).
* :func:`to_verl_fields` pads a batch into verl's ``DataProto`` names
  (:data:`VERL_FIELDS`): ``prompts`` (left-padded), ``responses``
  (right-padded), ``input_ids``, ``attention_mask``, ``position_ids``,
  ``response_mask``, ``rollout_log_probs`` and ``token_level_scores`` as
  numpy arrays, and ``uid`` (the GRPO group) in the non-tensor batch.
* :func:`batches` groups an async stream of trajectories into lists for a
  trainer that runs in the same process.

This module must never import a trainer library (TRL, verl, torch): the
shapes are plain lists and numpy arrays, which each of them takes.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import Any, Final

import numpy as np

from agent_backend.rollout.trajectory import Trajectory

__all__ = [
    "TRL_EXTRA_KEYS",
    "VERL_FIELDS",
    "batches",
    "to_trl",
    "to_verl_fields",
    "trl_reward",
]

#: Record fields :func:`to_trl` adds as extra keys (one value per completion).
TRL_EXTRA_KEYS: Final[tuple[str, ...]] = (
    "completion_mask",
    "reward",
    "rewards",
    "rollout_id",
    "group_id",
    "sample_idx",
    "prompt_index",
    "segment_idx",
    "stop_reason",
    "num_turns",
    "tool_calls",
    "tool_failures",
    "policy_version_start",
    "policy_version_end",
    "error",
    "extras",
)

#: Trajectory field -> verl name (``batch`` tensors unless noted), as :func:`to_verl_fields` fills them.
VERL_FIELDS: Final[dict[str, str]] = {
    "prompt_ids": "prompts (left-padded); input_ids = prompts + responses",
    "completion_ids": "responses (right-padded)",
    "completion_mask": "response_mask (older multi-turn verl: loss_mask)",
    "logprobs": "rollout_log_probs (the sampler's; verl recomputes old_log_probs itself)",
    "reward": "token_level_scores (the reward on the last response token, 0 elsewhere)",
    "group_id": "uid (non_tensor_batch: GRPO groups samples by it)",
}


def to_trl(trajectories: Iterable[Trajectory]) -> dict[str, list[Any]]:
    """The dict a TRL ``GRPOTrainer`` ``rollout_func`` returns, for these trajectories.

    Keys ``prompt_ids``, ``completion_ids``, ``logprobs`` and ``env_mask``,
    then :data:`TRL_EXTRA_KEYS`; every value is a list with one entry per
    trajectory, in order.
    """
    records = list(trajectories)
    out: dict[str, list[Any]] = {
        "prompt_ids": [list(t.prompt_ids) for t in records],
        "completion_ids": [list(t.completion_ids) for t in records],
        "logprobs": [list(t.logprobs) for t in records],
        "env_mask": [list(t.completion_mask) for t in records],
    }
    for key in TRL_EXTRA_KEYS:
        values = [getattr(t, key) for t in records]
        out[key] = [list(v) if isinstance(v, list) else v for v in values]
    return out


def trl_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """A TRL reward function returning the episode rewards :func:`to_trl` passed along."""
    rewards = kwargs.get("reward")
    if rewards is None or len(rewards) != len(completions):
        raise ValueError(
            "trl_reward needs the 'reward' key of to_trl()'s output, one value per completion"
        )
    return [float(r) for r in rewards]


def to_verl_fields(
    trajectories: Iterable[Trajectory],
    *,
    pad_token_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Pad a batch into verl's field names (:data:`VERL_FIELDS`) as numpy arrays.

    Returns ``{"batch": {...}, "non_tensor_batch": {...}}``; hand them to
    ``DataProto.from_dict(tensors={k: torch.from_numpy(v) ...}, non_tensors=...)``.
    ``prompt_length``/``response_length`` fix the padded widths (default: the
    longest in the batch); a longer prompt or response raises ``ValueError``
    (truncating would cut the reward's token or mis-align the mask).
    """
    records = list(trajectories)
    if not records:
        raise ValueError("to_verl_fields() needs at least one trajectory")
    p_len = max(len(t.prompt_ids) for t in records) if prompt_length is None else prompt_length
    r_len = (
        max(len(t.completion_ids) for t in records) if response_length is None else response_length
    )
    n = len(records)
    prompts = np.full((n, p_len), pad_token_id, dtype=np.int64)
    prompt_attention = np.zeros((n, p_len), dtype=np.int64)
    responses = np.full((n, r_len), pad_token_id, dtype=np.int64)
    response_attention = np.zeros((n, r_len), dtype=np.int64)
    response_mask = np.zeros((n, r_len), dtype=np.int64)
    rollout_log_probs = np.zeros((n, r_len), dtype=np.float32)
    token_level_scores = np.zeros((n, r_len), dtype=np.float32)
    for row, t in enumerate(records):
        lp, lr = len(t.prompt_ids), len(t.completion_ids)
        if lp > p_len or lr > r_len:
            raise ValueError(
                f"trajectory {t.rollout_id!r} segment {t.segment_idx} has {lp} prompt and {lr} "
                f"response tokens, more than prompt_length={p_len}/response_length={r_len}"
            )
        if lp:
            prompts[row, p_len - lp :] = t.prompt_ids
            prompt_attention[row, p_len - lp :] = 1
        if lr:
            responses[row, :lr] = t.completion_ids
            response_attention[row, :lr] = 1
            response_mask[row, :lr] = t.completion_mask
            rollout_log_probs[row, :lr] = t.logprobs
            token_level_scores[row, lr - 1] = t.reward
    attention_mask = np.concatenate([prompt_attention, response_attention], axis=1)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "token_level_scores": token_level_scores,
    }
    non_tensor_batch = {
        "uid": np.array([t.group_id for t in records], dtype=object),
        "rollout_id": np.array([t.rollout_id for t in records], dtype=object),
        "prompt_index": np.array([t.prompt_index for t in records], dtype=np.int64),
        "segment_idx": np.array([t.segment_idx for t in records], dtype=np.int64),
        "stop_reason": np.array([t.stop_reason for t in records], dtype=object),
    }
    return {"batch": batch, "non_tensor_batch": non_tensor_batch}


async def batches(
    source: AsyncIterable[Trajectory], size: int, *, drop_last: bool = False
) -> AsyncIterator[list[Trajectory]]:
    """Lists of ``size`` trajectories from ``source``, in order; the last may be shorter.

    ``drop_last=True`` discards a short last batch instead (its trajectories
    are then never trained: do not mark their prompts trained).
    """
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    batch: list[Trajectory] = []
    async for trajectory in source:
        batch.append(trajectory)
        if len(batch) == size:
            yield batch
            batch = []
    if batch and not drop_last:
        yield batch
