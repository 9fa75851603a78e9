"""Results by reference on a real local Ray: the driver never holds the bytes (large ones, gathered
there and sent out again, cost twice).

Who owns a payload and how long it lives: it is a return object of the
producing call, so the driver owns it; it survives the producing actor; it
goes when every holder released it (explicitly, by scope, by the pool's
aclose()).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from support.proc_helpers import rss_bytes
from support.ray_fixtures import RayCluster, pool_config, ray_cluster, require_ray, settle

ray = require_ray()

from agent_backend.backends.ray import RayBackend  # noqa: E402
from agent_backend.backends.ray.payload import (  # noqa: E402
    PayloadInfo,
    PayloadRef,
    checksum,
    describe_payload,
    payload_size,
)
from agent_backend.errors import PayloadLost  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
__all__ = ["ray_cluster"]  # the fixture, imported for this module

MB = 1024 * 1024


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pool(ray_cluster: RayCluster) -> AsyncIterator[RayBackend]:
    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:make_array",
        "support.ray_tools:make_matrix",
        "support.ray_tools:make_bundle",
        "support.ray_tools:make_bytes",
        "support.ray_tools:inspect_payload",
        "support.ray_tools:sum_payloads",
        "support.ray_tools:whoami",
        replicas=2,
        max_concurrency=2,
        max_restarts=1,
        num_gpus=0.5,  # fractional GPUs: both actors may share one device
    )
    async with RayBackend.from_config(config) as backend:
        yield backend


class _Trainer:
    """A plain Ray actor of someone else's (a trainer): it gets the handle, not the bytes."""

    async def take(self, payload: PayloadRef) -> str:
        return checksum(await payload.resolve(verify=True))

    def take_sync(self, payload: PayloadRef) -> str:
        return checksum(payload.get(verify=True))


# -- sizes and checksums (no Ray needed) ----------------------------------------------------------


def test_sizes_and_checksums_cover_arrays_bytes_and_containers() -> None:
    array = np.arange(1000, dtype=np.float32)
    assert payload_size(array) == 4000
    assert payload_size(b"abc") == 3
    assert payload_size({"a": array, "b": [array, b"xy"], "n": 3}) == 8002
    assert payload_size(object()) == 0
    # The checksum is over the data: same bytes, same checksum, whatever the container.
    assert checksum(array) == checksum(array.tobytes()) == checksum([array.tobytes()])
    assert checksum(array[::2]) == checksum(np.ascontiguousarray(array[::2]))
    assert checksum(array) != checksum(array + 1)
    info = describe_payload(np.zeros((3, 4), dtype=np.int16))
    assert info == PayloadInfo(
        24, "numpy.ndarray", "int16", (3, 4), checksum(np.zeros(12, np.int16))
    )


# -- by reference ---------------------------------------------------------------------------------


async def test_fractional_gpus_are_granted_inside_the_actors(pool: RayBackend) -> None:
    for info in pool.actors():
        assert len(info.gpu_ids) == 1
    inside = {(await pool.call("whoami")).value["pid"]: (await pool.call("whoami")).value}
    for who in inside.values():
        assert len(who["gpu_ids"]) == 1
        assert who["cuda_visible_devices"] == who["gpu_ids"][0]
    assert ray.available_resources().get("GPU", 0.0) <= 1.0 + 1e-9  # 2 x 0.5 reserved


async def test_small_results_come_back_inline(pool: RayBackend) -> None:
    result = await pool.call("make_array", {"n": 1000})
    assert not result.by_reference
    assert isinstance(result.value, np.ndarray)
    assert result.value.nbytes == 1000


async def test_large_results_stay_in_the_object_store(pool: RayBackend) -> None:
    result = await pool.call("make_array", {"n": MB, "seed": 3})
    payload = result.payload
    assert payload is not None
    expected = np.random.default_rng(3).integers(0, 256, size=MB, dtype=np.uint8)
    assert (payload.size, payload.dtype, payload.shape) == (MB, "uint8", (MB,))
    assert payload.checksum == checksum(expected)
    assert payload.producer == result.actor
    assert payload.tool == "make_array"
    assert "uint8[1048576]" in repr(payload)
    matrix = (await pool.call("make_matrix", {"rows": 512, "cols": 256})).payload
    assert matrix is not None
    assert (matrix.dtype, matrix.shape, matrix.size) == ("float32", (512, 256), 512 * 256 * 4)
    payload.release()
    matrix.release()


async def test_a_second_actor_consumes_the_payload_zero_copy(pool: RayBackend) -> None:
    produced = await pool.call("make_array", {"n": 2 * MB, "seed": 7})
    payload = produced.payload
    assert payload is not None
    consumed = None
    for _ in range(4):  # fewest-served routing alternates; make sure the other actor consumed
        consumed = await pool.call("inspect_payload", {"data": payload})
        if consumed.actor != produced.actor:
            break
    assert consumed is not None
    assert consumed.actor != produced.actor
    assert consumed.value == {
        "checksum": payload.checksum,
        "type": "ndarray",
        "nbytes": 2 * MB,
        "writeable": False,  # a read-only view of the object store, not a copy
    }
    payload.release()


async def test_the_driver_never_holds_the_bytes(pool: RayBackend) -> None:
    gc.collect()
    before = rss_bytes()
    for seed in range(3):
        payload = (await pool.call("make_array", {"n": 48 * MB, "seed": seed})).payload
        assert payload is not None
        async with payload:
            consumed = await pool.call("inspect_payload", {"data": payload})
            assert consumed.value["checksum"] == payload.checksum
    gc.collect()
    growth = rss_bytes() - before
    assert growth < 16 * MB, f"driver RSS grew {growth / MB:.1f} MB for 144 MB of payloads"


async def test_payloads_nested_in_arguments_and_containers(pool: RayBackend) -> None:
    first = (await pool.call("make_array", {"n": 256 * 1024, "seed": 1})).payload
    second = (await pool.call("make_array", {"n": 256 * 1024, "seed": 2})).payload
    assert first is not None
    assert second is not None
    total = await pool.call("sum_payloads", {"parts": [first, second]})
    local = sum(
        int(np.random.default_rng(seed).integers(0, 256, size=256 * 1024, dtype=np.uint8).sum())
        for seed in (1, 2)
    )
    assert total.value == local

    bundle = (await pool.call("make_bundle", {"n": 64 * 1024})).payload
    assert bundle is not None
    assert (bundle.info.type, bundle.dtype, bundle.shape) == ("dict", None, None)
    assert bundle.size == 64 * 1024 * 8 + len("top-k")
    seen = await pool.call("inspect_payload", {"data": bundle})
    assert seen.value == {"checksum": bundle.checksum, "type": "dict"}

    raw = (await pool.call("make_bytes", {"n": MB})).payload
    assert raw is not None
    assert raw.info.type == "bytes"
    for payload in (first, second, bundle, raw):
        payload.release()


async def test_raw_arrays_and_bytes_are_accepted_as_arguments(pool: RayBackend) -> None:
    """Data the driver does hold can be passed too (it then travels from the driver)."""
    array = np.arange(300_000, dtype=np.int64)
    seen = await pool.call("inspect_payload", {"data": array})
    assert seen.value["checksum"] == checksum(array)
    assert seen.value["nbytes"] == array.nbytes
    assert (await pool.call("inspect_payload", {"data": b"raw"})).value["type"] == "bytes"
    assert (await pool.call("sum_payloads", {"parts": [array[:10], np.ones(5)]})).value == 50


async def test_any_ray_actor_resolves_a_payload(pool: RayBackend) -> None:
    payload = (await pool.call("make_array", {"n": MB, "seed": 11})).payload
    assert payload is not None
    trainer = ray.remote(_Trainer).options(num_cpus=0).remote()
    try:
        assert await trainer.take.remote(payload) == payload.checksum
        assert await trainer.take_sync.remote(payload) == payload.checksum
    finally:
        ray.kill(trainer)
        payload.release()


async def test_a_payload_outlives_its_producer_actor(pool: RayBackend) -> None:
    produced = await pool.call("make_array", {"n": MB, "seed": 5})
    payload = produced.payload
    assert payload is not None
    producer = next(info for info in pool.actors() if info.name == produced.actor)
    ray.kill(ray.get_actor(producer.ray_name))
    await settle(
        pool, lambda: pool.statistics().actors_live == 2 and pool.statistics().restarts == 1
    )
    assert producer.name not in {info.name for info in pool.actors()}
    # Owned by the driver, stored on the node: still there after the producer is gone.
    for _ in range(2):
        consumed = await pool.call("inspect_payload", {"data": payload})
        assert consumed.value["checksum"] == payload.checksum
    assert checksum(await payload.resolve(verify=True)) == payload.checksum
    payload.release()


# -- lifetime -------------------------------------------------------------------------------------


async def test_release_drops_the_reference_and_refuses_reuse(pool: RayBackend) -> None:
    payload = (await pool.call("make_array", {"n": MB})).payload
    assert payload is not None
    object_id = payload.id
    assert object_id is not None
    assert _driver_holds(object_id)
    before = pool.statistics().payloads
    payload.release()
    payload.release()  # idempotent
    assert payload.is_released()
    assert payload.id is None
    assert not _driver_holds(object_id)
    assert pool.statistics().payloads == before - 1
    assert "released" in repr(payload)
    with pytest.raises(PayloadLost) as info:
        await pool.call("inspect_payload", {"data": payload})
    assert info.value.cause == "released"
    with pytest.raises(PayloadLost):
        await payload.resolve()


async def test_release_by_scope(pool: RayBackend) -> None:
    async with (await pool.call("make_array", {"n": MB})).value as payload:
        object_id = payload.id
        assert _driver_holds(object_id)
    assert payload.is_released()
    assert not _driver_holds(object_id)
    with (await pool.call("make_array", {"n": MB})).value as payload:
        object_id = payload.id
    assert payload.is_released()
    assert not _driver_holds(object_id)


async def test_a_corrupt_payload_is_caught_by_verify(ray_cluster: RayCluster) -> None:
    data = np.ones(1000, dtype=np.uint8)
    payload = PayloadRef(
        ray.put(data), PayloadInfo(1000, "numpy.ndarray", checksum="crc32:00000000")
    )
    assert (await payload.resolve()).nbytes == 1000
    with pytest.raises(PayloadLost, match="corrupt") as info:
        await payload.resolve(verify=True)
    assert info.value.cause == "checksum mismatch"


async def test_aclose_releases_every_outstanding_payload(ray_cluster: RayCluster) -> None:
    config = pool_config("support.ray_tools:make_array")
    async with RayBackend.from_config(config) as backend:
        payloads = [(await backend.call("make_array", {"n": MB})).payload for _ in range(3)]
        ids = [payload.id for payload in payloads if payload is not None]
        assert backend.statistics().payloads == 3
    assert all(payload is not None and payload.is_released() for payload in payloads)
    assert not any(_driver_holds(object_id) for object_id in ids if object_id)
    assert backend.statistics().payloads == 0


# -- helpers --------------------------------------------------------------------------------------


def _driver_holds(object_id: str | None) -> bool:
    """Whether this process still references the object (Ray's reference table)."""
    assert object_id is not None
    gc.collect()
    counts: dict[Any, Any] = (
        ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    )
    return object_id.encode() in counts or object_id in counts
