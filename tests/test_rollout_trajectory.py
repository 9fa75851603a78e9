"""The trajectory record: its checked-in schema, its validators, and SegmentBuilder."""

from __future__ import annotations

import json
import math
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_backend.errors import NonFiniteLogprobs
from agent_backend.rollout.trajectory import (
    STOP_REASONS,
    TRAJECTORY_SCHEMA_PATH,
    SegmentBuilder,
    Trajectory,
    non_finite_paths,
    non_finite_positions,
    schema_text,
)

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


def record(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "r-1",
        "group_id": "g-1",
        "sample_idx": 0,
        "prompt_index": 7,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4, 5, 6, 7],
        "completion_mask": [1, 1, 0, 1],
        "logprobs": [-0.5, -1.25, 0.0, -0.125],
        "reward": 1.0,
        "policy_version_start": 3,
        "policy_version_end": 4,
        "stop_reason": "stop",
        "num_turns": 2,
        "tool_calls": 1,
        "tool_failures": 0,
        "messages": [{"role": "user", "content": "hi"}],
        "timing": {"policy": 0.5},
        "extras": {"task": "demo"},
    }
    base.update(overrides)
    return base


# -- the checked-in schema ---------------------------------------------------------------------------


def test_checked_in_schema_is_the_models_schema() -> None:
    on_disk = json.loads(TRAJECTORY_SCHEMA_PATH.read_text(encoding="utf-8"))
    assert on_disk == Trajectory.model_json_schema(), (
        "schemas/wire/rollout.json is stale: .venv/bin/python -m agent_backend.rollout.trajectory "
        "> schemas/wire/rollout.json"
    )
    assert TRAJECTORY_SCHEMA_PATH.read_text(encoding="utf-8") == schema_text()


def test_schema_is_regenerated_by_running_the_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent_backend.rollout.trajectory"],
        capture_output=True,
        check=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.stdout.decode() == TRAJECTORY_SCHEMA_PATH.read_text(encoding="utf-8")


def test_schema_has_exactly_the_issue_fields() -> None:
    schema = Trajectory.model_json_schema()
    assert set(schema["properties"]) == {
        "rollout_id",
        "group_id",
        "sample_idx",
        "prompt_index",
        "segment_idx",
        "prompt_ids",
        "completion_ids",
        "completion_mask",
        "logprobs",
        "turn_spans",
        "turn_versions",
        "reward",
        "rewards",
        "policy_version_start",
        "policy_version_end",
        "stop_reason",
        "num_turns",
        "tool_calls",
        "tool_failures",
        "messages",
        "error",
        "timing",
        "extras",
    }
    assert schema["additionalProperties"] is False
    assert schema["properties"]["stop_reason"]["enum"] == list(STOP_REASONS)
    assert STOP_REASONS == (
        "stop",
        "length",
        "max_turns",
        "timeout",
        "tool_error",
        "env_error",
        "rollout_error",
    )


def test_a_record_validates_against_its_own_schema() -> None:
    import jsonschema

    data = Trajectory(**record()).model_dump(mode="json")
    jsonschema.validate(data, json.loads(TRAJECTORY_SCHEMA_PATH.read_text(encoding="utf-8")))


# -- validation -------------------------------------------------------------------------------------


def test_round_trips_through_json_and_pickle() -> None:
    t = Trajectory(**record(rewards={"tests": 1.0}, error=None))
    assert Trajectory.model_validate_json(t.model_dump_json()) == t
    assert pickle.loads(pickle.dumps(t)) == t
    assert t.sampled_tokens == 3


def test_defaults_are_the_issue_defaults() -> None:
    minimal = record()
    for key in ("messages", "timing", "extras", "tool_calls", "tool_failures"):
        del minimal[key]
    t = Trajectory(**minimal)
    assert (t.segment_idx, t.rewards, t.error, t.messages, t.timing, t.extras) == (
        0,
        {},
        None,
        [],
        {},
        {},
    )


def test_lengths_must_agree() -> None:
    with pytest.raises(pydantic.ValidationError, match="same length, got 4, 3 and 4"):
        Trajectory(**record(completion_mask=[1, 1, 0]))
    with pytest.raises(pydantic.ValidationError, match="same length, got 4, 4 and 5"):
        Trajectory(**record(logprobs=[-0.5, -1.25, 0.0, -0.125, -1.0]))


def test_mask_values_are_zero_or_one() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"0 or 1; not at \[2\]"):
        Trajectory(**record(completion_mask=[1, 1, 2, 1]))
    with pytest.raises(pydantic.ValidationError, match=r"0 or 1; not at \[0, 3\]"):
        Trajectory(**record(completion_mask=[-1, 1, 0, 5]))


def test_token_ids_are_not_negative() -> None:
    with pytest.raises(
        pydantic.ValidationError, match=r"prompt_ids holds negative token ids at \[1\]"
    ):
        Trajectory(**record(prompt_ids=[1, -2]))
    with pytest.raises(pydantic.ValidationError, match=r"completion_ids .* at \[3\]"):
        Trajectory(**record(completion_ids=[4, 5, 6, -7]))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_logprobs_are_refused_with_their_positions(bad: float) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        Trajectory(**record(logprobs=[-0.5, bad, 0.0, bad]))
    message = str(info.value)
    assert "NaN or infinite, at completion positions [1, 3]" in message
    assert "never reach JSON or a trainer" in message


def test_many_non_finite_positions_are_clipped_in_the_message() -> None:
    n = 30
    with pytest.raises(pydantic.ValidationError) as info:
        Trajectory(**record(completion_ids=[5] * n, completion_mask=[1] * n, logprobs=[NAN] * n))
    assert "and 20 more" in str(info.value)


def test_logprobs_are_zero_where_the_mask_is_zero() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"0\.0 where completion_mask is 0.*\[2\]"):
        Trajectory(**record(logprobs=[-0.5, -1.25, -3.0, -0.125]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reward", NAN),
        ("reward", INF),
        ("rewards", {"a": NAN}),
        ("timing", {"total": INF}),
    ],
)
def test_non_finite_rewards_and_timings_are_refused(field: str, value: Any) -> None:
    with pytest.raises(pydantic.ValidationError, match="finite"):
        Trajectory(**record(**{field: value}))


def test_non_finite_floats_nested_in_extras_or_messages_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="extras/scores/1"):
        Trajectory(**record(extras={"scores": [1.0, NAN]}))
    with pytest.raises(pydantic.ValidationError, match="messages/0/meta/x"):
        Trajectory(**record(messages=[{"role": "user", "content": "x", "meta": {"x": -INF}}]))


def test_non_finite_json_input_is_refused() -> None:
    text = json.dumps(record()).replace("-1.25", "NaN")
    with pytest.raises(pydantic.ValidationError):
        Trajectory.model_validate_json(text)


@pytest.mark.parametrize(
    "overrides",
    [
        {"stop_reason": "crashed"},
        {"unknown_field": 1},
        {"sample_idx": -1},
        {"prompt_ids": [1, -2]},
        {"policy_version_start": 5, "policy_version_end": 4},
        {"tool_calls": 1, "tool_failures": 2},
        {"error": {"not": "a string"}},
        {"turn_spans": [(0, 99)]},
        {"turn_spans": [(1, 0)]},
    ],
)
def test_bad_records_are_refused(overrides: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        Trajectory(**record(**overrides))


def test_records_are_frozen() -> None:
    t = Trajectory(**record())
    with pytest.raises(pydantic.ValidationError):
        t.reward = 2.0  # type: ignore[misc]


def test_check_finite_catches_in_place_mutation() -> None:
    t = Trajectory(**record())
    t.check_finite()
    t.logprobs[1] = NAN
    with pytest.raises(NonFiniteLogprobs) as info:
        t.check_finite()
    assert info.value.positions == (1,)
    t.logprobs[1] = -1.25
    t.extras["late"] = INF
    with pytest.raises(ValueError, match="extras/late"):
        t.check_finite()


def test_non_finite_helpers() -> None:
    assert non_finite_positions([0.0, -1.0, NAN, None, INF, "x"]) == [2, 3, 4, 5]  # type: ignore[list-item]
    assert non_finite_positions([0.0, None]) == [1]
    assert non_finite_positions([-1e308, -1e308]) == []  # the sum overflows, the values are fine
    assert non_finite_paths({"a": [1.0, {"b": NAN}], "c": (INF,)}) == ["/a/1/b", "/c/0"]
    assert non_finite_paths(NAN) == ["/"]


# -- SegmentBuilder ---------------------------------------------------------------------------------

EPISODE: dict[str, Any] = {
    "rollout_id": "r",
    "group_id": "g",
    "sample_idx": 0,
    "prompt_index": 0,
    "reward": 0.5,
    "policy_version_start": 0,
    "policy_version_end": 0,
    "stop_reason": "stop",
    "num_turns": 3,
}


def test_tool_and_template_tokens_from_the_next_prompt_are_masked() -> None:
    b = SegmentBuilder()
    b.add_turn([1, 2], [10, 11], [-0.1, -0.2])
    b.add_turn([1, 2, 10, 11, 90, 91, 92], [12], [-0.3])
    b.add_env_tokens([93])
    b.add_turn([1, 2, 10, 11, 90, 91, 92, 12, 93, 94], [13, 14], [-0.4, -0.5])
    (t,) = b.build(**EPISODE)
    assert t.segment_idx == 0
    assert b.rewrites == 0
    assert b.turns == 3
    assert t.prompt_ids == [1, 2]
    assert t.completion_ids == [10, 11, 90, 91, 92, 12, 93, 94, 13, 14]
    assert t.completion_mask == [1, 1, 0, 0, 0, 1, 0, 0, 1, 1]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert t.turn_spans == [(0, 2), (5, 6), (8, 10)]
    assert b.context_tokens == 12


def test_a_rewritten_history_starts_a_new_segment() -> None:
    b = SegmentBuilder()
    b.add_turn([1, 2], [10, 11], [-0.1, -0.2])
    # The template dropped the first completion's reasoning token 10 from history.
    b.add_turn([1, 2, 11, 90], [12], [-0.3])
    b.add_turn([1, 2, 11, 90, 12, 91], [13], [-0.4])
    first, second = b.build(**EPISODE)
    assert b.rewrites == 1
    assert (first.segment_idx, first.prompt_ids, first.completion_ids) == (0, [1, 2], [10, 11])
    assert first.logprobs == [-0.1, -0.2]
    assert second.segment_idx == 1
    assert second.prompt_ids == [1, 2, 11, 90]
    assert second.completion_ids == [12, 91, 13]
    assert second.completion_mask == [1, 0, 1]
    assert second.logprobs == [-0.3, 0.0, -0.4]
    assert [s.turns for s in b.segments] == [1, 2]
    assert first.rollout_id == second.rollout_id == "r"


def test_a_prompt_shorter_than_the_history_is_a_rewrite() -> None:
    b = SegmentBuilder()
    b.add_turn([1, 2, 3], [4], [-1.0])
    b.add_turn([1, 2], [5], [-1.0])
    assert [s.segment_idx for s in b.segments] == [0, 1]


def test_turn_mask_zeroes_logprobs_of_masked_tokens() -> None:
    b = SegmentBuilder()
    b.add_turn([1], [2, 3], [-0.5, -7.0], mask=[1, 0])
    (t,) = b.build(**EPISODE)
    assert (t.completion_mask, t.logprobs) == ([1, 0], [-0.5, 0.0])


def test_builder_refuses_bad_turns() -> None:
    b = SegmentBuilder()
    with pytest.raises(ValueError, match="2 completion ids but 1 logprobs"):
        b.add_turn([1], [2, 3], [-0.5])
    with pytest.raises(ValueError, match="a mask of 1"):
        b.add_turn([1], [2, 3], [-0.5, -0.5], mask=[1])
    with pytest.raises(ValueError, match="0 or 1"):
        b.add_turn([1], [2], [-0.5], mask=[2])
    with pytest.raises(NonFiniteLogprobs) as info:
        b.add_turn([1], [2, 3, 4], [-0.5, NAN, INF])
    assert info.value.positions == (1, 2)
    with pytest.raises(ValueError, match="before the first add_turn"):
        b.add_env_tokens([1])
    assert b.segments == []


def test_build_without_turns_gives_one_empty_record() -> None:
    (t,) = SegmentBuilder().build(**{**EPISODE, "stop_reason": "rollout_error", "error": "boom"})
    assert (t.prompt_ids, t.completion_ids, t.segment_idx, t.error) == ([], [], 0, "boom")


def test_build_refuses_token_fields() -> None:
    with pytest.raises(TypeError, match="prompt_ids"):
        SegmentBuilder().build(**EPISODE, prompt_ids=[1])


@st.composite
def episodes(draw: st.DrawFn) -> list[tuple[list[int], list[float], list[int], bool]]:
    """Turns: (completion ids, logprobs, env tokens appended after, history rewritten after)."""
    turns = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 5))
        ids = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        lps = draw(
            st.lists(
                st.floats(-20, 0, allow_nan=False, allow_infinity=False), min_size=n, max_size=n
            )
        )
        env = draw(st.lists(st.integers(0, 50), max_size=4))
        turns.append((ids, lps, env, draw(st.booleans())))
    return turns


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 50), min_size=1, max_size=5), turns=episodes())
def test_segments_never_misalign_sampled_tokens(
    prompt: list[int], turns: list[tuple[list[int], list[float], list[int], bool]]
) -> None:
    """Simulate a server re-rendering the conversation; a rewrite replaces the first token."""
    b = SegmentBuilder()
    history = list(prompt)
    expected_segments = 1
    pending_rewrite = False
    for ids, lps, env, rewrite in turns:
        if pending_rewrite:
            history = [history[0] + 1000, *history[1:]]  # the template changed the past
            expected_segments += 1
        b.add_turn(history, ids, lps)
        history = [*history, *ids, *env]
        pending_rewrite = rewrite
    records = b.build(**EPISODE)
    assert len(records) == expected_segments == b.rewrites + 1
    sampled = [
        (tok, lp)
        for r in records
        for tok, m, lp in zip(r.completion_ids, r.completion_mask, r.logprobs, strict=True)
        if m
    ]
    assert sampled == [
        (tok, lp) for ids, lps, _, _ in turns for tok, lp in zip(ids, lps, strict=True)
    ]
    assert all(
        lp == 0.0
        for r in records
        for m, lp in zip(r.completion_mask, r.logprobs, strict=True)
        if not m
    )
    assert all(math.isfinite(lp) for r in records for lp in r.logprobs)
    assert [r.segment_idx for r in records] == list(range(len(records)))


def test_builder_accepts_numpy_token_arrays() -> None:
    import numpy as np

    b = SegmentBuilder()
    b.add_turn(np.array([1, 2]), np.array([3]), np.array([-0.5]))
    b.add_turn(np.array([1, 2, 3, 4]), np.array([5]), np.array([-0.25]))
    (t,) = b.build(**EPISODE)
    assert t.completion_ids == [3, 4, 5]
    assert all(type(x) is int for x in [*t.prompt_ids, *t.completion_ids])
    assert all(type(x) is float for x in t.logprobs)
