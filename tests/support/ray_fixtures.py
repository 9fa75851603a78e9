"""A real local Ray for the Ray tests, started once per test session, and pool helpers.

The cluster is small on purpose (other suites share the machine): 2 logical
CPUs, 2 logical GPUs (no real GPU is needed for placement and
``ray.get_gpu_ids()``), a 256 MB object store. Pools in the tests reserve
fractions of a CPU so that several fit at once. Workers import the test
tools (``tests/support/ray_tools.py``) through the job's code search path.

Without Ray the Ray tests skip, except under ``CI=true``, where a missing
Ray fails the run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

TESTS_DIR = str(Path(__file__).resolve().parents[1])


def require_ray() -> ModuleType:
    """The ``ray`` module; skips the calling test module without it (fails under ``CI=true``)."""
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            raise RuntimeError(
                f"CI=true and Ray is not installed ({exc}): pip install -e '.[ray]'"
            ) from exc
        pytest.skip(f"Ray is not installed ({exc})", allow_module_level=True)
    return ray


@dataclasses.dataclass(frozen=True)
class RayCluster:
    address: str
    """The GCS address (``HOST:PORT``) a second driver joins with."""
    num_gpus: int


_started: list[RayCluster] = []


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> RayCluster:
    """The session's local Ray (started on first use, shut down when pytest exits).

    Idempotent on purpose: each test module imports this fixture, which gives
    each module its own fixture definition; the cluster must still be one.
    """
    ray = require_ray()
    if _started and not ray.is_initialized():
        # Shut down for a module that must run without Ray (test_integration_skyrl): start again.
        _started.clear()
    if not _started:
        from agent_backend.backends.ray.runtime import loopback_only

        loopback_only()  # the test cluster listens on 127.0.0.1 only
        ray.init(
            # A new local Ray even when another runs on the machine (a `ray start` cluster of
            # another test): without "local", ray.init joins the last cluster started here.
            address="local",
            num_cpus=2,
            num_gpus=2,
            object_store_memory=256 * 1024 * 1024,
            include_dashboard=False,
            log_to_driver=False,
            # On the workers' sys.path without a runtime_env (which would cost each
            # actor a runtime-env set-up): how ray_tools and test_public_api import there.
            job_config=ray.job_config.JobConfig(code_search_path=[TESTS_DIR]),
        )
        request.config.add_cleanup(ray.shutdown)
        _started.append(RayCluster(ray.get_runtime_context().gcs_address, 2))
    return _started[0]


def pool_config(*tools: Any, **overrides: Any) -> Any:
    """A :class:`RayPoolConfig` for the tests: small CPU share, short timeouts, test tools."""
    from agent_backend.backends.ray import RayPoolConfig

    settings: dict[str, Any] = {
        "name": "test",
        "num_cpus": 0.1,
        "start_timeout": 180,
        "call_timeout": 30,
        "inline_limit": 128 * 1024,
        "tools": tools or ("support.ray_tools:echo",),
    }
    settings.update(overrides)
    return RayPoolConfig.model_validate(settings)


async def settle(pool: Any, condition: Callable[[], bool], *, within: float = 150.0) -> None:
    """Wait for ``condition`` on a Ray pool's or workers' state (woken at each change of it);
    fail the test after ``within``: a bound, not a timing (an eviction and restart that takes
    2 s idle took more than 20 s with both cores busy)."""
    try:
        with anyio.fail_after(within):
            await pool.wait_until(condition)
    except TimeoutError:
        pytest.fail(f"condition still false after {within:g}s")


async def wait_for(condition: Callable[[], bool], *, within: float = 300.0) -> None:
    """Poll ``condition`` (for state outside a pool: a policy server's requests); fail the test
    after ``within``: a bound, not a timing (Ray's restarts and evictions took more than 20 s
    with both cores busy)."""
    deadline = time.monotonic() + within
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"condition still false after {within:g}s")
        await anyio.sleep(0.02)
