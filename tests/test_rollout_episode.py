"""Episodes: the scripted policy over real HTTP, tools run for real on the local backend and on
a real sshd. Token ids and the mask line up with what was sampled; every failure becomes a
recorded trajectory; the episode's session is closed on every way out (no leaked sandbox)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.policy_server import (
    END,
    PolicyServer,
    Reply,
    Turn,
    decode,
    encode,
    leftover_workspaces,
    local_dispatcher,
    policy_server_fixture,
    render,
    rollout_registry,
)
from support.ssh_helpers import backend_for, kill_leftovers, no_process_left, unique_duration
from support.sshd import SSHServer

from agent_backend.dispatch import Dispatcher
from agent_backend.errors import NonFiniteLogprobs
from agent_backend.rollout.episode import (
    EpisodeConfig,
    EpisodeIds,
    RewardInput,
    ToolReward,
    prompt_messages,
    run_episode,
)
from agent_backend.rollout.policy import OpenAICompatiblePolicy
from agent_backend.rollout.trajectory import Trajectory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
policy_server = policy_server_fixture

PROMPT = [{"role": "user", "content": "write hello to out.txt and show it"}]
IDS = EpisodeIds(rollout_id="r-1", group_id="g-1", prompt_index=7, sample_idx=3)


def write_then_cat(turn: Turn) -> Reply:
    if turn.index == 0:
        return Reply(
            "writing",
            tool_calls=[("write_file", {"path": "out.txt", "content": "hello from the tool\n"})],
        )
    if turn.index == 1:
        return Reply("reading", tool_calls=[("exec", {"command": "cat out.txt"})])
    return Reply("the file says: " + turn.last_tool_results()[0].strip())


def policy_for(server: PolicyServer, model: str, **options: Any) -> OpenAICompatiblePolicy:
    options.setdefault("backoff", 0.01)
    return OpenAICompatiblePolicy(server.url, model=model, **options)


def assert_no_leak(dispatcher: Dispatcher, root: Path) -> None:
    stats = dispatcher.statistics()
    assert (stats.sessions_open, stats.calls_in_flight) == (0, 0)
    assert leftover_workspaces(root) == []


async def test_tools_run_for_real_and_tokens_line_up(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-basic", write_then_cat)
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, ids=IDS)
        assert_no_leak(dispatcher, root)
        tools = dispatcher.registry.to_openai()
    assert record.stop_reason == "stop", record.error
    assert (record.rollout_id, record.group_id, record.prompt_index, record.sample_idx) == (
        "r-1",
        "g-1",
        7,
        3,
    )
    assert (record.num_turns, record.tool_calls, record.tool_failures) == (3, 2, 0)
    assert record.messages[-1]["content"] == "the file says: hello from the tool"
    tool_messages = [m for m in record.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages][1] == "hello from the tool\n"
    # The prompt is turn 0's; the completion is every sampled token (mask 1) with the
    # tool and template tokens between them taken from the next prompt (mask 0).
    assert record.prompt_ids == encode(render(PROMPT, tools))
    full = record.prompt_ids + record.completion_ids
    final_prompt = encode(render(record.messages[:-1], tools))
    assert full[: len(final_prompt)] == final_prompt
    sampled = [t for t, m in zip(record.completion_ids, record.completion_mask, strict=True) if m]
    unsampled = [
        t for t, m in zip(record.completion_ids, record.completion_mask, strict=True) if not m
    ]
    write = {"path": "out.txt", "content": "hello from the tool\n"}
    expected_samples = (
        f"writing<tool_call>{json.dumps({'name': 'write_file', 'arguments': write})}</tool_call>"
        + END
        + 'reading<tool_call>{"name": "exec", "arguments": {"command": "cat out.txt"}}</tool_call>'
        + END
        + "the file says: hello from the tool"
        + END
    )
    assert decode(sampled) == expected_samples  # exactly the three turns, nothing else
    assert "hello from the tool" in decode(unsampled)  # tool output: mask 0
    assert "<|tool|>" in decode(unsampled)  # template tokens: mask 0
    assert all(
        lp == 0.0 for lp, m in zip(record.logprobs, record.completion_mask, strict=True) if not m
    )
    assert all(lp < 0 for lp, m in zip(record.logprobs, record.completion_mask, strict=True) if m)
    assert set(record.timing) >= {"policy", "tools", "env", "reward", "total"}
    parts = record.timing["policy"] + record.timing["tools"] + record.timing["env"]
    assert 0 < parts <= record.timing["total"]
    assert record.extras["host"] == "local"


async def test_hermes_calls_and_python_tools(policy_server: PolicyServer, tmp_path: Path) -> None:
    def script(turn: Turn) -> Reply:
        if turn.index == 0:
            return Reply("", tool_calls=[("add", {"a": 2, "b": "40"})], format="hermes")
        return Reply(f"sum={turn.last_tool_results()[0]}")

    model = policy_server.add("episode-hermes", script)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode({"prompt": "add"}, policy=policy, dispatcher=dispatcher)
    assert record.stop_reason == "stop"
    assert record.messages[-1]["content"] == "sum=42"  # "40" repaired to 40 by the schema


async def test_model_facing_errors_go_back_to_the_policy(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    seen: list[list[str]] = []

    def script(turn: Turn) -> Reply:
        seen.append(turn.last_tool_results())
        if turn.index == 0:
            return Reply(
                "",
                tool_calls=[
                    ("exce", {"command": "ls"}),
                    ("exec", '{"command": "ls"'),  # malformed JSON: never run with {}
                    ("read_file", {"path": "../../etc/passwd"}),
                    ("exec", {"command": "exit 4"}),
                ],
            )
        return Reply("giving up")

    model = policy_server.add("episode-errors", script)
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
        assert_no_leak(dispatcher, root)
    assert record.stop_reason == "stop"
    assert (record.tool_calls, record.tool_failures) == (4, 4)
    unknown, malformed, outside, exit4 = seen[1]
    assert unknown.startswith("Error: Unknown tool 'exce'")
    assert "exec" in unknown
    assert malformed.startswith("Error: ")
    assert "argument" in malformed.lower()
    assert "outside the workspace" in outside
    assert exit4.startswith("Error: the command exited with status 4")


async def test_max_tool_failures_ends_with_tool_error(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add(
        "episode-failing", [Reply("", tool_calls=[("exec", {"command": "false"})])]
    )
    config = EpisodeConfig(max_tool_failures=2)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, config=config)
    assert record.stop_reason == "tool_error"
    assert record.error is not None
    assert "2 tool calls in a row failed" in record.error
    assert (record.num_turns, record.tool_failures) == (2, 2)


async def test_max_turns_does_not_run_the_last_turns_calls(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add(
        "episode-forever", [Reply("again", tool_calls=[("exec", {"command": "echo x >> log"})])]
    )
    reward_saw: list[str] = []

    async def reward(episode: RewardInput) -> float:
        result = await episode.session.call(("exec", {"command": "wc -l < log"}))
        reward_saw.append(result.output.strip())
        return 0.5

    config = EpisodeConfig(max_turns=3)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(
            PROMPT, policy=policy, dispatcher=dispatcher, config=config, reward=reward
        )
    assert record.stop_reason == "max_turns"
    assert (record.num_turns, record.tool_calls) == (3, 2)
    assert reward_saw == ["2"]  # the reward ran in the episode's own workspace
    assert record.reward == 0.5


async def test_token_budget_ends_with_length(policy_server: PolicyServer, tmp_path: Path) -> None:
    model = policy_server.add(
        "episode-budget", [Reply("more", tool_calls=[("exec", {"command": "seq 1 50"})])]
    )
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        first = await policy.generate(prompt_messages(PROMPT), dispatcher.registry.to_openai())
        budget = len(first.prompt_ids) + len(first.completion_ids) + 200
        config = EpisodeConfig(max_total_tokens=budget, max_turns=50)
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, config=config)
    assert record.stop_reason == "length"
    assert 1 < record.num_turns < 50
    assert len(record.prompt_ids) + len(record.completion_ids) >= budget - 200
    sent = [r.get("max_tokens") for r in policy_server.requests_for(model)]
    assert all(isinstance(m, int) and m <= budget for m in sent[1:])


async def test_policy_length_finish_reason(policy_server: PolicyServer, tmp_path: Path) -> None:
    model = policy_server.add("episode-long", [Reply("y" * 500)])
    config = EpisodeConfig(max_tokens_per_turn=16)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, config=config)
    assert record.stop_reason == "length"
    assert sum(record.completion_mask) == 16


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        (lambda episode: 1.0 if "42" in episode.final_text else 0.0, (1.0, {})),
        (lambda episode: {"format": 0.25, "answer": 1.0}, (1.25, {"format": 0.25, "answer": 1.0})),
    ],
    ids=["sync", "named"],
)
async def test_callable_rewards(
    policy_server: PolicyServer,
    tmp_path: Path,
    reward: Callable[[RewardInput], Any],
    expected: tuple[float, dict[str, float]],
) -> None:
    model = policy_server.add("episode-answer", [Reply("the answer is 42")])
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, reward=reward)
    assert (record.reward, record.rewards) == expected


async def test_tool_reward_runs_the_tests_in_the_workspace(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-tool-reward", write_then_cat)
    check = ToolReward(("exec", {"argv": ["grep", "-q", "hello", "out.txt"]}))
    wrong = ToolReward(("exec", {"argv": ["grep", "-q", "goodbye", "out.txt"]}))
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [good] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, reward=check)
        [bad] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, reward=wrong)
    assert (good.reward, bad.reward) == (1.0, 0.0)
    assert good.timing["reward"] > 0


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (lambda episode: 1 / 0, "ZeroDivisionError"),
        (lambda episode: math.nan, "not finite"),
        (lambda episode: "high", "a number or a mapping"),
    ],
    ids=["raises", "nan", "not-a-number"],
)
async def test_bad_rewards_are_recorded(
    policy_server: PolicyServer, tmp_path: Path, reward: Callable[[RewardInput], Any], message: str
) -> None:
    model = policy_server.add("episode-bad-reward", [Reply("done")])
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, reward=reward)
        assert_no_leak(dispatcher, root)
    assert record.stop_reason == "rollout_error"
    assert record.error is not None
    assert message in record.error
    assert record.reward == 0.0


async def test_history_rewrite_starts_a_new_segment(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    def script(turn: Turn) -> Reply:
        if turn.index < 2:
            return Reply(
                f"<think>step {turn.index}</think>", tool_calls=[("add", {"a": 1, "b": 1})]
            )
        return Reply("<think>end</think>done")

    model = policy_server.add("episode-rewrite", script, strip_think=True)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        records = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, ids=IDS)
        tools = dispatcher.registry.to_openai()
    assert [r.segment_idx for r in records] == [0, 1, 2]
    assert {r.rollout_id for r in records} == {"r-1"}
    assert all(r.num_turns == 3 and r.stop_reason == "stop" for r in records)
    for k, record in enumerate(records):
        # Each segment starts from the prompt the server really rendered for that turn.
        assert record.prompt_ids == encode(
            render(record.messages[: 1 + 2 * k], tools, strip_think=True)
        )
        assert sum(record.completion_mask) == len(record.completion_ids)  # one turn each
    assert records[0].extras["history_rewrites"] == 2


async def test_policy_failure_is_recorded_and_the_session_closed(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    def script(turn: Turn) -> Reply:
        if turn.index == 0:
            return Reply("", tool_calls=[("write_file", {"path": "a", "content": "x"})])
        return Reply(status=503)

    model = policy_server.add("episode-503", script)
    root = tmp_path / "ws"
    async with (
        local_dispatcher(root) as dispatcher,
        policy_for(policy_server, model, max_retries=1) as policy,
    ):
        [record] = await run_episode(
            PROMPT, policy=policy, dispatcher=dispatcher, reward=lambda e: 1.0
        )
        assert_no_leak(dispatcher, root)
    assert record.stop_reason == "rollout_error"
    assert record.error is not None
    assert "PolicyError" in record.error
    assert "503" in record.error
    assert (record.num_turns, record.tool_calls, record.reward) == (1, 1, 0.0)
    assert len(record.completion_ids) > 0  # what was sampled before the failure is kept


async def test_missing_logprobs_fail_the_episode_not_the_mask(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-no-logprobs", [Reply("hi", omit=frozenset({"logprobs"}))])
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
    assert record.stop_reason == "rollout_error"
    assert record.error is not None
    assert "without logprobs" in record.error
    assert record.completion_ids == []
    assert record.completion_mask == []


async def test_non_finite_drop_and_fail(policy_server: PolicyServer, tmp_path: Path) -> None:
    model = policy_server.add("episode-nan", [Reply("abc", nan_at=(1,), inf_at=(2,))])
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher:
        async with policy_for(policy_server, model, non_finite="drop") as policy:
            [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
        assert record.stop_reason == "rollout_error"
        assert record.extras["dropped"] is True
        assert record.extras["non_finite_logprobs"] == 2
        assert all(math.isfinite(lp) for lp in record.logprobs)
        record.check_finite()
        async with policy_for(policy_server, model, non_finite="mask") as policy:
            [masked] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
        assert masked.stop_reason == "stop"
        assert masked.completion_mask[1:3] == [0, 0]
        async with policy_for(policy_server, model, non_finite="fail") as policy:
            with pytest.raises(NonFiniteLogprobs):
                await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
        assert_no_leak(dispatcher, root)


async def test_episode_timeout_kills_the_tool_and_removes_the_workspace(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    duration = unique_duration()
    model = policy_server.add(
        "episode-slow-tool", [Reply("", tool_calls=[("exec", {"command": f"sleep {duration}"})])]
    )
    root = tmp_path / "ws"
    try:
        async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
            with anyio.fail_after(20):
                [record] = await run_episode(
                    PROMPT,
                    policy=policy,
                    dispatcher=dispatcher,
                    config=EpisodeConfig(timeout=1.0),
                    reward=lambda e: 1.0,
                )
            assert_no_leak(dispatcher, root)
        assert record.stop_reason == "timeout"
        assert record.error is not None
        assert "1 s" in record.error
        assert record.reward == 0.0
        assert 1.0 <= record.timing["total"] < 10
        assert await no_process_left(f"sleep {duration}") == []
    finally:
        kill_leftovers(f"sleep {duration}")


async def test_cancelled_episode_closes_its_session(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    duration = unique_duration()
    model = policy_server.add(
        "episode-cancelled", [Reply("", tool_calls=[("exec", {"command": f"sleep {duration}"})])]
    )
    root = tmp_path / "ws"
    try:
        async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
            with anyio.move_on_after(1.0) as scope:
                await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
            assert scope.cancelled_caught  # cancellation propagates: it is not a failed episode
            assert_no_leak(dispatcher, root)
        assert await no_process_left(f"sleep {duration}") == []
    finally:
        kill_leftovers(f"sleep {duration}")


async def test_environment_failure_is_an_env_error(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-env", write_then_cat)
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        # The workspace root becomes a file: no workspace can be made any more.
        shutil.rmtree(root)
        root.write_text("a file where the workspaces should go")
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
        assert dispatcher.statistics().sessions_open == 0
        root.unlink()
        await dispatcher.aclose()
        [closed] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher)
    assert record.stop_reason == "env_error"
    assert record.error is not None
    assert record.error.startswith("BackendUnavailable")
    assert record.num_turns == 0
    assert closed.stop_reason == "env_error"
    assert closed.error is not None
    assert closed.error.startswith("PoolClosed")
    assert policy_server.requests_for(model) == []


async def test_prompt_shapes() -> None:
    assert prompt_messages("hi") == [{"role": "user", "content": "hi"}]
    assert prompt_messages({"prompt": "hi", "answer": 3}) == [{"role": "user", "content": "hi"}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert prompt_messages({"messages": messages}) == messages
    with pytest.raises(ValueError, match="a prompt is"):
        prompt_messages({"question": "hi"})


async def test_bad_prompt_is_a_recorded_failure(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-bad-prompt", [Reply("x")])
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode({"question": 1}, policy=policy, dispatcher=dispatcher)
    assert record.stop_reason == "rollout_error"
    assert policy_server.requests_for(model) == []


# -- SSH -------------------------------------------------------------------------------------------


async def test_episode_on_ssh(policy_server: PolicyServer, sshd: SSHServer, tmp_path: Path) -> None:
    model = policy_server.add("episode-ssh", write_then_cat)
    root = tmp_path / "ssh-ws"
    check = ToolReward(("exec", {"command": "test -f out.txt && echo $SSH_CONNECTION"}))
    async with (
        backend_for(sshd, workspace_root=str(root)) as pool,
        Dispatcher(rollout_registry(), pool) as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        [record] = await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, reward=check)
        assert_no_leak(dispatcher, root)
        assert pool.hosts[0].workspaces() == frozenset()
    assert record.stop_reason == "stop", record.error
    assert record.reward == 1.0
    assert record.messages[-1]["content"] == "the file says: hello from the tool"
    assert record.extras["host"] == f"{sshd.user}@127.0.0.1:{sshd.port}"


async def test_ssh_host_lost_mid_episode_is_an_env_error(
    policy_server: PolicyServer, sshd: SSHServer, tmp_path: Path
) -> None:
    duration = unique_duration()
    model = policy_server.add(
        "episode-ssh-lost", [Reply("", tool_calls=[("exec", {"command": f"sleep {duration}"})])]
    )
    root = tmp_path / "ssh-ws"
    async with (
        backend_for(sshd, workspace_root=str(root), connect_timeout=2.0) as pool,
        Dispatcher(rollout_registry(), pool, default_timeout=5.0) as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        results: list[Trajectory] = []

        async def episode() -> None:
            results.extend(await run_episode(PROMPT, policy=policy, dispatcher=dispatcher))

        with anyio.fail_after(40):
            async with anyio.create_task_group() as group:
                group.start_soon(episode)
                await anyio.sleep(1.0)
                await sshd.akill()
        assert dispatcher.statistics().sessions_open == 0
    [record] = results
    assert record.stop_reason == "env_error", record.error
    assert record.error is not None


def cat_prepared(turn: Turn) -> Reply:
    if turn.index == 0:
        return Reply("looking", tool_calls=[("exec", {"command": "cat prepared; echo mine > x"})])
    return Reply("it says: " + turn.last_tool_results()[0].strip())


async def test_a_group_starts_its_episodes_from_one_prepared_workspace(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("episode-forked", cat_prepared)
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        async with dispatcher.session() as prepared:
            made = await prepared.call(("exec", {"command": "echo checked-out > prepared"}))
            assert made.ok, made
            forks = await prepared.fork(2)
            results = [
                await run_episode(PROMPT, policy=policy, dispatcher=dispatcher, session=fork)
                for fork in forks
            ]
            assert all(fork.is_closed() for fork in forks)  # each closed with its episode
            left = await prepared.call(("exec", {"command": "ls"}))
            assert left.output == "prepared\n"  # the episodes' writes stayed in their forks
        assert_no_leak(dispatcher, root)
    for [record] in results:
        assert record.stop_reason == "stop", record.error
        assert record.messages[-1]["content"] == "it says: checked-out"
