"""A Ray pool behind the Dispatcher and the daemon: its tools are routed to its actors.

The same calls a local or SSH pool takes (a model's tool call, a session,
the daemon's HTTP route) reach Python tools hosted by Ray actors; model
mistakes and tool failures come back as results, infrastructure failures
raise, and a result kept by reference is described to the model while the
caller in this process holds the ``PayloadRef``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from support.ray_fixtures import RayCluster, pool_config, ray_cluster, require_ray, settle

ray = require_ray()

from agent_backend import Client, Dispatcher, ToolCall, ToolRegistry  # noqa: E402
from agent_backend.backends.ray import RayBackend  # noqa: E402
from agent_backend.backends.ray.payload import PayloadRef, checksum  # noqa: E402
from agent_backend.daemon import DaemonSettings  # noqa: E402
from agent_backend.daemon.background import run_in_thread  # noqa: E402
from agent_backend.dispatch import builtin_tools  # noqa: E402
from agent_backend.errors import ConfigError, PoolError, WorkerLost  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
__all__ = ["ray_cluster"]  # the fixture, imported for this module

TOOLS = (
    "support.ray_tools:echo",
    "support.ray_tools:hold",
    "support.ray_tools:make_array",
    "support.ray_tools:inspect_payload",
    "support.ray_tools:raise_http",
    "support.ray_tools:whoami",
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pool(ray_cluster: RayCluster) -> AsyncIterator[RayBackend]:
    config = pool_config(*TOOLS, name="dispatch", replicas=2, max_concurrency=2)
    async with RayBackend.from_config(config) as backend:
        yield backend


@pytest.fixture
async def dispatcher(pool: RayBackend) -> AsyncIterator[Dispatcher]:
    async with Dispatcher(ToolRegistry(), pool, default_timeout=20) as running:
        yield running


async def test_the_pools_tools_join_the_registry_and_run_on_its_actors(
    dispatcher: Dispatcher, pool: RayBackend
) -> None:
    assert set(dispatcher.registry.names()) == {name.split(":")[1] for name in TOOLS}
    assert dispatcher.registry.to_openai()[0]["function"]["name"] == "echo"
    result = await dispatcher.call(ToolCall("c1", "echo", '{"text": "hi"}', "openai"))
    assert result.ok, result
    assert result.output == "hi"
    assert result.value == "hi"
    actors = {actor.name for actor in pool.actors()}
    assert result.host in actors


async def test_arguments_are_repaired_where_the_tool_runs(dispatcher: Dispatcher) -> None:
    # "0.05" is a number sent as a string: coerced against the tool's schema on the actor.
    result = await dispatcher.call(("hold", '{"seconds": "0.05"}'))
    assert result.ok, result
    assert result.value["peak"] >= 1


async def test_model_mistakes_and_tool_failures_are_results(dispatcher: Dispatcher) -> None:
    bad = await dispatcher.call(("hold", '{"seconds": "soon"}'))
    assert not bad.ok
    assert bad.error_type == "ToolArgumentError"
    assert "seconds" in (bad.error or "")
    unknown = await dispatcher.call(("nope", {}))
    assert unknown.error_type == "UnknownToolError"
    assert "echo" in (unknown.error or "")
    failed = await dispatcher.call(("raise_http", {"status": 503}))
    assert not failed.ok
    assert failed.error_type == "ToolFailed"
    assert "ClientResponseError" in (failed.error or "")


async def test_a_call_past_its_timeout_is_stopped_and_the_pool_serves_on(
    dispatcher: Dispatcher, pool: RayBackend
) -> None:
    slow = await dispatcher.call(("hold", {"seconds": 30}), timeout=0.5)
    assert not slow.ok
    assert slow.error_type == "Timeout"
    assert slow.duration < 10
    again = await dispatcher.call(("echo", {"text": "still here"}))
    assert again.output == "still here"
    assert pool.statistics().actors_live == 2


async def test_a_large_result_stays_by_reference_and_feeds_the_next_call(
    dispatcher: Dispatcher,
) -> None:
    made = await dispatcher.call(("make_array", {"n": 1_000_000, "seed": 3}))
    assert made.ok, made
    payload = made.value
    assert isinstance(payload, PayloadRef)
    # The model sees what was kept, never the megabyte.
    assert made.output_bytes < 1000
    assert f'"size":{1_000_000}' in made.output
    assert payload.checksum is not None
    assert payload.checksum in made.output
    # Passed on inside the arguments of a second call, resolved on the consuming actor.
    seen = await dispatcher.call(("inspect_payload", {"data": payload}))
    assert seen.ok, seen
    expected = checksum(ray.get(payload.object_ref))
    assert seen.value == {
        "checksum": expected,
        "type": "ndarray",
        "nbytes": 1_000_000,
        "writeable": False,
    }
    payload.release()


async def test_sessions_on_a_pool_without_hosts_group_calls_without_a_workspace(
    dispatcher: Dispatcher,
) -> None:
    async with dispatcher.session() as session:
        assert session.host is None
        assert session.workspace is None
        results = await session.call_many([("echo", {"text": "a"}), ("echo", {"text": "b"})])
        assert [r.output for r in results] == ["a", "b"]
        assert dispatcher.statistics().sessions_open == 1
    assert dispatcher.statistics().sessions_open == 0
    with pytest.raises(PoolError, match="closed"):
        await session.call(("echo", {"text": "late"}))


async def test_command_tools_on_a_pool_without_hosts_fail_at_construction(
    pool: RayBackend,
) -> None:
    registry = ToolRegistry()
    for tool in builtin_tools():
        registry.add(tool)
    with pytest.raises(ConfigError, match="has no hosts") as caught:
        Dispatcher(registry, pool)
    assert "exec" in str(caught.value) or "read_file" in str(caught.value)


async def test_a_registry_tool_named_like_a_pool_tool_is_refused(pool: RayBackend) -> None:
    registry = ToolRegistry()

    @registry.tool
    def echo(text: str) -> str:
        """A local echo that would shadow the pool's.

        Args:
            text: What to return.
        """
        return text

    with pytest.raises(ConfigError, match="also hosted"):
        Dispatcher(registry, pool)


async def test_a_pool_must_be_open_before_a_dispatcher_takes_it(ray_cluster: RayCluster) -> None:
    backend = RayBackend.from_config(pool_config("support.ray_tools:echo", name="unopened"))
    with pytest.raises(PoolError, match="open it"):
        Dispatcher(ToolRegistry(), backend)
    await backend.aclose()


async def test_the_daemon_serves_a_ray_pools_tools(ray_cluster: RayCluster) -> None:
    """Over HTTP: the tools are listed and called; a kept result is described, not sent."""
    settings = DaemonSettings(tokens=("t" * 32,), port=0, grace=2.0)
    config = pool_config(*TOOLS, name="daemon")

    async def use(url: str) -> tuple[list[str], Any, Any, Any]:
        async with Client(url, token="t" * 32) as client:
            names = [tool["name"] for tool in await client.tools(format="mcp")]
            echoed = await client.call(("echo", {"text": "over http"}))
            kept = await client.call(("make_array", {"n": 500_000}))
            async with client.session() as session:
                in_session = await session.call(("whoami", {}))
            return names, echoed, kept, in_session

    with run_in_thread(ToolRegistry(), settings, pool=config) as daemon:
        names, echoed, kept, in_session = await use(daemon.url)
    assert set(names) == {name.split(":")[1] for name in TOOLS}
    assert echoed.ok
    assert echoed.output == "over http"
    assert kept.ok
    assert '"size":500000' in kept.output
    assert kept.value is None
    assert in_session.ok, in_session
    assert in_session.host.startswith("daemon-")


async def test_an_actor_killed_mid_call_raises_worker_lost_through_the_dispatcher(
    ray_cluster: RayCluster,
) -> None:
    """Infrastructure, not the model's doing: raised (typed, named), and the session survives."""
    config = pool_config(
        "support.ray_tools:hold",
        "support.ray_tools:echo",
        {"function": "support.ray_tools:hold", "name": "hold_again", "idempotent": True},
        name="dfault",
        replicas=2,
        max_restarts=2,
    )
    async with (
        RayBackend.from_config(config) as backend,
        Dispatcher(ToolRegistry(), backend, default_timeout=20) as dispatcher,
        dispatcher.session() as session,
    ):
        caught: list[BaseException] = []

        async def run(tool: str) -> None:
            try:
                caught.append(await session.call((tool, {"seconds": 2})))
            except WorkerLost as exc:
                caught.append(exc)

        for tool in ("hold", "hold_again"):
            async with anyio.create_task_group() as group:
                group.start_soon(run, tool)
                await settle(backend, lambda: backend.statistics().calls_in_flight == 1)
                await anyio.sleep(0.3)  # the call is running inside the actor
                busy = next(info for info in backend.actors() if info.in_flight == 1)
                ray.kill(ray.get_actor(busy.ray_name))
            await settle(backend, lambda: backend.statistics().actors_live == 2)
        lost, retried = caught
        assert isinstance(lost, WorkerLost)
        assert lost.worker is not None
        assert lost.worker.startswith("dfault-")
        assert "killed by `ray.kill`" in (lost.cause or "")
        # Declared idempotent: retried once on another actor, and the model sees a success.
        assert not isinstance(retried, BaseException)
        assert retried.ok, retried
        again = await session.call(("echo", {"text": "after"}))
        assert again.output == "after"
        assert dispatcher.statistics().sessions_open == 1
