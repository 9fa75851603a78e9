"""Faults on a real local Ray: killed and crashing actors, bounded restarts, errors that cross.

Third-party exceptions that cannot be pickled, and the HTTP status lost at the actor boundary,
must not kill a job or hide an infrastructure error; a pool must not keep handing out a dead actor.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from support.ray_fixtures import RayCluster, pool_config, ray_cluster, require_ray, settle

ray = require_ray()

from support import ray_tools  # noqa: E402
from test_public_api import ERROR_SAMPLES  # noqa: E402

from agent_backend.backends.ray import RayBackend  # noqa: E402
from agent_backend.errors import (  # noqa: E402
    AgentBackendError,
    BackendUnavailable,
    ToolFailed,
    WorkerLost,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
__all__ = ["ray_cluster"]  # the fixture, imported for this module


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def pool(ray_cluster: RayCluster) -> AsyncIterator[RayBackend]:
    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:raise_sample",
        "support.ray_tools:raise_locked",
        "support.ray_tools:raise_socket",
        "support.ray_tools:raise_http",
        "support.ray_tools:raise_wrapped_http",
        "support.ray_tools:return_lock",
    )
    async with RayBackend.from_config(config) as backend:
        yield backend
        assert backend.statistics().evictions == 0  # no tool error cost an actor


# -- errors cross the boundary --------------------------------------------------------------------


@pytest.mark.parametrize(
    "index", range(len(ERROR_SAMPLES)), ids=lambda i: type(ERROR_SAMPLES[i]).__name__
)
async def test_every_project_error_comes_back_from_a_tool_with_its_fields(
    pool: RayBackend, index: int
) -> None:
    sample = ERROR_SAMPLES[index]
    with pytest.raises(AgentBackendError) as info:
        await pool.call("raise_sample", {"index": index})
    error = info.value
    assert type(error) is type(sample)
    assert error.__dict__ == sample.__dict__
    assert str(error) == str(sample)
    assert error.args == sample.args


class _Raiser:
    def raise_it(self, error: BaseException) -> None:
        raise error


async def test_every_project_error_crosses_rays_own_exception_path(ray_cluster: RayCluster) -> None:
    """Sent to a plain Ray actor as an argument and raised there: Ray pickles it both ways."""
    raiser = ray.remote(_Raiser).options(num_cpus=0).remote()
    try:
        for sample in ERROR_SAMPLES:
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                await raiser.raise_it.remote(sample)
            cause = info.value.cause
            assert isinstance(info.value, type(sample))  # Ray's error subclasses the cause's
            assert type(cause) is type(sample)
            assert cause.__dict__ == sample.__dict__
            assert str(cause) == str(sample)
    finally:
        ray.kill(raiser)


@pytest.mark.parametrize(
    ("tool", "error_type", "text"),
    [
        ("raise_locked", "support.ray_tools.LockedError", "the reward server is locked"),
        ("raise_socket", "support.ray_tools.SocketError", "the tool server hung up"),
    ],
)
async def test_unpicklable_exceptions_come_back_typed(
    pool: RayBackend, tool: str, error_type: str, text: str
) -> None:
    with pytest.raises(ToolFailed) as info:
        await pool.call(tool)
    error = info.value
    assert error.tool == tool
    assert error.error_type == error_type
    assert text in error.message
    assert error.status is None
    assert f"in {tool}" in error.traceback  # the tool's own frame
    clone = pickle.loads(pickle.dumps(error))
    assert clone.__dict__ == error.__dict__


async def test_an_http_error_keeps_its_status_across_the_boundary(pool: RayBackend) -> None:
    original = ray_tools.ClientResponseError(
        "u", (), status=503, message="m", headers=ray_tools._Headers({})
    )
    with pytest.raises(TypeError):
        pickle.dumps(original)  # the point: this exception cannot cross as itself

    with pytest.raises(ToolFailed) as info:
        await pool.call("raise_http", {"status": 503})
    error = info.value
    assert error.status == 503  # infrastructure (5xx), not a data error
    assert error.error_type == "support.ray_tools.ClientResponseError"
    assert "Service Unavailable" in error.message
    assert pickle.loads(pickle.dumps(error)).status == 503

    with pytest.raises(ToolFailed) as wrapped:
        await pool.call("raise_wrapped_http")
    assert wrapped.value.status == 502  # found on the cause
    assert wrapped.value.error_type == "RuntimeError"
    assert "scoring failed" in wrapped.value.message

    with pytest.raises(ToolFailed) as client_error:
        await pool.call("raise_http", {"status": 404})
    assert client_error.value.status == 404


async def test_a_result_ray_cannot_serialize_is_a_typed_error(pool: RayBackend) -> None:
    with pytest.raises(ToolFailed) as info:
        await pool.call("return_lock")
    assert "pickle" in info.value.message
    assert info.value.tool == "return_lock"
    assert (await pool.call("echo", {"text": "after"})).value == "after"


# -- dead actors ----------------------------------------------------------------------------------


async def test_killed_actors_are_evicted_replaced_and_gone_after_aclose(
    ray_cluster: RayCluster,
) -> None:
    from ray._private import state

    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:hold",
        {"function": "support.ray_tools:hold", "name": "hold_again", "idempotent": True},
        replicas=2,
        max_restarts=3,
        address=ray_cluster.address,  # joins the running cluster (this process's connection)
    )
    backend = RayBackend.from_config(config)
    ray_names: set[str] = set()
    async with backend:
        ray_names |= {info.ray_name for info in backend.actors()}

        # Not idempotent: WorkerLost naming the actor and the cause, well before the call's end.
        errors: list[WorkerLost] = []
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(_call_catching, backend, "hold", errors)
            victim = await _busy_actor(backend)
            ray.kill(ray.get_actor(victim.ray_name))
        assert time.monotonic() - started < 10
        error = errors[0]
        assert isinstance(error, WorkerLost)
        assert error.worker == victim.name
        assert (
            error.cause == "ActorDiedError: The actor is dead because it was killed by `ray.kill`."
        )
        assert victim.name in str(error)
        assert pickle.loads(pickle.dumps(error)).__dict__ == error.__dict__

        # Evicted at once: the next calls never go to the dead actor (a pool that did got stuck).
        for _ in range(4):
            assert (await backend.call("echo", {"text": "x"})).actor != victim.name
        await settle(backend, lambda: backend.statistics().actors_live == 2)
        stats = backend.statistics()
        assert (stats.evictions, stats.restarts) == (1, 1)
        replica = victim.name.removeprefix("test-").split(".")[0]
        assert f"test-{replica}.1" in {info.name for info in backend.actors()}
        assert _states(state, {victim.ray_name}) == {"DEAD"}
        ray_names |= {info.ray_name for info in backend.actors()}

        # Idempotent: retried once, on another actor, and it succeeds.
        results: list[Any] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_call_keeping, backend, "hold_again", results)
            second = await _busy_actor(backend)
            ray.kill(ray.get_actor(second.ray_name))
        result = results[0]
        assert result.attempts == 2
        assert result.actor != second.name
        assert backend.statistics().retries == 1
        await settle(backend, lambda: backend.statistics().actors_live == 2)
        ray_names |= {info.ray_name for info in backend.actors()}

        # An idle actor that dies is evicted by its sentinel, before any call reaches it.
        idle = backend.actors()[0]
        ray.kill(ray.get_actor(idle.ray_name))
        await settle(backend, lambda: backend.statistics().evictions == 3)
        for _ in range(3):
            assert (await backend.call("echo", {"text": "x"})).actor != idle.name
        await settle(backend, lambda: backend.statistics().actors_live == 2)
        ray_names |= {info.ray_name for info in backend.actors()}
        assert _states(state, ray_names) == {"ALIVE", "DEAD"}

    await backend.aclose()  # idempotent
    # aclose leaves no actor alive, replacements included, and leaves the joined cluster up.
    assert len(ray_names) == 5
    assert _states(state, ray_names) == {"DEAD"}
    assert ray.is_initialized()
    assert ray.get(ray.put("still up")) == "still up"


async def test_restarts_are_bounded_and_then_calls_fail_fast(ray_cluster: RayCluster) -> None:
    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:crash",
        "support.ray_tools:getenv",
        replicas=1,
        max_restarts=1,
        runtime_env={"env_vars": {"AGENT_BACKEND_TEST_ENV": "set by runtime_env"}},
    )
    async with RayBackend.from_config(config) as backend:
        first = backend.actors()[0].name
        with pytest.raises(WorkerLost) as info:
            await backend.call("crash")
        assert info.value.worker == first
        assert info.value.cause
        assert "worker process has died" in info.value.cause
        await settle(backend, lambda: backend.statistics().actors_live == 1)
        replaced = await backend.call("getenv", {"name": "AGENT_BACKEND_TEST_ENV"})
        assert replaced.actor == "test-0.1"
        assert replaced.value == "set by runtime_env"  # the replacement has the same runtime_env

        with pytest.raises(WorkerLost):
            await backend.call("crash")
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="out of restarts"):
            await backend.call("echo", {"text": "nobody left"})
        assert time.monotonic() - started < 1
        stats = backend.statistics()
        assert (stats.actors_live, stats.actors_dead, stats.restarts) == (0, 1, 1)
        assert "0 live, 0 starting, 1 dead" in repr(backend)


# -- helpers --------------------------------------------------------------------------------------


async def _call_catching(backend: RayBackend, tool: str, errors: list[Any]) -> None:
    try:
        await backend.call(tool, {"seconds": 30})
    except AgentBackendError as exc:
        errors.append(exc)


async def _call_keeping(backend: RayBackend, tool: str, results: list[Any]) -> None:
    results.append(await backend.call(tool, {"seconds": 1.0}))


async def _busy_actor(backend: RayBackend) -> Any:
    await settle(backend, lambda: backend.statistics().calls_in_flight == 1)
    await anyio.sleep(0.3)  # let the call start inside the actor
    return next(info for info in backend.actors() if info.in_flight == 1)


def _states(state: Any, ray_names: set[str]) -> set[str]:
    return {info["State"] for info in state.actors().values() if info["Name"] in ray_names}
