"""Nodes as failure domains on a real multi-node Ray: node kills, new nodes, cross-node hand-offs.

Run alone: ``.venv/bin/python bench/ray_nodes_bench.py [--kills 20] [--sizes 64,256]``.

A ``ray.cluster_utils.Cluster`` on this machine, loopback only: a head without CPUs (so every
actor lives on a worker node) and three worker nodes, each its own raylet and object store,
each advertising one ``slot``. Ray's node health checks run at 1 s x 5 misses (its defaults
are 3 s x 5), so a killed node is first seen *unavailable* (the connection drops) and only
seconds later confirmed dead: both paths of the pool are taken.

1. **Kills**: a pool of three replicas, one per node (``resources = {slot = 1}``), with an
   idempotent tool that holds 0.2 s, is kept busy by 8 callers. ``--kills`` times: the node
   of a replica with calls in flight is SIGKILLed (``remove_node(allow_graceful=False)``),
   the pool is left to evict its actor, a new node registers, and the time until the pool
   has its three replicas live again is measured from that registration. Counted: calls lost
   (any call that failed), restarts spent beyond the real deaths (placement races), the
   serving delay. Targets: 0 lost calls over the kills; 0 restarts spent on placement races;
   serving again <= 5 s after the new node registers (the median and the worst are printed).
2. **Infeasible**: a pool that no node can hold (3 GPUs per actor, nodes of 1 and 2) fails at
   start: the time it takes, target < 2 s, with each node's shape in the message.
3. **Cross-node hand-off**: a producer actor on one node returns a NumPy array, a consumer
   actor on another node takes it: by reference (the ``PayloadRef``) vs through the driver
   (fetched, then passed on). Across nodes both pay the transfer between object stores, so
   the time gain is small; what is saved is the driver's memory (peak RSS growth printed).
   The same-node figures are ``bench/ray_bench.py``'s.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import ray

from agent_backend.backends.ray import RayBackend, RayPoolConfig
from agent_backend.backends.ray.payload import PayloadRef, checksum
from agent_backend.errors import AgentBackendError, ResourceUnavailable

MB = 1024 * 1024
HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, str(Path(HERE).parent / "tests"))

from support.ray_nodes import LocalNodes  # noqa: E402

HEALTH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


# -- tools (imported by the actors as ray_nodes_bench:NAME: this directory is on their path) --------


async def hold(seconds: float) -> str:
    import asyncio

    await asyncio.sleep(seconds)
    return str(ray.get_runtime_context().get_node_id())


def produce(nbytes: int, seed: int) -> Any:
    return (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(seed | 1)).view(np.uint8)


def consume(data: Any) -> dict[str, Any]:
    arrived = time.monotonic()
    return {
        "arrived": arrived,
        "checksum": checksum(data),
        "node_id": str(ray.get_runtime_context().get_node_id()),
    }


# -- the cluster ------------------------------------------------------------------------------------


async def wait_for(pool: RayBackend, condition: Any, within: float) -> bool:
    with anyio.move_on_after(within):
        await pool.wait_until(condition)
        return True
    return False


# -- 1. kills ---------------------------------------------------------------------------------------


async def kills(nodes: LocalNodes, count: int) -> dict[str, Any]:
    config = RayPoolConfig.model_validate(
        {
            "name": "kills",
            "replicas": 3,
            "num_cpus": 0.5,
            "resources": {"slot": 1},
            "max_concurrency": 4,
            "max_restarts": count + 1,
            "unavailable_timeout": 60,
            "tools": [{"function": "ray_nodes_bench:hold", "idempotent": True}],
            "call_timeout": 120,
        }
    )
    ok = lost = 0
    delays: list[float] = []
    deaths = 0
    stop = anyio.Event()
    errors: list[str] = []
    async with RayBackend.from_config(config) as pool:

        async def caller() -> None:
            nonlocal ok, lost
            while not stop.is_set():
                try:
                    await pool.call("hold", {"seconds": 0.2})
                    ok += 1
                except AgentBackendError as exc:
                    lost += 1
                    errors.append(f"{type(exc).__name__}: {exc}")

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(caller)
            for kill in range(count):
                busy = await wait_for(
                    pool, lambda: any(a.in_flight and a.state == "live" for a in pool.actors()), 60
                )
                victims = [a for a in pool.actors() if a.in_flight and a.state == "live"]
                if not busy or not victims:
                    errors.append(f"kill {kill}: no busy actor within 60 s")
                    break
                node = victims[0].node_id
                assert node is not None
                on_node = sum(1 for a in pool.actors() if a.node_id == node and a.state == "live")
                lost_before = pool.statistics().nodes_lost
                nodes.kill(node)
                deaths += on_node
                lost_now = functools.partial(
                    lambda n: pool.statistics().nodes_lost > n, lost_before
                )
                if not await wait_for(pool, lost_now, 60):
                    errors.append(f"kill {kill}: the node's death was not seen within 60 s")
                    break
                # In this thread (Ray's node start needs the main thread): the pool's event loop
                # waits meanwhile, and the delay is counted from the node's registration.
                nodes.add(slot=1)
                registered = time.monotonic()
                if not await wait_for(pool, lambda: pool.statistics().actors_live == 3, 60):
                    errors.append(f"kill {kill}: not serving with 3 replicas 60 s after the node")
                    break
                delays.append(time.monotonic() - registered)
                print(
                    f"  kill {kill + 1}: serving again {delays[-1]:.2f}s after the new node "
                    f"registered; calls ok {ok}, lost {lost}",
                    flush=True,
                )
            stop.set()
        stats = pool.statistics()
    return {
        "ok": ok,
        "lost": lost,
        "errors": errors,
        "delays": delays,
        "restarts": stats.restarts,
        "deaths": deaths,
        "retries": stats.retries,
        "nodes_lost": stats.nodes_lost,
    }


# -- 2. infeasible ----------------------------------------------------------------------------------


async def infeasible() -> tuple[float, str]:
    config = RayPoolConfig.model_validate(
        {"name": "big", "num_cpus": 0.1, "num_gpus": 3, "tools": ["ray_nodes_bench:hold"]}
    )
    started = time.monotonic()
    try:
        async with RayBackend.from_config(config):
            pass
    except ResourceUnavailable as exc:
        return time.monotonic() - started, exc.message
    return time.monotonic() - started, "(it started)"


# -- 3. cross-node hand-offs ------------------------------------------------------------------------


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> int:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _rss("VmRSS")


async def handoffs(sizes: list[int]) -> list[dict[str, Any]]:
    common = {"num_cpus": 0.5, "inline_limit": MB, "call_timeout": 600}
    producer = RayPoolConfig.model_validate(
        {
            **common,
            "name": "producer",
            "resources": {"producer": 1},
            "tools": ["ray_nodes_bench:produce"],
        }
    )
    consumer = RayPoolConfig.model_validate(
        {
            **common,
            "name": "consumer",
            "resources": {"consumer": 1},
            "tools": ["ray_nodes_bench:consume"],
        }
    )
    rows = []
    async with (
        RayBackend.from_config(producer) as producers,
        RayBackend.from_config(consumer) as consumers,
    ):
        assert producers.actors()[0].node_id != consumers.actors()[0].node_id
        for seed, size in enumerate(sizes):
            row: dict[str, Any] = {"size": size}
            made = await producers.call("produce", {"nbytes": size * MB, "seed": seed})
            payload = made.payload
            assert isinstance(payload, PayloadRef)
            async with payload:
                base = reset_peak()
                t0 = time.monotonic()
                got = await consumers.call("consume", {"data": payload})
                row["ref_s"] = got.value["arrived"] - t0
                row["ref_rss"] = _rss("VmHWM") - base
                row["ok"] = got.value["checksum"] == payload.checksum
                base = reset_peak()
                t0 = time.monotonic()
                array = await payload.resolve()
                got = await consumers.call("consume", {"data": array})
                row["driver_s"] = got.value["arrived"] - t0
                row["driver_rss"] = _rss("VmHWM") - base
                row["ok"] = row["ok"] and got.value["checksum"] == payload.checksum
                del array
            rows.append(row)
    return rows


# -- main -------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


async def main(count: int, sizes: list[int]) -> int:
    nodes = LocalNodes(HEALTH, store_mb=600)
    try:
        for _ in range(3):
            nodes.add(slot=1)
        ray.init(
            address=nodes.address,
            log_to_driver=False,
            job_config=ray.job_config.JobConfig(code_search_path=[HERE]),
        )
        print(f"Ray {ray.__version__}: a head and 3 worker nodes on this machine; {count} kills")
        killed = await kills(nodes, count)
        for node_id in list(nodes.nodes):
            nodes.kill(node_id)
        nodes.add(num_gpus=1, producer=1)
        nodes.add(num_gpus=2, consumer=1)
        refused_in, message = await infeasible()
        rows = await handoffs(sizes)
    finally:
        ray.shutdown()
        nodes.shutdown()

    delays = killed["delays"]
    races = killed["restarts"] - killed["deaths"]
    print()
    print(
        f"kills: {len(delays)} of {count} done; calls ok {killed['ok']}, lost {killed['lost']}; "
        f"retries {killed['retries']}; nodes lost {killed['nodes_lost']}; restarts "
        f"{killed['restarts']} for {killed['deaths']} real deaths"
    )
    for error in killed["errors"][:5]:
        print(f"  {error}")
    if delays:
        print(
            f"serving again after a new node registered: median {statistics.median(delays):.2f}s, "
            f"worst {max(delays):.2f}s"
        )
    print(f"infeasible pool refused in {refused_in:.2f}s: {message}")
    print()
    print("cross-node hand-off of a NumPy array (producer and consumer on different nodes)")
    print(
        f"{'size':>7} {'by ref':>9} {'via driver':>11} {'time':>6} {'RSS by ref':>11} {'RSS via driver':>15}"
    )
    for row in rows:
        print(
            f"{row['size']:>4} MB {row['ref_s']:>8.3f}s {row['driver_s']:>10.3f}s "
            f"{row['driver_s'] / row['ref_s']:>5.2f}x {row['ref_rss'] / MB:>8.0f} MB "
            f"{row['driver_rss'] / MB:>12.0f} MB{'' if row['ok'] else '  CHECKSUM MISMATCH'}"
        )
    print()
    checks = [
        (
            f"0 lost calls over {count} node kills ({killed['lost']})",
            killed["lost"] == 0 and len(delays) == count,
        ),
        (f"0 restarts spent on placement races ({races})", races == 0),
        (
            f"serving again <= 5 s after a new node registers (worst {max(delays, default=float('inf')):.2f}s)",
            bool(delays) and max(delays) <= 5,
        ),
        (
            f"an infeasible pool fails in < 2 s ({refused_in:.2f}s)",
            refused_in < 2 and "on one node" in message,
        ),
        ("cross-node hand-offs: checksums match", all(row["ok"] for row in rows)),
    ]
    for text, ok in checks:
        print(f"{verdict(ok)}  {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--sizes", default="64,256")
    args = parser.parse_args()
    sys.exit(anyio.run(main, args.kills, [int(s) for s in args.sizes.split(",")]))
