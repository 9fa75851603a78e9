"""Trainer adapters: TRL's rollout_func output, verl's padded fields, in-process batches."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from agent_backend.rollout.trainers import (
    TRL_EXTRA_KEYS,
    VERL_FIELDS,
    batches,
    episode_rows,
    is_placeholder,
    to_trl,
    to_verl_fields,
    token_versions,
    trl_reward,
)
from agent_backend.rollout.trajectory import Trajectory


def traj(
    index: int, prompt: list[int], completion: list[int], mask: list[int], **kw: Any
) -> Trajectory:
    logprobs = [-(i + 1) / 10 if m else 0.0 for i, m in enumerate(mask)]
    fields: dict[str, Any] = {
        "rollout_id": f"r{index}",
        "group_id": f"g{index // 2}",
        "sample_idx": index % 2,
        "prompt_index": index // 2,
        "prompt_ids": prompt,
        "completion_ids": completion,
        "completion_mask": mask,
        "logprobs": logprobs,
        "reward": float(index),
        "policy_version_start": 0,
        "policy_version_end": 1,
        "stop_reason": "stop",
        "num_turns": 1,
    }
    fields.update(kw)
    return Trajectory(**fields)


BATCH = [
    traj(0, [1, 2, 3], [4, 5], [1, 1]),
    traj(1, [1], [6, 7, 8, 9], [1, 0, 0, 1], rewards={"tests": 0.5}),
    traj(2, [1, 2], [], [], stop_reason="rollout_error", error="policy server 503"),
]


def test_to_trl_has_the_rollout_func_keys_one_entry_per_completion() -> None:
    out = to_trl(BATCH)
    assert list(out)[:4] == ["prompt_ids", "completion_ids", "logprobs", "env_mask"]
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", *TRL_EXTRA_KEYS}
    assert all(len(values) == len(BATCH) for values in out.values())
    assert out["prompt_ids"] == [[1, 2, 3], [1], [1, 2]]
    assert out["completion_ids"] == [[4, 5], [6, 7, 8, 9], []]
    assert out["logprobs"][1] == [-0.1, 0.0, 0.0, -0.4]
    assert out["env_mask"] == out["completion_mask"] == [[1, 1], [1, 0, 0, 1], []]
    assert out["reward"] == [0.0, 1.0, 2.0]
    assert out["rewards"][1] == {"tests": 0.5}
    assert out["error"] == [None, None, "policy server 503"]
    assert out["group_id"] == ["g0", "g0", "g1"]
    out["prompt_ids"][0].append(99)  # copies: the records are not changed
    assert BATCH[0].prompt_ids == [1, 2, 3]


def test_trl_reward_reads_the_rewards_back() -> None:
    out = to_trl(BATCH)
    completions = ["a", "b", "c"]
    kwargs = {k: v for k, v in out.items() if k not in ("prompt_ids", "completion_ids")}
    assert trl_reward(completions, **kwargs) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="'reward' key"):
        trl_reward(completions)
    with pytest.raises(ValueError, match="one value per completion"):
        trl_reward(completions[:2], reward=[1.0])


def test_to_verl_fields_pads_prompts_left_and_responses_right() -> None:
    out = to_verl_fields(BATCH, pad_token_id=0)
    b, nt = out["batch"], out["non_tensor_batch"]
    assert set(b) == {
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "rollout_log_probs",
        "token_level_scores",
    }
    assert b["prompts"].tolist() == [[1, 2, 3], [0, 0, 1], [0, 1, 2]]
    assert b["responses"].tolist() == [[4, 5, 0, 0], [6, 7, 8, 9], [0, 0, 0, 0]]
    assert b["input_ids"].shape == (3, 7)
    assert b["attention_mask"].tolist()[1] == [0, 0, 1, 1, 1, 1, 1]
    assert b["position_ids"].tolist()[1] == [0, 0, 0, 1, 2, 3, 4]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0]]
    np.testing.assert_allclose(b["rollout_log_probs"][1], [-0.1, 0.0, 0.0, -0.4], rtol=1e-6)
    # The reward sits on the last response token; an empty response has no token to carry it.
    assert b["token_level_scores"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert nt["uid"].tolist() == ["g0", "g0", "g1"]
    assert nt["stop_reason"].tolist() == ["stop", "stop", "rollout_error"]
    assert b["input_ids"].dtype == np.int64
    assert b["rollout_log_probs"].dtype == np.float32


def test_to_verl_fields_fixed_widths_and_errors() -> None:
    out = to_verl_fields(BATCH[:1], prompt_length=5, response_length=3, pad_token_id=-1)
    assert out["batch"]["prompts"].tolist() == [[-1, -1, 1, 2, 3]]
    assert out["batch"]["token_level_scores"].tolist() == [[0.0, 0.0, 0.0]]
    assert out["batch"]["responses"].tolist() == [[4, 5, -1]]
    with pytest.raises(ValueError, match="more than prompt_length=2"):
        to_verl_fields(BATCH[:1], prompt_length=2)
    with pytest.raises(ValueError, match="at least one"):
        to_verl_fields([])


def test_verl_mapping_is_documented_for_every_token_field() -> None:
    assert {
        "prompt_ids",
        "completion_ids",
        "completion_mask",
        "logprobs",
        "reward",
        "group_id",
    } <= set(VERL_FIELDS)
    assert "rollout_log_probs" in VERL_FIELDS["logprobs"]


async def stream(n: int) -> AsyncIterator[Trajectory]:
    for i in range(n):
        yield traj(i, [1], [2], [1])


@pytest.mark.anyio
async def test_batches_in_order_with_a_short_last_one() -> None:
    got = [[t.rollout_id for t in batch] async for batch in batches(stream(7), 3)]
    assert got == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]


@pytest.mark.anyio
async def test_batches_drop_last_and_exact_sizes() -> None:
    assert [len(b) async for b in batches(stream(7), 3, drop_last=True)] == [3, 3]
    assert [len(b) async for b in batches(stream(6), 3)] == [3, 3]
    assert [b async for b in batches(stream(0), 3)] == []


@pytest.mark.anyio
async def test_batches_refuse_a_zero_size() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        async for _ in batches(stream(1), 0):
            pass


def test_episode_rows_one_row_per_expected_episode_in_order() -> None:
    seg0 = traj(4, [1, 2], [3], [1], rollout_id="r4")
    seg1 = traj(4, [1, 9], [5, 6], [1, 1], rollout_id="r4", segment_idx=1, reward=2.0)
    records = [*BATCH, seg1, seg0, traj(5, [1], [2], [1], reward=4.0)]
    expect = [(2, 1), (2, 0), (0, 0), (0, 1), (1, 0), (7, 0), (7, 1)]
    rows = episode_rows(records, expect=expect, placeholder_token_id=99, failure_reward=-1.0)
    assert [(r.prompt_index, r.sample_idx) for r in rows] == expect
    # prompt 2: sample 0 has two segments (the last one is kept), sample 1 is real.
    assert rows[1].segment_idx == 1
    assert rows[1].completion_ids == [5, 6]
    assert rows[1].extras["segments_dropped"] == 1
    assert not any(is_placeholder(r) for r in rows[:4])
    # prompt 1 sample 0 ended before its first turn (no tokens): a placeholder keeping its
    # stop reason and error; its reward is its real sibling's (prompt 1, sample 1 absent
    # from expect, so none: failure_reward).
    empty = rows[4]
    assert is_placeholder(empty)
    assert (empty.prompt_ids, empty.completion_ids, empty.completion_mask) == ([99], [99], [0])
    assert empty.logprobs == [0.0]
    assert empty.sampled_tokens == 0
    assert (empty.stop_reason, empty.error) == ("rollout_error", "policy server 503")
    assert empty.rollout_id == "r2"
    # prompt 7 never came back (a dropped group): two placeholders at failure_reward.
    assert all(is_placeholder(r) and r.reward == -1.0 for r in rows[5:])
    assert "no record" in rows[5].extras["placeholder"]
    assert len({r.rollout_id for r in rows}) == len(rows)


def test_a_placeholder_takes_the_mean_reward_of_its_groups_real_rows() -> None:
    records = [traj(0, [1], [2], [1], reward=1.0), traj(1, [1], [2], [1], reward=3.0)]
    rows = episode_rows(records, expect=[(0, 0), (0, 1), (0, 2)], placeholder_token_id=0)
    assert rows[2].reward == 2.0
    assert is_placeholder(rows[2])


def test_episode_rows_refuses_a_repeated_key_and_mixed_rollouts() -> None:
    with pytest.raises(ValueError, match="repeats"):
        episode_rows([], expect=[(0, 0), (0, 0)], placeholder_token_id=0)
    a, b = traj(0, [1], [2], [1]), traj(0, [1], [2], [1], rollout_id="other")
    with pytest.raises(ValueError, match="several rollouts"):
        episode_rows([a, b], expect=[(0, 0)], placeholder_token_id=0)


def test_turn_versions_reach_trl_verl_and_per_token() -> None:
    # Two turns: the first sent and answered at 3, the second crossed a continue update 3 -> 4.
    record = traj(
        0,
        [1],
        [5, 6, 7, 8, 9],
        [1, 1, 0, 1, 1],
        turn_spans=[(0, 2), (3, 5)],
        turn_versions=[(3, 3), (3, 4)],
        policy_version_start=3,
        policy_version_end=4,
        num_turns=2,
    )
    trl = to_trl([record])
    assert "turn_versions" in TRL_EXTRA_KEYS
    assert trl["turn_versions"] == [[(3, 3), (3, 4)]]
    assert (trl["policy_version_start"], trl["policy_version_end"]) == ([3], [4])
    verl = to_verl_fields([record, BATCH[0]])["non_tensor_batch"]
    assert verl["policy_version_start"].tolist() == [3, 0]
    assert verl["policy_version_end"].tolist() == [4, 1]
    assert verl["turn_versions"].shape == (2,)  # one list per row, not a 2-d array
    assert verl["turn_versions"][0] == [(3, 3), (3, 4)]
    assert verl["turn_versions"][1] == []
    # Per token: the version the turn was sent at; -1 on the tool's token between turns.
    assert token_versions(record) == [3, 3, -1, 3, 3]
    # An old record without per-turn versions: its start version for every turn.
    old = traj(1, [1], [5, 6], [1, 1], turn_spans=[(0, 2)])
    assert token_versions(old) == [0, 0]


def test_turn_versions_must_align_with_turns_and_lie_within_the_episodes_versions() -> None:
    with pytest.raises(ValueError, match="align"):
        traj(0, [1], [5], [1], turn_spans=[(0, 1)], turn_versions=[(0, 0), (0, 1)])
    with pytest.raises(ValueError, match="within"):
        traj(0, [1], [5], [1], turn_spans=[(0, 1)], turn_versions=[(0, 2)])
