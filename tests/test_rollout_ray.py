"""Rollout workers as Ray actors, on the session's real local Ray: episodes scaled out, a worker
killed mid-episode (evicted, replaced, only its episodes failed), no worker left (a clear
error), and batches handed to a trainer's Ray actor as ObjectRefs, never fetched by the driver.

The policy server is the scripted one (tests/support/policy_server.py); the tools run for real on each
worker's local pool.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.policy_server import (
    PolicyServer,
    Reply,
    Turn,
    leftover_workspaces,
    policy_server_fixture,
)
from support.ray_fixtures import RayCluster, ray_cluster, require_ray, settle, wait_for

ray = require_ray()

from agent_backend.backends.ray import RayPoolConfig  # noqa: E402
from agent_backend.errors import BackendUnavailable, RolloutError  # noqa: E402
from agent_backend.pool_file import DEFAULT_POOL  # noqa: E402
from agent_backend.rollout.episode import EpisodeConfig, ToolReward  # noqa: E402
from agent_backend.rollout.ledger import ResumeLedger  # noqa: E402
from agent_backend.rollout.pool import RolloutPool  # noqa: E402
from agent_backend.rollout.ray_workers import RayRolloutWorkers  # noqa: E402
from agent_backend.rollout.trajectory import Trajectory  # noqa: E402
from agent_backend.rollout.writers import JsonlWriter, read_trajectories  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
policy_server = policy_server_fixture
__all__ = ["ray_cluster"]  # the fixture, imported for this module


def prompts(count: int) -> list[dict[str, Any]]:
    return [{"prompt": f"task {i}", "answer": i} for i in range(count)]


def echo_task(turn: Turn) -> Reply:
    """One exec call that echoes the task, then an answer quoting its output."""
    if turn.index == 0:
        task = turn.messages[0]["content"]
        return Reply("", tool_calls=[("exec", {"command": f"echo '{task}' > t; cat t"})])
    return Reply("done: " + turn.last_tool_results()[0].strip())


def slow_echo_task(turn: Turn) -> Reply:
    """:func:`echo_task`, each reply 0.3 s late: episodes are still running when a worker dies."""
    return dataclasses.replace(echo_task(turn), delay=0.3)


def ray_workers(server: PolicyServer, model: str, root: Path, **overrides: Any) -> Any:
    settings: dict[str, Any] = {
        "name": "rollout-test",
        "num_cpus": 0.1,
        "replicas": 2,
        "max_concurrency": 4,
        "start_timeout": 90,
        "log_to_driver": False,
        "tools": ["support.ray_tools:echo"],
    }
    settings.update(overrides)
    # 4 spares, not 64: a worker holds at most max_concurrency sessions, and each spare's
    # sandbox agent is a Python process, started as the worker starts (a CPU-bound minute on a
    # loaded 2-core machine for two workers and a replacement at 64 each).
    tool_pool = DEFAULT_POOL.model_copy(
        update={"workspace_root": str(root), "kill_grace": 0.5, "spare_workspaces": 4}
    )
    return RayRolloutWorkers(
        RayPoolConfig.model_validate(settings),
        policy={"url": server.url, "model": model, "backoff": 0.01, "max_retries": 0},
        tool_pool=tool_pool,
        reward=ToolReward(("exec", {"command": "grep -q task t"})),
        episode=EpisodeConfig(timeout=60),
    )


def actor_states(ray_names: list[str]) -> set[str]:
    """The states Ray reports for these actors (DEAD once killed, ALIVE while they run)."""
    from ray._private import state

    wanted = set(ray_names)
    return {info["State"] for info in state.actors().values() if info["Name"] in wanted}


async def test_ray_workers_run_the_episodes(
    policy_server: PolicyServer, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    model = policy_server.add("ray-run", echo_task)
    root = tmp_path / "ray-ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=6)
    async with ray_workers(policy_server, model, root) as workers:
        assert workers.capacity == 8
        assert "2 live" in repr(workers)
        pool = RolloutPool(None, None, workers=workers, n=2, concurrency=8)
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await pool.run(prompts(6), ledger=ledger, writer=writer)
        assert (await workers.non_finite()).completions == 24  # 12 episodes x 2 turns
        assert workers.statistics().episodes == 12
        ray_names = workers.ray_names
        assert actor_states(ray_names) == {"ALIVE"}
    assert "closed" in repr(workers)
    await workers.aclose()  # idempotent
    assert leftover_workspaces(root) == []  # every worker closed its sessions
    assert actor_states(ray_names) == {"DEAD"}
    records = list(read_trajectories(tmp_path / "out.jsonl"))
    assert len(records) == 12
    assert all(t.stop_reason == "stop" and t.reward == 1.0 for t in records), [
        t.error for t in records
    ]
    assert {t.extras["worker"] for t in records} == {
        "rollout-test-rollout-0",
        "rollout-test-rollout-1",
    }
    assert (stats.episodes_done, ledger.trained_count) == (12, 6)


async def test_a_killed_worker_is_replaced_and_only_its_episodes_fail(
    policy_server: PolicyServer, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    model = policy_server.add("ray-killed", slow_echo_task)
    root = tmp_path / "ray-ws"
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=8)
    records: list[Trajectory] = []
    async with ray_workers(policy_server, model, root, max_restarts=1) as workers:
        # By reference: a lost episode's failed record is put in the object store by the driver.
        pool = RolloutPool(None, None, workers=workers, n=4, concurrency=4, max_buffered_groups=1)
        async with pool.stream(prompts(8), ledger=ledger, as_refs=True) as batches:
            # The first group's 4 episodes spread 2 and 2 over the workers; kill one mid-episode
            # (each is waiting for its first reply, 0.3 s late).
            # Each worker first starts its walled local pool (trial sandbox, spares).
            await wait_for(lambda: len(policy_server.requests_for(model)) == 4)
            victim = workers.workers[0]
            assert (victim.name, victim.state, victim.in_flight) == (
                "rollout-test-rollout-0",
                "live",
                2,
            )
            ray.kill(ray.get_actor(victim.ray_name), no_restart=True)
            async for batch in batches:
                records.extend(t for part in await _gather(batch) for t in part)
                # Later episodes must find the replacement up (it takes a few seconds to start).
                await settle(workers, lambda: workers.statistics().workers_live == 2, within=90)
        stats = workers.statistics()
        replacement = workers.workers[0]
        ray_names = workers.ray_names
    assert (stats.evictions, stats.restarts, stats.episodes_lost) == (1, 1, 2)
    assert replacement.name == "rollout-test-rollout-0.1"
    assert workers.statistics().closed

    # The killed worker's two episodes are failed records, with the cause; nothing else failed.
    reasons = collections.Counter(t.stop_reason for t in records)
    assert reasons == {"stop": 30, "env_error": 2}, [t.error for t in records]
    for lost in (t for t in records if t.stop_reason == "env_error"):
        assert lost.error is not None
        assert lost.error.startswith(
            "rollout worker rollout-test-rollout-0 was lost: ActorDiedError: "
        )
        assert "ray.kill" in lost.error
        assert (lost.prompt_index, lost.reward) == (0, 0.0)
    served_by = collections.Counter(t.extras.get("worker") for t in records)
    assert served_by["rollout-test-rollout-0.1"] >= 1  # the replacement served later episodes
    assert "rollout-test-rollout-0" not in served_by  # nothing came back from the dead one
    assert ledger.trained_count == 8
    assert pool.statistics().episodes_failed == 2

    # No actor left: the killed one, its replacement and the survivor are all dead.
    assert len(ray_names) == 3
    assert actor_states(ray_names) == {"DEAD"}
    # The killed worker could not close its sessions; its replacement, starting on the same
    # node, removed their workspaces (agent_backend/backends/local/owner.py).
    assert leftover_workspaces(root) == []


async def test_no_worker_and_no_restart_left_stops_the_run(
    policy_server: PolicyServer, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    model = policy_server.add("ray-none-left", slow_echo_task)
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=6)
    async with ray_workers(
        policy_server, model, tmp_path / "ray-ws", replicas=1, max_restarts=0
    ) as workers:
        pool = RolloutPool(None, None, workers=workers, n=2, concurrency=4)
        victim = workers.workers[0]

        async def kill_mid_episode() -> None:
            await wait_for(lambda: len(policy_server.requests_for(model)) >= 1)  # mid-episode
            ray.kill(ray.get_actor(victim.ray_name), no_restart=True)

        async with anyio.create_task_group() as group:
            group.start_soon(kill_mid_episode)
            with (
                JsonlWriter.open(tmp_path / "out.jsonl") as writer,
                pytest.raises(BackendUnavailable) as caught,
            ):
                await pool.run(prompts(6), ledger=ledger, writer=writer)
        ray_names = workers.ray_names
        assert workers.capacity == 0
    message = str(caught.value)
    assert "every Ray rollout worker of pool 'rollout-test' is dead and out of restarts" in message
    assert "rollout-test-rollout-0: ActorDiedError" in message
    # The episodes it was running ended as failed records; their group could not be resampled.
    assert pool.statistics().stop_reasons["env_error"] >= 1
    assert (ledger.trained_count, ledger.dropped_count, ledger.in_flight_count) == (0, 0, 0)
    assert ledger.cursor == 0  # nothing skipped: a resume redoes everything
    assert actor_states(ray_names) == {"DEAD"}


async def test_workers_refuse_episodes_before_start_and_after_close(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    from agent_backend.errors import PoolClosed, PoolError
    from agent_backend.rollout.episode import EpisodeIds

    workers = ray_workers(policy_server, "unused", tmp_path / "ray-ws")
    ids = EpisodeIds(rollout_id="r", group_id="g", prompt_index=0, sample_idx=0)
    with pytest.raises(PoolError, match="not started"):
        await workers.run_episode({"prompt": "x"}, ids, 0)
    await workers.aclose()  # never started: nothing to stop, and idempotent
    await workers.aclose()
    with pytest.raises(PoolClosed, match="closed"):
        await workers.run_episode_by_reference({"prompt": "x"}, ids, 0)
    with pytest.raises(RolloutError, match="started once"):
        await workers.start()


@pytest.fixture
def trajectory_unpickles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the Trajectory objects unpickled in this process (the driver)."""
    count: list[int] = []
    original = Trajectory.__setstate__

    def counting(self: Trajectory, state: Any) -> None:
        count.append(1)
        original(self, state)

    monkeypatch.setattr(Trajectory, "__setstate__", counting)
    return count


def trainer_actor() -> Any:
    """A trainer-like Ray actor: takes batches of refs, fetches them itself, counts the records.

    Defined here, not at module level, so that Ray ships the class by value rather than
    importing this test module in its worker.
    """

    class Trainer:
        def __init__(self) -> None:
            self.records = 0

        def train(self, refs: list[Any]) -> list[int]:
            import ray

            from agent_backend.rollout.ray_workers import fetch_batch

            if not all(isinstance(ref, ray.ObjectRef) for ref in refs):
                raise TypeError("a batch by reference holds ObjectRefs only")
            batch = fetch_batch(refs)
            self.records += len(batch)
            return [t.prompt_index for t in batch]

        def count(self) -> int:
            return self.records

    return ray.remote(num_cpus=0)(Trainer).remote()


async def test_batches_by_reference_feed_a_ray_trainer_without_the_driver_fetching_them(
    policy_server: PolicyServer,
    ray_cluster: RayCluster,
    tmp_path: Path,
    trajectory_unpickles: list[int],
) -> None:
    model = policy_server.add("ray-refs", echo_task)
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=6)
    produced = 0
    trained: list[list[int]] = []
    async with ray_workers(policy_server, model, tmp_path / "ray-ws") as workers:
        trainer = trainer_actor()
        pool = RolloutPool(None, None, workers=workers, n=2, concurrency=8)
        async with pool.stream(
            prompts(6), ledger=ledger, groups_per_batch=2, as_refs=True
        ) as batches:
            async for batch in batches:
                assert len(batch) == 4  # one ref per episode: 2 groups of 2
                assert all(isinstance(ref, ray.ObjectRef) for ref in batch)
                produced += batches.last_batch_records
                before = ledger.trained_count
                indexes = await trainer.train.remote(batch)
                assert len(indexes) == batches.last_batch_records
                trained.append(sorted(set(indexes)))
                # Marked trained only when the next batch is asked for, as for in-process batches.
                assert ledger.trained_count == before
                assert all(ledger.state(i) == "in_flight" for i in trained[-1])
                kept = batch[0]
        assert await trainer.count.remote() == produced == 12
        assert sorted(i for b in trained for i in b) == list(range(6))
        assert (ledger.trained_count, ledger.in_flight_count) == (6, 0)  # the last at a clean exit
        assert trajectory_unpickles == []  # the driver never materialized a record

        # A trainer that fails on its second batch: that batch stays in flight, then pending.
        ledger = ResumeLedger.open(tmp_path / "again.json", num_prompts=6)
        pool = RolloutPool(None, None, workers=workers, n=2, concurrency=8)
        seen: list[list[int]] = []
        with pytest.raises(ZeroDivisionError):  # noqa: PT012 - the trainer's loop is the block
            async with pool.stream(prompts(6), ledger=ledger, as_refs=True) as batches:
                async for batch in batches:
                    seen.append(sorted(set(await trainer.train.remote(batch))))
                    if len(seen) == 2:
                        raise ZeroDivisionError
        first, second = seen
        assert all(ledger.state(i) == "trained" for i in first)
        assert all(ledger.state(i) == "pending" for i in second)
        assert (ledger.trained_count, ledger.in_flight_count) == (1, 0)
        assert await trainer.count.remote() == 12 + 4

        # The check above can fail: fetching a ref here does unpickle its records.
        assert trajectory_unpickles == []
        assert len(await kept) == 1
        assert len(trajectory_unpickles) == 1
        ray.kill(trainer)


async def _gather(refs: list[Any]) -> list[Any]:
    """Fetch refs here (the test reads the records; a trainer would do this in its actor)."""
    return [await ref for ref in refs]
