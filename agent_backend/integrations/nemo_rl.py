"""NeMo RL's rollout shapes over agent_backend: :func:`to_message_log`, :func:`to_nemo_rl_batch`.

NeMo RL (NVIDIA-NeMo/RL) trains on *message logs*: per sample, a list of
message dicts with ``role``, ``content`` and a ``token_ids`` tensor each; the
messages the policy generated are ``assistant`` messages that also carry a
``generation_logprobs`` tensor, which is what its GRPO uses as the mark of a
trainable message (``token_loss_mask`` 1 there, 0 everywhere else). Before
training it concatenates every message's ``token_ids`` into one sequence per
sample (``batched_message_log_to_flat_message``), so those must be exactly the
tokens the policy saw and sampled, in order: its NeMo Gym path asserts that
each turn's prompt extends everything seen before ("Non-contiguous messages
found!").

:func:`to_message_log` cuts a :class:`~agent_backend.rollout.Trajectory` into
such messages: the prompt is one non-trainable message, and the completion
is cut where its loss mask changes: a run of sampled tokens (mask 1) is an
``assistant`` message with its ``generation_logprobs``, a run of tool output
and template tokens (mask 0) a non-trainable one. So the concatenation of the
messages' ``token_ids`` is ``prompt_ids + completion_ids``, and the mask NeMo
RL derives is the record's. Like NeMo RL's NeMo Gym path, every
non-trainable message has the role ``user`` (NeMo RL only tells trainable
from not), and ``content`` is the decoded text when a tokenizer is given,
else ``""``. A sampled token that a non-finite logprob policy masked is its
own non-trainable message, never a trained token with a made-up logprob.

:func:`to_nemo_rl_batch` returns the columns NeMo RL's rollouts return with
their message logs (``run_multi_turn_rollout``): ``message_log``, ``length``
(the prompt's tokens), ``loss_multiplier`` (0.0 for a row with nothing to
train on, or whose episode failed for a reason that is not the policy's),
``total_reward``, ``truncated``, ``idx``, ``extra_env_info``, and one
``reward/<name>`` column per named reward component (what NeMo RL's GDPO
reads). Rows come from :func:`~agent_backend.rollout.episode_rows`: exactly
one per expected episode, a one-token placeholder for a failed or missing
one (a surprise row count or an empty row breaks a trainer's batch).

Tensors are torch tensors (``int64`` token ids, ``float32`` logprobs and
rewards, ``bool`` flags) when torch is installed, as NeMo RL builds them, else
plain lists. This module never imports NeMo RL (it cannot be installed from
PyPI, whose ``nemo-rl`` is an empty placeholder); the shapes follow its source
(docs/rollouts.md cites the commit read).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Collection, Sequence
from typing import Any, Final

from agent_backend.rollout import Trajectory, episode_rows, is_placeholder

__all__ = [
    "NON_TRAINABLE_ROLE",
    "UNTRAINED_STOP_REASONS",
    "to_message_log",
    "to_nemo_rl_batch",
    "to_nemo_rl_sample",
]

#: The role of every message the policy did not sample (NeMo RL trains on ``assistant`` only).
NON_TRAINABLE_ROLE: Final = "user"

#: Stop reasons whose episodes get ``loss_multiplier`` 0.0 by default: the environment or the
#: rollout layer failed (a sandbox, a policy server), which says nothing about the policy.
UNTRAINED_STOP_REASONS: Final[frozenset[str]] = frozenset({"env_error", "rollout_error"})

_TORCH: Final = importlib.util.find_spec("torch") is not None


def _runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each maximal run of equal values in ``mask``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def _want_tensors(as_tensors: bool | None) -> bool:
    if as_tensors and not _TORCH:
        raise RuntimeError("as_tensors=True needs torch, which is not installed")
    return _TORCH if as_tensors is None else as_tensors


def _ids(values: Sequence[int], tensors: bool) -> Any:
    if not tensors:
        return list(values)
    import torch

    return torch.tensor(list(values), dtype=torch.int64)  # an empty list would be float32


def _floats(values: Sequence[float], tensors: bool) -> Any:
    if not tensors:
        return [float(v) for v in values]
    import torch

    return torch.tensor([float(v) for v in values], dtype=torch.float32)


def _text(tokenizer: Any, ids: Sequence[int]) -> str:
    return "" if tokenizer is None else str(tokenizer.decode(list(ids)))


def to_message_log(
    trajectory: Trajectory, *, tokenizer: Any = None, as_tensors: bool | None = None
) -> list[dict[str, Any]]:
    """NeMo RL's ``message_log`` of one record: its token streams cut into messages.

    The first message is the prompt (``user``); then one message per run of
    the completion's loss mask: ``assistant`` with ``generation_logprobs``
    where the policy sampled (mask 1), ``user`` elsewhere (tool output,
    template tokens, masked tokens). The messages' ``token_ids`` concatenate
    to ``prompt_ids + completion_ids``. ``tokenizer`` (anything with
    ``decode(ids)``) fills ``content``; without one it is ``""``. ``as_tensors``
    (default: whether torch is installed) chooses torch tensors or lists.
    Raises ``ValueError`` for a record with no token at all (an episode that
    failed before its first turn: :func:`to_nemo_rl_batch` makes it a placeholder).
    """
    tensors = _want_tensors(as_tensors)
    if not trajectory.prompt_ids and not trajectory.completion_ids:
        raise ValueError(
            f"trajectory {trajectory.rollout_id!r} has no tokens (it ended "
            f"{trajectory.stop_reason} before its first turn): a message log needs at least "
            "one; to_nemo_rl_batch() turns such records into placeholder rows"
        )
    log: list[dict[str, Any]] = []
    if trajectory.prompt_ids:
        log.append(
            {
                "role": NON_TRAINABLE_ROLE,
                "content": _text(tokenizer, trajectory.prompt_ids),
                "token_ids": _ids(trajectory.prompt_ids, tensors),
            }
        )
    ids = trajectory.completion_ids
    for value, start, end in _runs(trajectory.completion_mask):
        message: dict[str, Any] = {
            "role": "assistant" if value else NON_TRAINABLE_ROLE,
            "content": _text(tokenizer, ids[start:end]),
            "token_ids": _ids(ids[start:end], tensors),
        }
        if value:
            message["generation_logprobs"] = _floats(trajectory.logprobs[start:end], tensors)
        log.append(message)
    return log


def _loss_multiplier(trajectory: Trajectory, untrained: Collection[str]) -> float:
    if is_placeholder(trajectory) or not any(trajectory.completion_mask):
        return 0.0
    return 0.0 if trajectory.stop_reason in untrained else 1.0


def _env_info(trajectory: Trajectory) -> dict[str, Any]:
    return {
        "rollout_id": trajectory.rollout_id,
        "group_id": trajectory.group_id,
        "sample_idx": trajectory.sample_idx,
        "stop_reason": trajectory.stop_reason,
        "error": trajectory.error,
        "num_turns": trajectory.num_turns,
        "tool_calls": trajectory.tool_calls,
        "tool_failures": trajectory.tool_failures,
        "placeholder": is_placeholder(trajectory),
    }


def to_nemo_rl_sample(
    trajectory: Trajectory,
    *,
    tokenizer: Any = None,
    untrained_stop_reasons: Collection[str] = UNTRAINED_STOP_REASONS,
    task_name: str | None = None,
    as_tensors: bool | None = None,
) -> dict[str, Any]:
    """One sample as NeMo RL's rollouts return it: a ``DatumSpec`` plus reward and truncation.

    Keys: ``message_log`` (:func:`to_message_log`), ``length`` (prompt tokens),
    ``extra_env_info`` (the record's ids, stop reason, error and counts),
    ``loss_multiplier`` (1.0; 0.0 for a placeholder, a row with no sampled
    token, or a stop reason in ``untrained_stop_reasons``), ``idx`` (the
    prompt index), ``total_reward``, ``truncated`` (``stop_reason ==
    "length"``: the token budget cut the episode, what NeMo RL's overlong
    filtering reads), and ``task_name`` when given.
    """
    sample: dict[str, Any] = {
        "message_log": to_message_log(trajectory, tokenizer=tokenizer, as_tensors=as_tensors),
        "length": len(trajectory.prompt_ids),
        "extra_env_info": _env_info(trajectory),
        "loss_multiplier": _loss_multiplier(trajectory, untrained_stop_reasons),
        "idx": trajectory.prompt_index,
        "total_reward": trajectory.reward,
        "truncated": trajectory.stop_reason == "length",
    }
    if task_name is not None:
        sample["task_name"] = task_name
    return sample


def _components(rows: Sequence[Trajectory]) -> dict[str, list[float]]:
    """``reward/<name>`` columns: a row without a component gets its prompt's mean of it."""
    names = sorted({name for row in rows for name in row.rewards})
    columns: dict[str, list[float]] = {}
    for name in names:
        by_prompt: dict[int, list[float]] = {}
        for row in rows:
            if name in row.rewards:
                by_prompt.setdefault(row.prompt_index, []).append(row.rewards[name])
        column = []
        for row in rows:
            if name in row.rewards:
                column.append(row.rewards[name])
            else:
                real = by_prompt.get(row.prompt_index)
                column.append(math.fsum(real) / len(real) if real else 0.0)
        columns[f"reward/{name}"] = column
    return columns


def to_nemo_rl_batch(
    records: Sequence[Trajectory],
    *,
    placeholder_token_id: int,
    expect: Sequence[tuple[int, int]] | None = None,
    failure_reward: float = 0.0,
    tokenizer: Any = None,
    untrained_stop_reasons: Collection[str] = UNTRAINED_STOP_REASONS,
    task_name: str | None = None,
    as_tensors: bool | None = None,
) -> dict[str, Any]:
    """The columns of a NeMo RL rollout batch: one row per expected episode, in order.

    ``expect`` lists the ``(prompt_index, sample_idx)`` of each row (default:
    every episode ``records`` hold, in the order first seen); an expected
    episode with no record, or whose record has no token, becomes a
    placeholder of ``placeholder_token_id`` (the tokenizer's pad token) with
    ``loss_multiplier`` 0.0 (:func:`~agent_backend.rollout.episode_rows`,
    which also keeps one segment per episode). Returns a dict of columns:
    ``message_log``, ``extra_env_info`` and ``idx`` as lists (and
    ``task_name`` when given), ``length``, ``loss_multiplier``,
    ``total_reward``, ``truncated`` and each ``reward/<name>`` as tensors (or
    lists); wrap it in NeMo RL's ``BatchedDataDict(...)``.
    """
    if expect is None:
        expect = list(dict.fromkeys((r.prompt_index, r.sample_idx) for r in records))
    rows = episode_rows(
        records,
        expect=expect,
        placeholder_token_id=placeholder_token_id,
        failure_reward=failure_reward,
    )
    tensors = _want_tensors(as_tensors)
    samples = [
        to_nemo_rl_sample(
            row,
            tokenizer=tokenizer,
            untrained_stop_reasons=untrained_stop_reasons,
            task_name=task_name,
            as_tensors=tensors,
        )
        for row in rows
    ]
    batch: dict[str, Any] = {
        key: [sample[key] for sample in samples] for key in ("message_log", "extra_env_info", "idx")
    }
    if task_name is not None:
        batch["task_name"] = [task_name] * len(samples)
    lengths = [sample["length"] for sample in samples]
    flags = [sample["truncated"] for sample in samples]
    floats = {
        "loss_multiplier": [sample["loss_multiplier"] for sample in samples],
        "total_reward": [sample["total_reward"] for sample in samples],
        **_components(rows),
    }
    if tensors:
        import torch

        batch["length"] = torch.tensor(lengths, dtype=torch.int64)
        batch["truncated"] = torch.tensor(flags, dtype=torch.bool)
        batch.update({k: torch.tensor(v, dtype=torch.float32) for k, v in floats.items()})
    else:
        batch.update(length=lengths, truncated=flags, **floats)
    return batch
