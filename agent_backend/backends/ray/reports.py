"""What a Ray tool pool reports: one call's result, each actor's state, the pool's statistics.

:class:`RayResult`, :class:`RayActorInfo` and :class:`RayStatistics` are
frozen data made by :class:`~agent_backend.backends.ray.backend.RayBackend`,
safe to keep, log and compare: this module must never call Ray nor hold an
actor handle (a result's value may be a
:class:`~agent_backend.backends.ray.payload.PayloadRef`, which owns its
object reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from agent_backend.backends.ray.payload import PayloadRef

__all__ = ["RayActorInfo", "RayResult", "RayStatistics"]


@dataclasses.dataclass(frozen=True, slots=True)
class RayResult:
    """What one call on a Ray pool returned."""

    tool: str
    value: Any
    """The tool's return value, or a :class:`PayloadRef` when it stayed in the object store."""
    actor: str
    """The actor that ran the (last) attempt: ``POOL-REPLICA.GENERATION``."""
    duration: float
    """Seconds from the call to its result, queueing and retry included."""
    attempts: int = 1
    """2 when an idempotent call was retried after its actor died."""

    @property
    def by_reference(self) -> bool:
        return isinstance(self.value, PayloadRef)

    @property
    def payload(self) -> PayloadRef | None:
        return self.value if isinstance(self.value, PayloadRef) else None


@dataclasses.dataclass(frozen=True, slots=True)
class RayActorInfo:
    """One actor of a pool, as the pool sees it now."""

    name: str
    """``POOL-REPLICA.GENERATION``, as errors name it."""
    ray_name: str
    """The Ray actor's name (``ray.get_actor(ray_name)``, ``ray list actors``)."""
    state: Literal["starting", "live", "unavailable", "dead"]
    """``unavailable``: Ray lost its connection and has not said yet whether it died (no calls
    go to it meanwhile)."""
    in_flight: int
    served: int
    pid: int | None
    node: str | None
    gpu_ids: tuple[str, ...]
    """GPUs Ray granted the actor, as ``ray.get_gpu_ids()`` reported inside it."""
    cause: str | None
    """Why it died; None while it lives."""
    node_id: str | None = None
    """The Ray node it runs on (hex id; ``node`` is that node's address)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RayStatistics:
    actors_live: int
    actors_starting: int
    actors_dead: int
    """Replicas that died and are not (yet) replaced."""
    calls_in_flight: int
    calls_queued: int
    calls: int
    """Calls finished (with a result or an error) since start."""
    retries: int
    """Idempotent calls run again after their actor died."""
    evictions: int
    """Actors evicted after they died."""
    restarts: int
    """Replicas replaced after a real death of their running actor (each counts against
    ``max_restarts``; a replacement that could not be placed or started and is tried again does not)."""
    payloads: int
    """By-reference results not yet released."""
    closed: bool
    actors_unavailable: int = 0
    """Actors out of rotation while Ray decides whether they (or their node) died."""
    nodes_lost: int = 0
    """Nodes whose death evicted the pool's actors on them."""
