"""A child driver for the cluster tests: opens a Ray pool (or rollout workers) from a spec, prints JSON.

Run as ``python -m support.ray_driver SPEC.json`` (``tests/`` on ``sys.path``)
so that a test drives a cluster of its own (``support/ray_cluster.py``)
without touching the test process's Ray: a driver is connected to one Ray at
a time. The spec says what to open and what to call:

* ``{"pool": {...}, "calls": [[tool, arguments], ...]}``: a
  :class:`~agent_backend.backends.ray.RayBackend` from the pool table (loaded
  like a pool file's, so a bad one is a ``ConfigError`` at load), each call's
  value in ``results``;
* ``{"pool": {...}, "rollout": {"url", "model", "tools_dir", "workspace_root"}}``:
  :class:`~agent_backend.rollout.ray_workers.RayRolloutWorkers` with the tool
  files of ``tools_dir``, which is deleted once they are made (the workers
  must not need it), and one episode, its records in ``results``.

The last stdout line is ``RESULT {json}``: ``ok``, ``results``, ``head_node``
(the Ray node id of the head), ``elapsed`` seconds (from the load of the
pool table to the end, imports excluded); on failure ``error_type``,
``message``, ``key`` (a ``ConfigError``'s) instead.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import anyio

MARKER = "RESULT "


def _head_node() -> str | None:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


async def _pool(config: Any, calls: list[list[Any]]) -> dict[str, Any]:
    from agent_backend.backends.ray import RayBackend

    async with RayBackend.from_config(config) as pool:
        results = [(await pool.call(tool, arguments)).value for tool, arguments in calls]
        return {"results": results, "head_node": _head_node()}


async def _rollout(config: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from agent_backend.pool_file import DEFAULT_POOL
    from agent_backend.rollout.episode import EpisodeConfig, EpisodeIds
    from agent_backend.rollout.ray_workers import RayRolloutWorkers

    workers = RayRolloutWorkers(
        config,
        policy={"url": spec["url"], "model": spec["model"], "max_retries": 0},
        tools_dir=spec["tools_dir"],
        tool_pool=DEFAULT_POOL.model_copy(update={"workspace_root": spec["workspace_root"]}),
        episode=EpisodeConfig(timeout=60),
    )
    shutil.rmtree(spec["tools_dir"])  # read when the workers were made; no node needs it now
    async with workers:
        ids = EpisodeIds(rollout_id="cluster", group_id="cluster")
        records = await workers.run_episode({"prompt": "shout hi"}, ids, 0)
        return {
            "results": [record.model_dump(mode="json") for record in records],
            "head_node": _head_node(),
            "workers": [worker.name for worker in workers.workers],
        }


async def _main(spec: dict[str, Any]) -> dict[str, Any]:
    from agent_backend.pool_file import pool_config_from_dict

    config = pool_config_from_dict({"type": "ray", **spec["pool"]}, file="<spec>")
    if "rollout" in spec:
        return await _rollout(config, spec["rollout"])
    return await _pool(config, spec.get("calls", []))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    # Imported before the clock starts: ``elapsed`` is loading and opening, not Python's start-up.
    import agent_backend.backends.ray
    import agent_backend.pool_file
    import agent_backend.rollout.ray_workers  # noqa: F401

    started = time.monotonic()
    try:
        outcome: dict[str, Any] = {"ok": True, **anyio.run(_main, spec)}
    except Exception as exc:
        outcome = {
            "ok": False,
            "error_type": type(exc).__name__,
            "message": str(exc),
            "key": getattr(exc, "key", None),
        }
    outcome["elapsed"] = time.monotonic() - started
    print(MARKER + json.dumps(outcome, default=str), flush=True)


if __name__ == "__main__":
    main()
