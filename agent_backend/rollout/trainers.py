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
* :func:`episode_rows` gives exactly one row per expected episode, in order,
  whatever happened to it: what every trainer adapter
  (:mod:`agent_backend.integrations`) hands its trainer, which must never get
  a surprise count or an empty row (TRL raises on an extra row, a missing
  one or a row with no tokens).

This module must never import a trainer library (TRL, verl, torch): the
shapes are plain lists and numpy arrays, which each of them takes.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import Any, Final

import numpy as np

from agent_backend.rollout.trajectory import Trajectory

__all__ = [
    "PLACEHOLDER_EXTRA",
    "TRL_EXTRA_KEYS",
    "VERL_FIELDS",
    "batches",
    "episode_rows",
    "is_placeholder",
    "placeholder",
    "to_trl",
    "to_verl_fields",
    "token_versions",
    "trl_reward",
]

#: The ``extras`` key that marks a placeholder row (:func:`placeholder`); its value says why.
PLACEHOLDER_EXTRA: Final = "placeholder"

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
    "turn_versions",
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
    "policy_version_start": "policy_version_start (non_tensor_batch, int64)",
    "policy_version_end": "policy_version_end (non_tensor_batch, int64)",
    "turn_versions": "turn_versions (non_tensor_batch, one list of (sent, answered) per row)",
}


def is_placeholder(trajectory: Trajectory) -> bool:
    """True for a row :func:`placeholder` made: nothing in it was sampled, nothing is trained."""
    return PLACEHOLDER_EXTRA in trajectory.extras


def placeholder(
    *,
    prompt_index: int,
    sample_idx: int,
    token_id: int,
    reward: float,
    why: str,
    like: Trajectory | None = None,
) -> Trajectory:
    """A row that stands for an episode with nothing to train on, so a trainer's count holds.

    One prompt token and one completion token (``token_id``: the tokenizer's pad
    or eos), mask 0, logprob 0.0: a trainer computes no loss on it. ``like``
    (the failed episode's own record, when there is one) lends its ids, stop
    reason, error, counts and messages; without one the row is a
    ``rollout_error`` whose error says ``why``. ``extras["placeholder"]`` is ``why``.
    """
    if token_id < 0:
        raise ValueError(f"a placeholder needs a token id >= 0, got {token_id}")
    fields: dict[str, Any] = (
        like.model_dump(
            exclude={"prompt_ids", "completion_ids", "completion_mask", "logprobs", "turn_spans"}
        )
        if like is not None
        else {
            "rollout_id": f"missing-p{prompt_index}-s{sample_idx}",
            "group_id": f"missing-p{prompt_index}",
            "policy_version_start": 0,
            "policy_version_end": 0,
            "stop_reason": "rollout_error",
            "num_turns": 0,
            "error": why,
        }
    )
    fields.update(
        prompt_index=prompt_index,
        sample_idx=sample_idx,
        segment_idx=0,
        reward=reward,
        rewards={},
        extras={**fields.get("extras", {}), PLACEHOLDER_EXTRA: why},
    )
    return Trajectory(
        **fields,
        prompt_ids=[token_id],
        completion_ids=[token_id],
        completion_mask=[0],
        logprobs=[0.0],
    )


def episode_rows(
    records: Iterable[Trajectory],
    *,
    expect: Sequence[tuple[int, int]],
    placeholder_token_id: int,
    failure_reward: float = 0.0,
) -> list[Trajectory]:
    """Exactly one row per expected ``(prompt_index, sample_idx)``, in the order of ``expect``.

    * An episode's segments (chat mode, a template that rewrote history) become
      one row: its last segment, which ends where the reward was given;
      ``extras["segments_dropped"]`` counts the others. Token-in/token-out
      episodes have one segment.
    * An episode whose record has no completion token (it failed before its
      first turn), or no record at all (a dropped stale group, a failed group
      left for a later run), becomes a :func:`placeholder`: one token, mask 0.
    * A placeholder's reward is the mean reward of the real rows of its prompt
      (so it shifts neither its group's mean nor, in GRPO, its siblings'
      advantages), or ``failure_reward`` when the whole group is placeholders.
      A real failed episode keeps its own reward (its tokens were sampled: the
      failure is a signal).
    * Records not in ``expect`` are left out; a key expected twice is refused.
    """
    keys = [(int(p), int(s)) for p, s in expect]
    if len(set(keys)) != len(keys):
        raise ValueError("episode_rows(): an expected (prompt_index, sample_idx) repeats")
    wanted = set(keys)
    found: dict[tuple[int, int], list[Trajectory]] = {}
    for record in records:
        key = (record.prompt_index, record.sample_idx)
        if key in wanted:
            found.setdefault(key, []).append(record)
    rows: dict[tuple[int, int], Trajectory] = {}
    missing: dict[tuple[int, int], tuple[str, Trajectory | None]] = {}
    for key in keys:
        segments = found.get(key)
        if not segments:
            missing[key] = (
                "no record: the episode's group was dropped or left for a later run",
                None,
            )
            continue
        if len({s.rollout_id for s in segments}) > 1:
            raise ValueError(
                f"episode_rows(): prompt {key[0]} sample {key[1]} has records of several "
                f"rollouts ({', '.join(sorted({s.rollout_id for s in segments}))})"
            )
        last = max(segments, key=lambda s: s.segment_idx)
        if not last.completion_ids or not last.prompt_ids:
            missing[key] = (
                f"no tokens: the episode ended ({last.stop_reason}) before its first turn",
                last,
            )
            continue
        if len(segments) > 1:
            last = last.model_copy(
                update={"extras": {**last.extras, "segments_dropped": len(segments) - 1}}
            )
        rows[key] = last
    if missing:
        by_prompt: dict[int, list[float]] = {}
        for (prompt, _), row in rows.items():
            by_prompt.setdefault(prompt, []).append(row.reward)
        for key, (why, like) in missing.items():
            real = by_prompt.get(key[0])
            reward = math.fsum(real) / len(real) if real else failure_reward
            rows[key] = placeholder(
                prompt_index=key[0],
                sample_idx=key[1],
                token_id=placeholder_token_id,
                reward=reward,
                why=why,
                like=like,
            )
    return [rows[key] for key in keys]


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
        "policy_version_start": np.array([t.policy_version_start for t in records], np.int64),
        "policy_version_end": np.array([t.policy_version_end for t in records], np.int64),
        "turn_versions": _object_array([list(t.turn_versions) for t in records]),
    }
    return {"batch": batch, "non_tensor_batch": non_tensor_batch}


def _object_array(values: list[Any]) -> np.ndarray:
    """A 1-d object array of ``values`` (numpy would make a 2-d array of equal-length lists)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def token_versions(trajectory: Trajectory, *, fill: int = -1) -> list[int]:
    """The policy version of each completion token: its turn's version where the policy
    sampled it (the version it was sent at, for a turn a ``continue`` update crossed), ``fill``
    on tool output and template tokens. For per-token importance weights or staleness
    filters. Records without ``turn_versions`` give ``policy_version_start`` for every turn."""
    out = [fill] * len(trajectory.completion_ids)
    versions = trajectory.turn_versions or [
        (trajectory.policy_version_start, trajectory.policy_version_start)
    ] * len(trajectory.turn_spans)
    for (start, stop), (sent, _answered) in zip(trajectory.turn_spans, versions, strict=True):
        out[start:stop] = [sent] * (stop - start)
    return out


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
