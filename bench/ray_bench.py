"""Ray pool benchmark: payloads by reference vs through the driver, and per-call overhead.

Run alone: ``.venv/bin/python bench/ray_bench.py`` (``--sizes 64,256`` for a quicker run).

A producer pool (one actor) returns 64 MB, 256 MB and 1 GB NumPy arrays; a
consumer pool (another actor) takes them. Two hand-offs are timed, each from
"the driver has the producer's result" to "the consumer tool has the array
in hand" (the consumer stamps its arrival on the machine-wide monotonic
clock, then checksums what it got):

* **by reference**: the driver passes the ``PayloadRef`` it got back;
* **through the driver**: the driver fetches the array (``PayloadRef.get``)
  and passes the array on, as peers do.

Reported per size: hand-off times and speedup, the driver's peak RSS growth
(``VmHWM`` after a reset through ``/proc/self/clear_refs``), the producer's
and both consumers' checksums, and bytes spilled (Ray's store stats). Then
the dispatch overhead of a small call (median of single calls, interleaved in
a fresh random order each round) against a direct call of a plain Ray actor method doing the
same work: through ``pool.call``, and as a model's call (JSON text arguments)
through the ``Dispatcher``, which the daemon and rollouts use.
Prints PASS/FAIL against the issue's figures.

The local Ray is sized explicitly (4 GiB object store, for 1 GB payloads with
a driver copy alive at once) so nothing spills on this 24 GB machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import ray

from agent_backend import Dispatcher, ToolCall, ToolRegistry
from agent_backend.backends.ray import RayBackend, RayPoolConfig
from agent_backend.backends.ray.payload import PayloadRef, checksum

MB = 1024 * 1024
OBJECT_STORE = 4 * 1024 * MB
HERE = str(Path(__file__).resolve().parent)


# -- tools (imported by the actors as ray_bench:NAME: this file's directory is on their path) -----


def produce(nbytes: int, seed: int) -> Any:
    """``nbytes`` of non-repeating data (a uint64 ramp), as a uint8 array."""
    return (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(seed | 1)).view(np.uint8)


def consume(data: Any) -> dict[str, Any]:
    """Stamp the arrival (the array is in hand), then checksum it."""
    arrived = time.monotonic()
    return {"arrived": arrived, "checksum": checksum(data), "nbytes": int(data.nbytes)}


async def small(x: int) -> int:
    return x + 1


class Direct:
    """The baseline: a plain Ray actor whose method does what the ``small`` tool does."""

    async def small(self, x: int) -> int:
        return await small(x)


# -- measurement ------------------------------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the peak RSS (Linux: write 5 to clear_refs) and return the RSS now."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak_rss() -> int:
    return _status("VmHWM")


def spilled_bytes() -> tuple[int | None, str]:
    """Bytes Ray spilled so far: from the raylet's store stats, else from the spill directory."""
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        address = ray.get_runtime_context().gcs_address
        state = get_state_from_address(address)  # type: ignore[no-untyped-call]
        reply = get_memory_info_reply(state)  # type: ignore[no-untyped-call]
        return int(reply.store_stats.spilled_bytes_total), "store stats"
    except ImportError:  # the raylet stats need grpcio (ray[default])
        pass
    node: Any = ray._private.worker._global_node
    session = Path(node.get_session_dir_path())
    spill = session / "ray_spilled_objects"
    if not spill.exists():
        return 0, "spill directory"
    return sum(f.stat().st_size for f in spill.rglob("*") if f.is_file()), "spill directory"


async def handoffs(
    producers: RayBackend, consumers: RayBackend, size_mb: int, seed: int
) -> dict[str, Any]:
    nbytes = size_mb * MB
    row: dict[str, Any] = {"size": size_mb}
    # By reference: the driver never holds the bytes.
    base = reset_peak_rss()
    started = time.monotonic()
    produced = await producers.call("produce", {"nbytes": nbytes, "seed": seed})
    row["produce_s"] = time.monotonic() - started
    payload = produced.payload
    assert isinstance(payload, PayloadRef)
    async with payload:
        t0 = time.monotonic()
        got = await consumers.call("consume", {"data": payload})
        row["ref_s"] = got.value["arrived"] - t0
        row["ref_call_s"] = time.monotonic() - t0
        row["ref_rss"] = peak_rss() - base
        row["producer_checksum"] = payload.checksum
        row["ref_checksum"] = got.value["checksum"]
        row["consumer_actor_differs"] = got.actor != produced.actor
        # Through the driver: it gets the array and passes it on.
        base = reset_peak_rss()
        t0 = time.monotonic()
        array = await payload.resolve()
        got = await consumers.call("consume", {"data": array})
        row["driver_s"] = got.value["arrived"] - t0
        row["driver_call_s"] = time.monotonic() - t0
        row["driver_rss"] = peak_rss() - base
        row["driver_checksum"] = got.value["checksum"]
        del array
    gc.collect()
    row["speedup"] = row["driver_s"] / row["ref_s"]
    return row


async def overhead(pool: RayBackend, calls: int) -> dict[str, float]:
    """Medians of single small calls: a direct actor method, ``pool.call``, and a model's call
    (JSON text arguments) through the ``Dispatcher``, interleaved in rotating order."""
    direct: Any = ray.remote(Direct).options(num_cpus=0).remote()
    times: dict[str, list[float]] = {"direct": [], "pool": [], "dispatcher": []}
    try:
        async with Dispatcher(ToolRegistry(), pool) as dispatcher:

            async def one(side: str, i: int) -> None:
                t0 = time.perf_counter()
                if side == "direct":
                    assert await direct.small.remote(i) == i + 1
                elif side == "pool":
                    assert (await pool.call("small", {"x": i})).value == i + 1
                else:
                    result = await dispatcher.call(
                        ToolCall(f"c{i}", "small", f'{{"x": {i}}}', "openai")
                    )
                    assert result.value == i + 1, result
                times[side].append(time.perf_counter() - t0)

            for i in range(20):  # warm every path
                for side in times:
                    await one(side, i)
            for side in times:
                times[side].clear()
            # A fresh random order each round: a call to another actor than the last one
            # costs a wake-up of its process (about 0.5 ms here), so a fixed cycle, where each
            # side always follows the same one, would charge it to some sides only.
            sides = list(times)
            shuffle = random.Random(0).shuffle
            for i in range(calls):
                shuffle(sides)
                for side in sides:
                    await one(side, i)
    finally:
        ray.kill(direct)
    direct_s = statistics.median(times["direct"])
    return {
        "direct_ms": direct_s * 1e3,
        "pool_ms": statistics.median(times["pool"]) * 1e3,
        "dispatcher_ms": statistics.median(times["dispatcher"]) * 1e3,
        "ratio": statistics.median(times["pool"]) / direct_s,
        "dispatcher_ratio": statistics.median(times["dispatcher"]) / direct_s,
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


async def main(sizes: list[int], calls: int) -> int:
    producer_config = RayPoolConfig.model_validate(
        {
            "name": "producer",
            "num_cpus": 1,
            "tools": ["ray_bench:produce", "ray_bench:small"],
            "local": {"num_cpus": 2, "object_store_memory": OBJECT_STORE},
            "inline_limit": MB,
            "call_timeout": 600,
            "log_to_driver": False,
        }
    )
    consumer_config = RayPoolConfig.model_validate(
        {"name": "consumer", "num_cpus": 1, "tools": ["ray_bench:consume"], "call_timeout": 600}
    )
    print(f"Ray {ray.__version__}, numpy {np.__version__}, {os.cpu_count()} cores")
    print(f"object store {OBJECT_STORE // MB} MiB; tools from {HERE}")
    failures = 0
    async with (
        RayBackend.from_config(producer_config) as producers,
        RayBackend.from_config(consumer_config) as consumers,
    ):
        spilled_before, spill_source = spilled_bytes()
        rows = [await handoffs(producers, consumers, size, seed) for seed, size in enumerate(sizes)]
        spilled_after, _ = spilled_bytes()
        small_calls = await overhead(producers, calls)

    print()
    print("same-node hand-off of a NumPy array from the producer actor to a consumer actor")
    print("(cross-node hand-offs: bench/ray_nodes_bench.py)")
    header = (
        f"{'size':>7} {'by ref':>9} {'via driver':>11} {'speedup':>8} "
        f"{'RSS by ref':>11} {'RSS via driver':>15} {'checksums':>10} {'produce':>8}"
    )
    print(header)
    for row in rows:
        same = row["producer_checksum"] == row["ref_checksum"] == row["driver_checksum"]
        print(
            f"{row['size']:>4} MB {row['ref_s'] * 1e3:>7.1f}ms {row['driver_s'] * 1e3:>9.1f}ms "
            f"{row['speedup']:>7.1f}x {row['ref_rss'] / MB:>8.1f} MB {row['driver_rss'] / MB:>12.1f} MB "
            f"{'equal' if same else 'DIFFER':>10} {row['produce_s']:>7.2f}s"
        )
    print("(by ref / via driver: from the driver holding the result to the consumer holding the")
    print(
        " array; whole consumer calls incl. its checksum: "
        + ", ".join(
            f"{r['size']} MB {r['ref_call_s']:.2f}s / {r['driver_call_s']:.2f}s" for r in rows
        )
        + ")"
    )
    spilled = None if spilled_after is None else spilled_after - (spilled_before or 0)
    print(f"spilled during the hand-offs: {spilled} bytes ({spill_source})")
    print()
    print(
        f"small call: pool {small_calls['pool_ms']:.3f} ms, through the Dispatcher "
        f"{small_calls['dispatcher_ms']:.3f} ms, direct Ray actor method "
        f"{small_calls['direct_ms']:.3f} ms (medians of {calls} interleaved calls): "
        f"{small_calls['ratio']:.2f}x and {small_calls['dispatcher_ratio']:.2f}x"
    )
    print()
    checks: list[tuple[str, bool]] = []
    for row in rows:
        if row["size"] >= 256:
            checks.append(
                (
                    f"by reference >= 10x faster at {row['size']} MB ({row['speedup']:.0f}x)",
                    row["speedup"] >= 10,
                )
            )
    worst_rss = max(row["ref_rss"] for row in rows)
    checks.append(
        (f"driver RSS growth by reference < 16 MB ({worst_rss / MB:.1f} MB)", worst_rss < 16 * MB)
    )
    checks.append(
        (
            "checksums equal (producer, by reference, via driver)",
            all(r["producer_checksum"] == r["ref_checksum"] == r["driver_checksum"] for r in rows),
        )
    )
    checks.append(
        (
            "consumer ran on another actor than the producer",
            all(r["consumer_actor_differs"] for r in rows),
        )
    )
    checks.append((f"nothing spilled ({spilled} bytes)", spilled == 0))
    checks.append(
        (
            f"small-call overhead <= 1.1x a direct actor call ({small_calls['ratio']:.2f}x)",
            small_calls["ratio"] <= 1.1,
        )
    )
    checks.append(
        (
            "small-call overhead through the Dispatcher <= 1.1x a direct actor call "
            f"({small_calls['dispatcher_ratio']:.2f}x)",
            small_calls["dispatcher_ratio"] <= 1.1,
        )
    )
    for text, ok in checks:
        failures += not ok
        print(f"{verdict(ok)}  {text}")
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="payload sizes in MB")
    parser.add_argument("--calls", type=int, default=500, help="small calls per side")
    args = parser.parse_args()
    sys.exit(anyio.run(main, [int(s) for s in args.sizes.split(",")], args.calls))
