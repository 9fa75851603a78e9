"""A real multi-node Ray on this machine for tests and benchmarks: a head and worker nodes.

``ray.cluster_utils.Cluster``: each worker node is its own raylet and object store, loopback
only; nodes are added and killed at will (``kill`` SIGKILLs the raylet and its workers, as
when a machine goes away). The head holds no CPU, so every actor lives on a worker node. The
cluster keeps its sessions and logs in its own temp dir, and does not leave its address in
the machine's "current cluster" file, so a ``ray.init()`` elsewhere never joins it by chance.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

__all__ = ["LocalNodes"]

MB = 1024 * 1024


class LocalNodes:
    """A head (no CPU) and the worker nodes added to it; ``health`` sets Ray's node health
    checks (``health_check_period_ms``, ``health_check_failure_threshold``)."""

    def __init__(self, health: dict[str, int], *, store_mb: int = 80) -> None:
        from ray._common.utils import reset_ray_address
        from ray.cluster_utils import Cluster

        from agent_backend.backends.ray.runtime import loopback_only

        loopback_only()
        self.temp_dir = tempfile.mkdtemp(prefix="abrn-")
        self._store = store_mb * MB
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "temp_dir": self.temp_dir,
                "_system_config": health,
            },
        )
        reset_ray_address()  # Cluster wrote it for ray.init(); we join by address instead
        self.nodes: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, **resources: Any) -> str:
        """A worker node (``num_cpus`` 2, ``num_gpus`` 0, custom resources); its id once it has
        registered. Blocking, and in the main thread only (Ray's node start sets signals)."""
        cpus, gpus = resources.pop("num_cpus", 2), resources.pop("num_gpus", 0)
        node = self.cluster.add_node(
            num_cpus=cpus,
            num_gpus=gpus,
            resources=resources or None,
            object_store_memory=self._store,
            wait=True,
        )
        self.nodes[str(node.node_id)] = node
        return str(node.node_id)

    def kill(self, node_id: str) -> None:
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=False)

    def kill_all(self) -> None:
        for node_id in list(self.nodes):
            self.kill(node_id)

    def shutdown(self) -> None:
        self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
