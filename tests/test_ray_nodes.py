"""Nodes as failure domains, on a real multi-node Ray: several raylets on this machine.

``support.ray_nodes.LocalNodes``: a head without CPUs (every actor lives on a worker node)
and worker nodes added and killed by the tests, loopback only. Nodes are killed with
``remove_node(allow_graceful=False)``: the raylet and its workers are SIGKILLed, as when a
machine goes away, and Ray finds out through its health checks (shortened here so that a
test waits seconds, not half a minute; the logic does not depend on their length).

The driver of this module is connected to this cluster, not to the session's local Ray: the
session's is shut down first and started again by the next module that needs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from support.ray_fixtures import TESTS_DIR, pool_config, require_ray, settle
from support.ray_nodes import LocalNodes

ray = require_ray()

from agent_backend.backends.ray import RayBackend  # noqa: E402
from agent_backend.errors import ResourceUnavailable  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400), pytest.mark.xdist_group("ray-nodes")]

#: Ray's node health checks, shortened: a killed node is marked dead in about 1.5 s.
_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def nodes() -> Iterator[LocalNodes]:
    if ray.is_initialized():
        ray.shutdown()  # the session's local Ray: the next module that needs it starts it again
    cluster = LocalNodes(_HEALTH)
    try:
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            job_config=ray.job_config.JobConfig(code_search_path=[TESTS_DIR]),
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def three(nodes: LocalNodes) -> dict[str, str]:
    """Three worker nodes, by role: two with one GPU, one with two (started once: a node
    takes seconds to register)."""
    return {
        "one": nodes.add(num_gpus=1),
        "other": nodes.add(num_gpus=1),
        "two": nodes.add(num_gpus=2),
    }


def _on(pool: RayBackend, node_id: str) -> list[Any]:
    return [a for a in pool.actors() if a.node_id == node_id and a.state == "live"]


async def test_a_pool_no_node_can_hold_fails_at_once_with_each_nodes_shape(
    three: dict[str, str],
) -> None:
    started = time.monotonic()
    with pytest.raises(ResourceUnavailable) as info:  # 4 GPUs in the cluster, at most 2 on a node
        async with RayBackend.from_config(pool_config(num_gpus=3, num_cpus=0.1)):
            pass
    assert time.monotonic() - started < 30  # at once: no start_timeout waited out
    message = info.value.message
    assert "GPU=3 on one node" in message, message
    assert message.count("holds 0") == 4, message  # the head (no CPU) too
    assert info.value.available["GPU"] == 4.0
    with pytest.raises(ResourceUnavailable, match="hold only 1"):  # 2 replicas of 2 GPUs
        async with RayBackend.from_config(pool_config(num_gpus=2, num_cpus=0.1, replicas=2)):
            pass


async def test_placement_by_labels_and_by_placement_group(three: dict[str, str]) -> None:
    target = three["other"]
    labelled = pool_config(
        "support.ray_tools:node_hold",
        replicas=2,
        num_cpus=0.1,
        node_labels={"ray.io/node-id": target},
    )
    async with RayBackend.from_config(labelled) as pool:
        assert {a.node_id for a in pool.actors()} == {target}
    grouped = pool_config(
        "support.ray_tools:group_gpus",
        num_cpus=0.1,
        num_gpus=1,
        bundles=[{"CPU": 0.1, "GPU": 1}, {"GPU": 1}],  # two GPUs of one node
    )
    async with RayBackend.from_config(grouped) as pool:
        # Its child task needs a Ray worker started for it: seconds idle, over 30 s under load.
        where = (await pool.call("group_gpus", timeout=300)).value
        # The actor's child task ran in its group's second bundle: same node, the other GPU.
        assert where["node_id"] == three["two"]
        assert where["child"]["node_id"] == where["node_id"]
        assert sorted([*where["gpu_ids"], *where["child"]["gpu_ids"]]) == ["0", "1"]
        assert len(_live_groups()) == 1
    packed = pool_config("support.ray_tools:node_hold", replicas=3, num_cpus=0.5, strategy="pack")
    async with RayBackend.from_config(packed) as pool:
        assert len({a.node_id for a in pool.actors()}) == 1  # 1.5 CPUs fit on one node
        assert len(_live_groups()) == 1  # the pool's
    assert _live_groups() == []  # every group is removed with its pool


def _live_groups() -> list[str]:
    from ray.util import placement_group_table

    return [
        group_id
        for group_id, group in placement_group_table().items()
        if group["state"] != "REMOVED"
    ]


# Tests that kill nodes come last (pytest runs a module in file order).


async def test_a_node_killed_mid_call_loses_no_idempotent_call(
    nodes: LocalNodes, three: dict[str, str]
) -> None:
    ids = list(three.values())
    config = pool_config(
        {"function": "support.ray_tools:node_hold", "idempotent": True},
        replicas=3,
        num_cpus=0.5,
        max_concurrency=4,
        max_restarts=1,
        strategy="spread",
        unavailable_timeout=60,
    )
    results: list[dict[str, Any]] = []
    async with RayBackend.from_config(config) as pool:
        assert sorted(a.node_id or "" for a in pool.actors()) == sorted(ids)  # spread
        victim = ids[0]

        async def caller() -> None:
            for _ in range(6):
                results.append((await pool.call("node_hold", {"seconds": 0.4})).value)

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(caller)
            # Kill the node while calls run on it.
            await settle(pool, lambda: any(a.in_flight for a in _on(pool, victim)))
            nodes.kill(victim)
        stats = pool.statistics()
        assert len(results) == 48  # none lost: the retries went to the other nodes
        assert stats.nodes_lost == 1
        assert stats.retries >= 1
        await settle(pool, lambda: pool.statistics().actors_live == 3)
        # One restart for the one actor that died; its replacement is on a living node.
        assert pool.statistics().restarts == 1
        assert victim not in {a.node_id for a in pool.actors()}
        assert all(r["node_id"] != victim for r in results[-8:])


async def test_a_replica_waits_for_a_new_node_without_spending_its_restarts(
    nodes: LocalNodes,
) -> None:
    first = nodes.add(slot=1)
    config = pool_config(
        {"function": "support.ray_tools:node_hold", "idempotent": True},
        replicas=1,
        num_cpus=0.5,
        resources={"slot": 1},
        max_restarts=1,
    )
    async with RayBackend.from_config(config) as pool:
        nodes.kill(first)
        await settle(pool, lambda: pool.statistics().nodes_lost == 1)
        # No node can hold the replacement: it waits, at no cost (a start that times out
        # meanwhile is tried again, also at no cost: tests/test_ray_actors.py).
        assert pool.statistics().restarts == 1
        await settle(pool, lambda: [a.state for a in pool.actors()] == ["starting"])
        second = nodes.add(slot=1)
        registered = time.monotonic()
        await settle(pool, lambda: pool.statistics().actors_live == 1)
        serving = time.monotonic() - registered
        answer = await pool.call("node_hold", {"seconds": 0})
        assert answer.value["node_id"] == second
        assert pool.statistics().restarts == 1  # still: only the real death spent one
        print(f"serving {serving:.1f}s after the new node registered")
