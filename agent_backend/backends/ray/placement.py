"""Where a pool's actors can go: the cluster's nodes as shapes, and whether a pool fits them.

Ray places an actor on one node, so a pool fits a cluster when its actors
fit the nodes one by one, not when the cluster's totals cover their sum
(two nodes of one GPU each never hold an actor of two). :func:`check_nodes`
packs a pool's replicas onto the nodes' total resources (first fit, biggest
node first) and refuses a pool that does not fit with the shapes of every
node, at start, instead of letting Ray wait for resources that will never
exist. With placement groups (``bundles``) a replica is its bundles, placed
by the group's strategy. Pure: :func:`alive_nodes` is the one blocking read of Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from agent_backend.errors import ResourceUnavailable

__all__ = ["NodeShape", "PlacementSpec", "alive_nodes", "check_nodes", "replica_units"]

_EPSILON = 1e-9


@dataclasses.dataclass(frozen=True, slots=True)
class NodeShape:
    """One alive node of the cluster, as placement sees it."""

    node_id: str
    address: str
    total: Mapping[str, float]
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def short(self) -> str:
        return f"node {self.node_id[:8]} ({self.address})"


def alive_nodes() -> list[NodeShape]:
    """The cluster's alive nodes (blocking: a GCS read; call it in a worker thread)."""
    import ray

    shapes = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive"):
            continue
        total = {
            name: float(amount)
            for name, amount in node.get("Resources", {}).items()
            if not name.startswith("node:")
        }
        shapes.append(
            NodeShape(
                node_id=str(node["NodeID"]),
                address=str(node.get("NodeManagerAddress", "")),
                total=total,
                labels={str(k): str(v) for k, v in (node.get("Labels") or {}).items()},
            )
        )
    return shapes


class PlacementSpec(Protocol):
    """What fitting reads from a pool config (``RayPoolConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def replicas(self) -> int: ...
    @property
    def autoscaling(self) -> bool: ...
    @property
    def node_labels(self) -> Mapping[str, str]: ...
    @property
    def bundles(self) -> Sequence[Mapping[str, float]]: ...
    @property
    def bundle_strategy(self) -> str: ...
    def actor_resources(self) -> dict[str, float]: ...


def replica_units(config: PlacementSpec) -> tuple[list[dict[str, float]], bool]:
    """What one replica reserves, as the units Ray places (each on one node), and whether
    those units must go to distinct nodes (``strict_spread``)."""
    if not config.bundles:
        return [config.actor_resources()], False
    bundles = [{k: float(v) for k, v in bundle.items() if v > 0} for bundle in config.bundles]
    strategy = config.bundle_strategy
    if strategy == "strict_pack":
        summed: dict[str, float] = {}
        for bundle in bundles:
            for name, amount in bundle.items():
                summed[name] = summed.get(name, 0.0) + amount
        return [summed], False
    return bundles, strategy == "strict_spread"


def _fits(free: Mapping[str, float], unit: Mapping[str, float]) -> bool:
    return all(free.get(name, 0.0) + _EPSILON >= amount for name, amount in unit.items())


def _take(free: dict[str, float], unit: Mapping[str, float]) -> None:
    for name, amount in unit.items():
        free[name] = free.get(name, 0.0) - amount


def _matches(node: NodeShape, labels: Mapping[str, str]) -> bool:
    return all(node.labels.get(key) == value for key, value in labels.items())


def _render(resources: Mapping[str, float]) -> str:
    from agent_backend.backends.ray.runtime import render_resources

    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") or not _internal(k)}
    return render_resources(shown)


def _internal(name: str) -> bool:
    return name in ("memory", "object_store_memory") or name.startswith("node:")


def check_nodes(config: PlacementSpec, nodes: Sequence[NodeShape]) -> None:
    """Refuse, at start, a pool whose replicas the alive ``nodes`` could never hold at once.

    A no-op with ``autoscaling`` (nodes come on demand). The error names what
    one replica needs and each node's shape and how many replicas it could hold.
    """
    if config.autoscaling:
        return
    units, distinct = replica_units(config)
    eligible = [node for node in nodes if _matches(node, config.node_labels)]
    # Biggest nodes first, so a big replica is not refused because small ones took its node.
    order = sorted(eligible, key=lambda node: -sum(node.total.get(k, 0.0) for k in ("CPU", "GPU")))
    free = [dict(node.total) for node in order]
    placed = 0
    for _ in range(config.replicas):
        trial = [dict(entry) for entry in free]
        used: set[int] = set()
        ok = True
        for unit in units:
            index = next(
                (
                    i
                    for i, entry in enumerate(trial)
                    if not (distinct and i in used) and _fits(entry, unit)
                ),
                None,
            )
            if index is None:
                ok = False
                break
            _take(trial[index], unit)
            used.add(index)
        if not ok:
            break
        free = trial
        placed += 1
    if placed == config.replicas:
        return
    raise _unfit(config, units, distinct, nodes, eligible, placed)


def _capacity(node: NodeShape, units: Sequence[Mapping[str, float]]) -> int:
    """How many replicas ``node`` alone could hold (units placed on it one after another)."""
    free = dict(node.total)
    count = 0
    while count < 1024:
        for unit in units:
            if not _fits(free, unit):
                return count
            _take(free, unit)
        count += 1
    return count


def _unfit(
    config: PlacementSpec,
    units: Sequence[Mapping[str, float]],
    distinct: bool,
    nodes: Sequence[NodeShape],
    eligible: Sequence[NodeShape],
    placed: int,
) -> ResourceUnavailable:
    if len(units) == 1:
        shape = f"{_render(units[0])} on one node"
    else:
        joined = " + ".join(_render(unit) for unit in units)
        shape = f"bundles {joined} ({config.bundle_strategy})"
    lines = []
    for node in nodes:
        fits = "" if node in eligible else f", labels {dict(node.labels)} do not match"
        room = _capacity(node, units) if not distinct and node in eligible else None
        holds = f", holds {room}" if room is not None else ""
        lines.append(f"{node.short()}: {_render(node.total)}{holds}{fits}")
    where = "; ".join(lines) if lines else "no alive node"
    labels = f" with labels {dict(config.node_labels)}" if config.node_labels else ""
    needed: dict[str, float] = {}
    for unit in units:
        for name, amount in unit.items():
            needed[name] = needed.get(name, 0.0) + amount * config.replicas
    total: dict[str, float] = {}
    for node in nodes:
        for name in needed:
            total[name] = total.get(name, 0.0) + node.total.get(name, 0.0)
    return ResourceUnavailable(
        f"pool {config.name!r} needs {config.replicas} replica(s) of {shape}{labels}, but the "
        f"cluster's nodes hold only {placed}: {where} "
        "(set autoscaling = true if nodes are added on demand)",
        needed=needed,
        available=total,
        backend="ray",
    )
