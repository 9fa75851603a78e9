"""RayBackend on a real local Ray: config, routing, concurrency, placement, lifecycle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pydantic
import pytest
from support.ray_fixtures import (
    TESTS_DIR,
    RayCluster,
    pool_config,
    ray_cluster,
    require_ray,
    settle,
)

ray = require_ray()

from agent_backend.backends.ray import RayBackend, RayPoolConfig, RayToolConfig  # noqa: E402
from agent_backend.dispatch.spec import execution_spec  # noqa: E402
from agent_backend.errors import (  # noqa: E402
    PoolClosed,
    PoolError,
    ResourceUnavailable,
    ToolArgumentError,
    ToolTimeout,
    UnknownToolError,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
__all__ = ["ray_cluster"]  # the fixture, imported for this module

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pool(ray_cluster: RayCluster) -> AsyncIterator[RayBackend]:
    """Two actors, two calls each at once: shared by the tests that leave it as they found it."""
    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:async_echo",
        "support.ray_tools:whoami",
        "support.ray_tools:hold",
        "support.ray_tools:sync_hold",
        {"function": "support.ray_tools:echo", "name": "gpu_echo", "num_gpus": 1},
        {"function": "support.ray_tools:echo", "name": "a100_echo", "resources": {"A100": 1}},
        replicas=2,
        max_concurrency=2,
    )
    async with RayBackend.from_config(config) as backend:
        yield backend


# -- config ---------------------------------------------------------------------------------------


def test_example_pool_file_loads_and_documents_every_key() -> None:
    path = ROOT / "pools" / "ray.example.toml"
    data = tomllib.loads(path.read_text())
    config = RayPoolConfig.model_validate(data)
    assert config.type == "ray"
    assert config.tools[0].function == "my_tools.rewards:score"
    text = path.read_text()
    for key in [*RayPoolConfig.model_fields, *RayToolConfig.model_fields]:
        assert f"{key} =" in text or f"[{key}]" in text, f"{key} is not documented in {path}"
    for key in RayPoolConfig.model_fields["local"].annotation.model_fields:  # type: ignore[union-attr]
        assert f"{key} =" in text, key


def test_every_config_field_has_a_docstring() -> None:
    from agent_backend.backends.ray import LocalRayConfig

    for model in (RayPoolConfig, RayToolConfig, LocalRayConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_tools_accept_import_paths_and_tables() -> None:
    config = pool_config(
        "support.ray_tools:echo", {"function": "support.ray_tools:hold", "idempotent": True}
    )
    assert [t.function for t in config.tools] == [
        "support.ray_tools:echo",
        "support.ray_tools:hold",
    ]
    assert [t.idempotent for t in config.tools] == [False, True]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"tools": ["not a path"]}, "tools.0.function"),
        ({"tools": []}, "tools"),
        ({"num_gpus": 1.5}, "num_gpus"),
        ({"resources": {"GPU": 1}}, "resources"),
        ({"inline_limit": 1000}, "inline_limit"),
        ({"replicas": 0}, "replicas"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_config_is_refused_at_the_key(overrides: dict[str, Any], key: str) -> None:
    data = {"type": "ray", "tools": ["support.ray_tools:echo"], **overrides}
    with pytest.raises(pydantic.ValidationError) as info:
        RayPoolConfig.model_validate(data)
    locations = {".".join(str(p) for p in error["loc"]) for error in info.value.errors()}
    assert any(loc == key or loc.startswith(key + ".") for loc in locations), locations


async def test_unstarted_pool_refuses_calls_and_closes_quietly() -> None:
    backend = RayBackend.from_config(pool_config())
    with pytest.raises(PoolError, match="not started"):
        await backend.call("echo", {"text": "x"})
    await backend.aclose()
    await backend.aclose()
    assert backend.is_closed()
    with pytest.raises(PoolClosed):
        await backend.call("echo", {"text": "x"})


# -- calls and routing ----------------------------------------------------------------------------


async def test_call_returns_inline_value_and_describes_tools(pool: RayBackend) -> None:
    result = await pool.call("echo", {"text": "hello"})
    assert result.value == "hello"
    assert not result.by_reference
    assert result.attempts == 1
    assert result.actor.startswith("test-")
    assert (await pool.call("async_echo", '{"text": "json text"}')).value == "json text"
    echo = next(tool for tool in pool.tools if tool.name == "echo")
    assert echo.description == "Return the text."
    assert echo.parameters["properties"]["text"]["description"] == "What to return."
    assert echo.function is None  # runs remotely only
    assert execution_spec(echo).backend == "ray"


async def test_bad_arguments_and_unknown_tools_are_typed(pool: RayBackend) -> None:
    served = sum(actor.served for actor in pool.actors())
    with pytest.raises(ToolArgumentError) as info:
        await pool.call("echo", {"text": 5, "extra": 1})
    assert info.value.tool == "echo"
    with pytest.raises(ToolArgumentError) as broken:
        await pool.call("echo", '{"text": ')
    assert "not valid JSON" in broken.value.issues[0].message
    # Checked in the driver, with the schema the actors described: no actor was asked.
    assert sum(actor.served for actor in pool.actors()) == served
    # Repaired there too, and the repaired arguments run as they are in the actor.
    assert "pid" in (await pool.call("hold", '{"seconds": "0.01"}')).value
    assert sum(actor.served for actor in pool.actors()) == served + 1
    with pytest.raises(UnknownToolError) as unknown:
        await pool.call("ecko", {})
    assert "echo" in unknown.value.available


async def test_tools_are_loaded_once_per_actor(pool: RayBackend) -> None:
    seen = [(await pool.call("whoami")).value for _ in range(6)]
    per_pid: dict[int, set[float]] = {}
    for who in seen:
        per_pid.setdefault(who["pid"], set()).add(who["imports"])
    assert len(per_pid) == 2  # both actors served (fewest-served breaks ties)
    assert all(len(times) == 1 for times in per_pid.values())
    assert {info.pid for info in pool.actors()} == set(per_pid)


async def test_calls_go_to_the_least_loaded_actor(pool: RayBackend) -> None:
    results: list[dict[str, Any]] = []

    async def hold(seconds: float) -> None:
        results.append((await pool.call("hold", {"seconds": seconds})).value)

    async with anyio.create_task_group() as group:
        group.start_soon(hold, 1.0)
        await settle(pool, lambda: pool.statistics().calls_in_flight == 1)
        busy = next(info for info in pool.actors() if info.in_flight == 1)
        # The busy actor has a free slot, but the idle one is less loaded.
        quick = await pool.call("whoami")
        assert quick.value["pid"] != busy.pid
    assert results[0]["pid"] == busy.pid


async def test_concurrency_per_actor_is_capped_and_the_rest_queue(pool: RayBackend) -> None:
    pids: list[int] = []
    peaks: list[int] = []

    async def hold() -> None:
        value = (await pool.call("hold", {"seconds": 0.6})).value
        pids.append(value["pid"])
        peaks.append(value["peak"])

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        for _ in range(6):
            group.start_soon(hold)
        await settle(pool, lambda: pool.statistics().calls_queued == 2)
        stats = pool.statistics()
        assert stats.calls_in_flight == 4
        assert all(info.in_flight == 2 for info in pool.actors())
        assert "4 in flight, 2 queued" in repr(pool)
    elapsed = time.monotonic() - started
    assert max(peaks) == 2  # never more than max_concurrency inside one actor
    assert len(set(pids)) == 2
    assert 1.1 < elapsed < 5  # two waves of 0.6 s
    assert pool.statistics().calls_in_flight == 0


async def test_sync_tools_run_concurrently_in_threads(pool: RayBackend) -> None:
    spans: list[tuple[int, float, float]] = []

    async def hold() -> None:
        pid, start, end = (await pool.call("sync_hold", {"seconds": 0.5})).value
        spans.append((pid, start, end))

    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(hold)
    for pid in {span[0] for span in spans}:
        (_, start_a, end_a), (_, start_b, end_b) = [span for span in spans if span[0] == pid]
        assert max(start_a, start_b) < min(end_a, end_b)  # two blocking calls overlapped


async def test_a_call_no_actor_can_satisfy_fails_at_dispatch(pool: RayBackend) -> None:
    started = time.monotonic()
    with pytest.raises(ResourceUnavailable) as info:
        await pool.call("gpu_echo", {"text": "x"})
    assert info.value.needed == {"GPU": 1}
    assert info.value.available == {"CPU": 0.1}
    with pytest.raises(ResourceUnavailable, match="A100"):
        await pool.call("a100_echo", {"text": "x"})
    assert time.monotonic() - started < 1
    assert pool.statistics().calls_in_flight == 0


async def test_timeout_cancels_the_ray_task_and_frees_the_slot(pool: RayBackend) -> None:
    started = time.monotonic()
    with pytest.raises(ToolTimeout) as info:
        await pool.call("hold", {"seconds": 30}, timeout=0.5)
    assert 0.4 < time.monotonic() - started < 5
    assert info.value.timeout == 0.5
    await settle(pool, lambda: pool.statistics().calls_in_flight == 0)
    assert (await pool.call("echo", {"text": "still serving"})).value == "still serving"


async def test_cancelled_waiters_leave_the_queue(pool: RayBackend) -> None:
    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(pool.call, "hold", {"seconds": 0.8})
        await settle(pool, lambda: pool.statistics().calls_in_flight == 4)
        with anyio.move_on_after(0.2):
            await pool.call("echo", {"text": "queued"})
        assert pool.statistics().calls_queued == 0
    assert pool.statistics().calls_in_flight == 0


async def test_a_cancelled_call_cancels_its_ray_task(pool: RayBackend) -> None:
    with anyio.move_on_after(0.3):
        await pool.call("hold", {"seconds": 30})
    assert pool.statistics().calls_in_flight == 1  # the slot is held until the task ends...
    # ...which is soon
    await settle(pool, lambda: pool.statistics().calls_in_flight == 0, within=60)


# -- placement ------------------------------------------------------------------------------------


async def test_whole_gpus_are_placed_and_visible_inside_the_actors(
    ray_cluster: RayCluster,
) -> None:
    config = pool_config(
        "support.ray_tools:whoami",
        "support.ray_tools:hold",
        replicas=2,
        num_gpus=1,
        max_concurrency=1,
    )
    async with RayBackend.from_config(config) as backend:
        seen: list[dict[str, Any]] = []

        async def ask() -> None:
            await backend.call("hold", {"seconds": 0.3})
            seen.append((await backend.call("whoami")).value)

        async with anyio.create_task_group() as group:
            group.start_soon(ask)
            group.start_soon(ask)
        by_pid = {who["pid"]: who for who in seen}
        assert len(by_pid) == 2
        for info in backend.actors():
            inside = by_pid[info.pid]
            assert len(inside["gpu_ids"]) == 1
            assert inside["gpu_ids"] == list(info.gpu_ids)
            assert inside["cuda_visible_devices"] == inside["gpu_ids"][0]
            assert inside["actor"] == info.ray_name
        assert sorted(who["gpu_ids"][0] for who in seen) == ["0", "1"]


async def test_a_pool_the_cluster_cannot_hold_fails_at_start(ray_cluster: RayCluster) -> None:
    config = pool_config(replicas=3, num_gpus=1)
    started = time.monotonic()
    with pytest.raises(ResourceUnavailable) as info:
        async with RayBackend.from_config(config):
            pass
    assert time.monotonic() - started < 5
    assert info.value.needed == {"CPU": pytest.approx(0.3), "GPU": 3.0}
    assert info.value.available["GPU"] == 2.0


async def test_a_failed_start_closes_the_pool_without_async_with(ray_cluster: RayCluster) -> None:
    pool = RayBackend.from_config(pool_config(replicas=3, num_gpus=1))
    with pytest.raises(ResourceUnavailable):
        await pool.start()
    assert pool.is_closed()
    assert pool.statistics().actors_live == 0
    with pytest.raises(PoolError, match="already started"):
        await pool.start()
    await pool.aclose()  # idempotent


# -- lifecycle ------------------------------------------------------------------------------------


async def test_failed_tool_import_fails_start_with_the_key(ray_cluster: RayCluster) -> None:
    from agent_backend.errors import ConfigError

    config = pool_config("support.ray_tools:echo", "support.ray_tools:does_not_exist")
    with pytest.raises(ConfigError) as info:
        async with RayBackend.from_config(config):
            pass
    assert info.value.key == "tools.1.function"
    assert "does_not_exist" in str(info.value)


_DRIVER = textwrap.dedent(
    """
    import json, socket, sys
    import anyio, ray
    from agent_backend.backends.ray import RayBackend, RayPoolConfig

    def port_open(address):
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((host, int(port))) == 0

    async def main(address):
        # Run from tests/: Ray puts the driver's directory on its workers' sys.path.
        out = {}
        joined = RayPoolConfig(address=address, num_cpus=0.1, tools=["support.ray_tools:echo"],
                               log_to_driver=False)
        async with RayBackend.from_config(joined) as pool:
            out["joined_echo"] = (await pool.call("echo", {"text": "joined"})).value
        out["joined_connected_after"] = ray.is_initialized()
        local = RayPoolConfig(num_cpus=0.1, tools=["support.ray_tools:echo"],
                              local={"num_cpus": 1, "object_store_memory": 80 * 2**20},
                              log_to_driver=False)
        async with RayBackend.from_config(local) as pool:
            own = ray.get_runtime_context().gcs_address
            out["local_echo"] = (await pool.call("echo", {"text": "local"})).value
            out["local_differs"] = own != address
            async with RayBackend.from_config(local) as second:  # shares the local Ray
                out["second_same_ray"] = ray.get_runtime_context().gcs_address == own
            out["second_echo_after"] = (await pool.call("echo", {"text": "still"})).value
        out["local_connected_after"] = ray.is_initialized()
        out["local_gcs_open_after"] = port_open(own)
        print(json.dumps(out))

    anyio.run(main, sys.argv[1])
    """
)


async def test_joined_cluster_survives_and_local_ray_is_shut_down(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": TESTS_DIR}
    completed = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, str(script), ray_cluster.address],
            capture_output=True,
            text=True,
            timeout=300,  # a hang detector: ~20 s idle, more than 100 s with both cores busy
            env=env,
            cwd=TESTS_DIR,
        )
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.strip().splitlines()[-1])
    assert out == {
        "joined_echo": "joined",
        "joined_connected_after": False,  # the second driver disconnected,
        "local_echo": "local",
        "local_differs": True,
        "second_same_ray": True,
        "second_echo_after": "still",  # the second pool's close left the shared Ray up...
        "local_connected_after": False,  # ...the last pool's close shut it down,
        "local_gcs_open_after": False,
    }
    # ...while the cluster it joined still runs.
    assert ray.get(ray.put("alive")) == "alive"
    assert ray.cluster_resources()["GPU"] == 2


def test_local_ray_listens_on_loopback_only(ray_cluster: RayCluster) -> None:
    """Tests talk only to 127.0.0.1: the local cluster must not bind the machine's address."""
    ray = require_ray()
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray.util.get_node_ip_address() == "127.0.0.1"


async def test_a_pool_closed_from_another_task_inside_a_cancel_scope_closes_cleanly(
    ray_cluster: RayCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool set closes its pools each in its own task: the Ray pool's background tasks must
    not belong to the task that started it (closing them elsewhere failed, was logged, and left
    the starting task's cancel scopes in disorder)."""
    from agent_backend.pool_file import PoolSet

    backend = RayBackend.from_config(pool_config(name="closed-elsewhere"))
    with anyio.CancelScope() as outer:
        async with PoolSet({"gpu": backend}, "gpu"):
            assert (await backend.call("echo", {"text": "hi"})).value == "hi"
        assert not outer.cancel_called
    assert backend.is_closed()
    assert backend.statistics().actors_live == 0
    assert not [record for record in caplog.records if "failed" in record.getMessage()]
