"""Non-finite logprobs: the mask / drop / fail policies, and their counters (a NaN let through
crashes tensor creation in a trainer)."""

from __future__ import annotations

import math
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_backend.errors import NonFiniteLogprobs, RolloutError
from agent_backend.rollout.logprobs import (
    NON_FINITE_POLICIES,
    NonFiniteCounters,
    NonFiniteStats,
    check_logprobs,
)
from agent_backend.rollout.trajectory import Trajectory

NAN, INF = float("nan"), float("inf")


def test_policies_are_the_three_of_the_issue() -> None:
    assert NON_FINITE_POLICIES == ("mask", "drop", "fail")


def test_finite_logprobs_pass_unchanged_under_every_policy() -> None:
    for policy in NON_FINITE_POLICIES:
        check = check_logprobs([-0.5, -1.0, 0.0], policy=policy)  # type: ignore[arg-type]
        assert (check.logprobs, check.mask, check.count, check.drop, check.error) == (
            [-0.5, -1.0, 0.0],
            [1, 1, 1],
            0,
            False,
            None,
        )


def test_mask_policy_masks_only_the_bad_tokens() -> None:
    counters = NonFiniteCounters()
    check = check_logprobs([-0.5, NAN, -1.0, -INF, None], policy="mask", counters=counters)
    assert check.logprobs == [-0.5, 0.0, -1.0, 0.0, 0.0]
    assert check.mask == [1, 0, 1, 0, 0]
    assert (check.count, check.positions, check.drop, check.error) == (3, (1, 3, 4), False, None)
    assert counters.snapshot() == NonFiniteStats(
        completions=1, tokens=5, non_finite_tokens=3, masked_tokens=3
    )


def test_drop_policy_flags_the_rollout_and_still_returns_safe_lists() -> None:
    counters = NonFiniteCounters()
    check = check_logprobs([INF, -0.5], policy="drop", counters=counters)
    assert check.drop is True
    assert check.error is not None
    assert "rollout dropped" in check.error
    assert "0=inf" in check.error
    assert check.logprobs == [0.0, -0.5]
    assert check.mask == [0, 1]
    assert counters.snapshot().dropped_rollouts == 1
    assert counters.snapshot().masked_tokens == 0


def test_fail_policy_raises_with_positions_and_counts_the_failure() -> None:
    counters = NonFiniteCounters()
    with pytest.raises(NonFiniteLogprobs) as info:
        check_logprobs([-0.1, NAN, -0.2, NAN], policy="fail", counters=counters)
    assert info.value.positions == (1, 3)
    assert "2 non-finite logprobs at completion positions [1=nan, 3=nan]" in str(info.value)
    assert isinstance(info.value, RolloutError)
    assert counters.snapshot().failures == 1
    restored = pickle.loads(pickle.dumps(info.value))
    assert restored.positions == (1, 3)
    assert str(restored) == str(info.value)


def test_fail_is_the_default_policy() -> None:
    with pytest.raises(NonFiniteLogprobs):
        check_logprobs([NAN])


def test_positions_already_masked_do_not_count_and_become_zero() -> None:
    counters = NonFiniteCounters()
    check = check_logprobs([NAN, -3.0, -1.0], [0, 0, 1], policy="fail", counters=counters)
    assert (check.logprobs, check.mask, check.count) == ([0.0, 0.0, -1.0], [0, 0, 1], 0)
    assert counters.snapshot().non_finite_tokens == 0


def test_long_error_messages_are_clipped() -> None:
    with pytest.raises(NonFiniteLogprobs) as info:
        check_logprobs([NAN] * 100)
    assert "and 90 more" in str(info.value)
    assert len(info.value.positions) == 100


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown non-finite logprob policy 'ignore'"):
        check_logprobs([0.0], policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 logprobs but a mask of 1"):
        check_logprobs([0.0, 0.0], [1])


def test_counters_accumulate_across_threads() -> None:
    counters = NonFiniteCounters()

    def work() -> None:
        for _ in range(200):
            check_logprobs([NAN, -1.0], policy="mask", counters=counters)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = counters.snapshot()
    assert (stats.completions, stats.tokens, stats.masked_tokens) == (800, 1600, 800)
    assert "masked=800" in repr(counters)


values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(
    logprobs=st.lists(values, max_size=30),
    data=st.data(),
    policy=st.sampled_from(["mask", "drop"]),
)
def test_what_comes_out_is_always_storable(
    logprobs: list[float | None], data: st.DataObject, policy: str
) -> None:
    mask = data.draw(st.lists(st.integers(0, 1), min_size=len(logprobs), max_size=len(logprobs)))
    check = check_logprobs(logprobs, mask, policy=policy)  # type: ignore[arg-type]
    assert all(math.isfinite(lp) for lp in check.logprobs)
    assert all(lp == 0.0 for lp, m in zip(check.logprobs, check.mask, strict=True) if m == 0)
    bad = [
        i
        for i, (lp, m) in enumerate(zip(logprobs, mask, strict=True))
        if m and (lp is None or not math.isfinite(lp))
    ]
    assert list(check.positions) == bad
    assert check.count == len(bad)
    assert check.drop == (policy == "drop" and bool(bad))
    # Always acceptable to a Trajectory: NaN never reaches JSON or a trainer.
    Trajectory(
        rollout_id="r",
        group_id="g",
        sample_idx=0,
        prompt_index=0,
        prompt_ids=[1],
        completion_ids=[5] * len(logprobs),
        completion_mask=check.mask,
        logprobs=check.logprobs,
        reward=0.0,
        policy_version_start=0,
        policy_version_end=0,
        stop_reason="rollout_error" if check.drop else "stop",
        num_turns=1,
        error=check.error,
    )
