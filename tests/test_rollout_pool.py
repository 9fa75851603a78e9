"""RolloutPool: GRPO groups sampled concurrently over real HTTP with real tools, delivered to a
JSONL writer or a trainer; stale groups dropped and never trained (nor pinning the resume
cursor), resume redoes what was in flight, one failed episode never aborts the others."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from support.policy_server import (
    PolicyServer,
    Reply,
    Turn,
    leftover_workspaces,
    local_dispatcher,
    policy_server_fixture,
    rollout_registry,
)
from support.ssh_helpers import backend_for
from support.sshd import SSHServer

from agent_backend.dispatch import Dispatcher
from agent_backend.errors import NonFiniteLogprobs, RolloutError
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.rollout.episode import EpisodeConfig
from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.policy import OpenAICompatiblePolicy
from agent_backend.rollout.pool import RolloutPool
from agent_backend.rollout.trajectory import Trajectory
from agent_backend.rollout.writers import JsonlWriter, read_trajectories

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
policy_server = policy_server_fixture


def prompts(count: int) -> list[dict[str, Any]]:
    return [{"prompt": f"task {i}", "answer": i} for i in range(count)]


def echo_task(turn: Turn) -> Reply:
    """One exec call that echoes the task, then an answer quoting its output."""
    if turn.index == 0:
        task = turn.messages[0]["content"]
        return Reply("", tool_calls=[("exec", {"command": f"echo '{task}' > t; cat t"})])
    return Reply("done: " + turn.last_tool_results()[0].strip())


def policy_for(server: PolicyServer, model: str, **options: Any) -> OpenAICompatiblePolicy:
    options.setdefault("backoff", 0.01)
    return OpenAICompatiblePolicy(server.url, model=model, **options)


def reward(episode: Any) -> float:
    return 1.0 if episode.final_text == f"done: task {episode.prompt['answer']}" else 0.0


def by_prompt(records: list[Trajectory]) -> dict[int, list[Trajectory]]:
    groups: dict[int, list[Trajectory]] = collections.defaultdict(list)
    for record in records:
        groups[record.prompt_index].append(record)
    return dict(groups)


async def test_run_writes_every_group_and_marks_it_trained(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-basic", echo_task)
    root = tmp_path / "ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=6)
    delivered: list[int] = []
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        pool = RolloutPool(policy, dispatcher, reward=reward, n=3, concurrency=4)
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await pool.run(
                prompts(6),
                ledger=ledger,
                writer=writer,
                on_group=lambda group: delivered.append(group[0].prompt_index),
            )
        assert dispatcher.statistics().sessions_open == 0
        assert leftover_workspaces(root) == []
    groups = by_prompt(list(read_trajectories(tmp_path / "out.jsonl")))
    assert sorted(groups) == sorted(delivered) == list(range(6))
    for index, group in groups.items():
        assert sorted(t.sample_idx for t in group) == [0, 1, 2]
        assert len({t.group_id for t in group}) == 1
        assert len({t.rollout_id for t in group}) == 3
        assert all(t.reward == 1.0 and t.stop_reason == "stop" for t in group), index
    assert (ledger.trained_count, ledger.cursor, ledger.in_flight_count) == (6, 6, 0)
    assert (stats.episodes_done, stats.episodes_failed, stats.groups_delivered) == (18, 0, 6)
    assert (stats.tool_calls, stats.turns) == (18, 36)
    assert stats.tool_calls_per_second > 0
    assert stats.stop_reasons == {"stop": 18}
    # The checkpoint on disk agrees: reopened, the ledger matches the file.
    reopened = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=6)
    with JsonlWriter.open(
        tmp_path / "out.jsonl", truncate_to=reopened.extra["writer_position"]
    ) as writer:
        reopened.reconcile(writer.prompt_indexes())
    assert "6 delivered" in repr(pool)


async def test_one_failed_episode_never_aborts_its_group_or_the_run(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    def script(turn: Turn) -> Reply:
        # The very first request of task 1 fails: exactly one of its samples.
        first_turn = turn.index == 0 and turn.attempt == 1
        if "task 1" in turn.messages[0]["content"] and first_turn:
            return Reply(status=500)
        return echo_task(turn)

    model = policy_server.add("pool-one-fails", script)
    root = tmp_path / "ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=3)
    async with (
        local_dispatcher(root) as dispatcher,
        policy_for(policy_server, model, max_retries=0) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, reward=reward, n=4, concurrency=8)
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await pool.run(prompts(3), ledger=ledger, writer=writer)
        assert leftover_workspaces(root) == []
    groups = by_prompt(list(read_trajectories(tmp_path / "out.jsonl")))
    assert sorted(groups) == [0, 1, 2]
    failed = [t for t in groups[1] if t.stop_reason == "rollout_error"]
    assert len(failed) == 1  # recorded with its error, delivered with its group
    assert failed[0].error is not None
    assert "HTTP 500" in failed[0].error
    assert failed[0].reward == 0.0
    assert sum(t.reward for t in groups[1]) == 3.0
    assert (stats.episodes_done, stats.episodes_failed, ledger.trained_count) == (12, 1, 3)


async def test_a_group_that_failed_entirely_is_retried_then_left_for_later(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    broken = {"on": True}

    def script(turn: Turn) -> Reply:
        if broken["on"] and "task 2" in turn.messages[0]["content"]:
            return Reply(status=503)
        return echo_task(turn)

    model = policy_server.add("pool-group-fails", script)
    path = tmp_path / "ledger.json"
    ledger = ResumeLedger.open(path, num_prompts=4)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model, max_retries=0) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4, group_retries=1)
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await pool.run(prompts(4), ledger=ledger, writer=writer)
        assert stats.groups_failed == 1
        assert stats.episodes_done == 8 + 2  # task 2 sampled twice
        assert (ledger.state(2), ledger.trained_count, ledger.cursor) == ("pending", 3, 2)
        assert sorted(by_prompt(list(read_trajectories(tmp_path / "out.jsonl")))) == [0, 1, 3]
        # A later run (the resume) redoes exactly the prompt that was left.
        broken["on"] = False
        ledger = ResumeLedger.open(path, num_prompts=4)
        with JsonlWriter.open(
            tmp_path / "out.jsonl", truncate_to=ledger.extra["writer_position"]
        ) as writer:
            ledger.reconcile(writer.prompt_indexes())
            pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
            again = await pool.run(prompts(4), ledger=ledger, writer=writer)
    assert again.episodes_done == 2
    assert (ledger.trained_count, ledger.cursor) == (4, 4)
    groups = by_prompt(list(read_trajectories(tmp_path / "out.jsonl")))
    assert {i: len(g) for i, g in groups.items()} == {0: 2, 1: 2, 2: 2, 3: 2}


async def test_a_dead_policy_server_stops_the_run_with_a_consistent_ledger(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-dead", [Reply(status=502)])
    root = tmp_path / "ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=20)
    async with (
        local_dispatcher(root) as dispatcher,
        policy_for(policy_server, model, max_retries=0) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4, max_failed_groups=3)
        with (
            JsonlWriter.open(tmp_path / "out.jsonl") as writer,
            pytest.raises(RolloutError, match=r"3 groups in a row failed.*HTTP 502"),
        ):
            await pool.run(prompts(20), ledger=ledger, writer=writer)
        assert dispatcher.statistics().sessions_open == 0
        assert leftover_workspaces(root) == []
    assert (ledger.trained_count, ledger.dropped_count, ledger.in_flight_count) == (0, 0, 0)
    assert ledger.cursor == 0
    assert (tmp_path / "out.jsonl").read_bytes() == b""


async def test_non_finite_fail_stops_the_run_and_drop_is_counted(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    def script(turn: Turn) -> Reply:
        if "task 1" in turn.messages[0]["content"]:
            return Reply("x", nan_at=(0,))
        return Reply("fine")

    model = policy_server.add("pool-nan", script)
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher:
        async with policy_for(policy_server, model, non_finite="fail") as policy:
            ledger = ResumeLedger.open(tmp_path / "fail.json", num_prompts=3)
            pool = RolloutPool(policy, dispatcher, n=2, concurrency=2)
            with (
                JsonlWriter.open(tmp_path / "fail.jsonl") as writer,
                pytest.raises(NonFiniteLogprobs),
            ):
                await pool.run(prompts(3), ledger=ledger, writer=writer)
            assert ledger.state(1) == "pending"
            assert ledger.in_flight_count == 0
        async with policy_for(policy_server, model, non_finite="drop") as policy:
            ledger = ResumeLedger.open(tmp_path / "drop.json", num_prompts=3)
            pool = RolloutPool(policy, dispatcher, n=2, concurrency=2)
            with JsonlWriter.open(tmp_path / "drop.jsonl") as writer:
                stats = await pool.run(prompts(3), ledger=ledger, writer=writer)
        assert leftover_workspaces(root) == []
    assert stats.rollouts_dropped == 2
    assert stats.non_finite.dropped_rollouts == 2
    assert (ledger.state(1), ledger.drop_reason(1)) == (
        "dropped",
        "dropped: every rollout had non-finite logprobs",
    )
    assert ledger.trained_count == 2
    assert sorted(by_prompt(list(read_trajectories(tmp_path / "drop.jsonl")))) == [0, 2]


async def test_stream_drops_stale_groups_and_never_counts_them_trained(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-stream", [Reply("ok", delay=0.02)])
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=10)
    trained_batches: list[list[int]] = []
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4, max_staleness=1)
        async with pool.stream(prompts(10), ledger=ledger) as batches:
            async for batch in batches:
                versions = {t.policy_version_start for t in batch}
                assert pool.policy_version - min(versions) <= 1  # never delivered stale
                trained_batches.append(sorted({t.prompt_index for t in batch}))
                await anyio.sleep(0.1)  # "training": the pool samples ahead meanwhile
                pool.set_policy_version(pool.policy_version + 2)  # every buffered group goes stale
        stats = pool.statistics()
    trained = sorted(i for batch in trained_batches for i in batch)
    dropped = [i for i in range(10) if ledger.state(i) == "dropped"]
    assert stats.groups_dropped == len(dropped) == ledger.dropped_count > 0
    assert set(trained).isdisjoint(dropped)
    assert sorted(trained + dropped) == list(range(10))  # nothing skipped, nothing twice
    assert ledger.trained_count == len(trained) == stats.groups_delivered
    assert ledger.cursor == 10
    assert all("stale" in (ledger.drop_reason(i) or "") for i in dropped)


async def test_stream_leaves_the_batch_in_training_in_flight_on_error(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-stream-error", [Reply("ok")])
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=8)
    seen: list[list[int]] = []
    root = tmp_path / "ws"
    async with local_dispatcher(root) as dispatcher, policy_for(policy_server, model) as policy:
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
        with pytest.raises(ZeroDivisionError):  # noqa: PT012 - the trainer's loop is the block
            async with pool.stream(prompts(8), ledger=ledger, groups_per_batch=2) as batches:
                async for batch in batches:
                    seen.append(sorted({t.prompt_index for t in batch}))
                    assert len(batch) == 4  # two whole groups
                    if len(seen) == 2:
                        raise ZeroDivisionError  # the trainer crashed on the second batch
        assert dispatcher.statistics().sessions_open == 0
        assert leftover_workspaces(root) == []
    first, second = seen
    assert all(ledger.state(i) == "trained" for i in first)
    assert all(ledger.state(i) == "pending" for i in second)  # redone, not lost
    assert ledger.trained_count == 2
    assert ledger.in_flight_count == 0


async def test_stream_early_exit_commits_the_last_batch_and_stops_sampling(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-stream-break", [Reply("ok", delay=0.05)])
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=50)
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
        async with pool.stream(prompts(50), ledger=ledger) as batches:
            async for batch in batches:
                taken = batch[0].prompt_index
                break
        assert pool.statistics().episodes_running == 0
        assert dispatcher.statistics().sessions_open == 0
    assert ledger.state(taken) == "trained"
    assert ledger.trained_count == 1
    assert ledger.in_flight_count == 0
    assert pool.statistics().episodes_done < 50 * 2  # it stopped sampling


async def test_concurrency_is_bounded(policy_server: PolicyServer, tmp_path: Path) -> None:
    running = 0
    peak = 0
    full = anyio.Event()
    registry = rollout_registry()

    @registry.tool
    async def hold() -> str:
        """Hold a slot until three are held (once), then for a moment."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        if running >= 3:
            full.set()
        # Each episode's session starts a sandbox first, so episodes reach here at their own
        # pace: wait for the third (bounded: a pool that never runs three at once fails).
        with anyio.move_on_after(30):
            await full.wait()
        await anyio.sleep(0.05)
        running -= 1
        return "held"

    def script(turn: Turn) -> Reply:
        return Reply("", tool_calls=[("hold", {})]) if turn.index == 0 else Reply("done")

    model = policy_server.add("pool-bounded", script)
    config = DEFAULT_POOL.model_copy(update={"workspace_root": str(tmp_path / "ws")})
    async with (
        load_pool(config) as backend,
        Dispatcher(registry, backend) as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=4, concurrency=3)
        stats = await _stream_all(pool, prompts(6))
    assert stats == 24
    assert peak == 3


async def test_the_groups_of_free_slots_start_in_one_step(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    # Episodes that may run at once start together, so that their first requests reach the
    # server together and are batched together. Claimed one per trip through the event loop,
    # they started one per loop iteration; beside a busy vLLM server an iteration took up to
    # ~150 ms, and 16 episodes took 2 s to start (bench/rollout_vllm_bench.py). Counted in
    # loop iterations here, not seconds: the same verdict on a fast or a slow machine.
    iterations = 0
    claimed_at: list[int] = []

    async def ticker() -> None:
        nonlocal iterations
        while True:
            await anyio.lowlevel.checkpoint()
            iterations += 1

    model = policy_server.add("pool-burst", lambda turn: Reply("done"))
    ledger = ResumeLedger(tmp_path / "ledger.json", num_prompts=20)
    claim = ledger.claim

    def counted_claim(count: int) -> list[int]:
        claimed = claim(count)
        claimed_at.extend([iterations] * len(claimed))
        return claimed

    ledger.claim = counted_claim  # type: ignore[method-assign]
    async with (
        local_dispatcher(tmp_path) as dispatcher,
        policy_for(policy_server, model) as policy,
        anyio.create_task_group() as group,
    ):
        group.start_soon(ticker)
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=8)
        async with pool.stream(prompts(20), ledger=ledger, groups_per_batch=20) as batches:
            async for batch in batches:
                assert len(batch) == 40
        group.cancel_scope.cancel()
    # 8 episodes at once, 2 per group: 4 groups running and one ahead, all claimed at once.
    assert len(claimed_at) == 20
    assert claimed_at[:5] == [claimed_at[0]] * 5, claimed_at


async def _stream_all(pool: RolloutPool, items: list[Any]) -> int:
    count = 0
    async with pool.stream(items) as batches:
        async for batch in batches:
            count += len(batch)
    return count


async def test_resume_after_an_interrupted_run_skips_nothing_and_repeats_nothing(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("pool-resume", [Reply("ok", delay=0.02)])
    path, out = tmp_path / "ledger.json", tmp_path / "out.jsonl"
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        ledger = ResumeLedger.open(path, num_prompts=12)
        pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
        with JsonlWriter.open(out) as writer, anyio.CancelScope() as scope:

            def interrupt(group: Any) -> None:
                if pool.statistics().groups_delivered == 5:
                    scope.cancel()  # Ctrl-C: the run ends at its next await

            await pool.run(prompts(12), ledger=ledger, writer=writer, on_group=interrupt)
        assert scope.cancelled_caught
        assert 5 <= ResumeLedger.open(path, num_prompts=12).trained_count < 12
        for _ in range(2):  # resuming twice changes nothing the second time
            ledger = ResumeLedger.open(path, num_prompts=12)
            with JsonlWriter.open(out, truncate_to=ledger.extra["writer_position"]) as writer:
                ledger.reconcile(writer.prompt_indexes())
                pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
                await pool.run(prompts(12), ledger=ledger, writer=writer)
    counts = collections.Counter(t.prompt_index for t in read_trajectories(out))
    assert counts == dict.fromkeys(range(12), 2)
    assert ResumeLedger.open(path, num_prompts=12).trained_count == 12


async def test_run_on_ssh(policy_server: PolicyServer, sshd: SSHServer, tmp_path: Path) -> None:
    model = policy_server.add("pool-ssh", echo_task)
    root = tmp_path / "ssh-ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=4)
    async with (
        backend_for(sshd, workspace_root=str(root)) as backend,
        Dispatcher(rollout_registry(), backend) as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        pool = RolloutPool(
            policy, dispatcher, reward=reward, n=3, concurrency=6, episode=EpisodeConfig(timeout=30)
        )
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await pool.run(prompts(4), ledger=ledger, writer=writer)
        assert dispatcher.statistics().sessions_open == 0
        assert backend.hosts[0].workspaces() == frozenset()
    assert leftover_workspaces(root) == []
    records = list(read_trajectories(tmp_path / "out.jsonl"))
    assert len(records) == 12
    assert all(t.reward == 1.0 for t in records), [t.error for t in records]
    assert {t.extras["host"] for t in records} == {f"{sshd.user}@127.0.0.1:{sshd.port}"}
    assert stats.tool_calls == 12


async def test_misuse_is_refused(policy_server: PolicyServer, tmp_path: Path) -> None:
    model = policy_server.add("pool-misuse", [Reply("ok")])
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        policy_for(policy_server, model) as policy,
    ):
        pool = RolloutPool(policy, dispatcher, n=1)
        ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=3)
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            with pytest.raises(RolloutError, match="for 3 prompts, and 2 were given"):
                await pool.run(prompts(2), ledger=ledger, writer=writer)
            with pytest.raises(RolloutError, match="prompt 1"):
                await pool.run(
                    [{"prompt": "x"}, {"q": 1}, {"prompt": "y"}], ledger=ledger, writer=writer
                )
        with pytest.raises(ValueError, match="only go up"):
            pool.set_policy_version(-1)
        await pool.aclose()
        await pool.aclose()
        with pytest.raises(RolloutError, match="closed"):
            await _stream_all(pool, prompts(1))
        with pytest.raises(ValueError, match="need Ray workers"):
            async with pool.stream(prompts(1), as_refs=True):
                pass
    with pytest.raises(ValueError, match="at least 1"):
        RolloutPool(policy, dispatcher, n=0)


def test_importing_the_pool_does_not_import_ray() -> None:
    # Ray scale-out lives in rollout.ray_workers, loaded on first use of its names.
    code = (
        "import sys, agent_backend.rollout.pool as pool\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "assert 'agent_backend.rollout.ray_workers' not in sys.modules\n"
        "try:\n"
        "    pool.NoSuchName\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")
