"""The Ray kit: Python tools on a pool of Ray actors, and what the Ray rollout workers build on.

Modules:

* :mod:`~agent_backend.backends.ray.config`: :class:`RayPoolConfig` (``type = "ray"``), pure data.
* :mod:`~agent_backend.backends.ray.backend`: :class:`RayBackend`, the tool pool.
* :mod:`~agent_backend.backends.ray.reports`: what the pool reports (results, actors, statistics).
* :mod:`~agent_backend.backends.ray.actor`: what runs inside each tool actor.
* :mod:`~agent_backend.backends.ray.supervisor`: a pool of actors' lifecycle and queue.
* :mod:`~agent_backend.backends.ray.replicas`: which actor serves each replica, their faults.
* :mod:`~agent_backend.backends.ray.runtime`: this process's connection to Ray, actor placement.
* :mod:`~agent_backend.backends.ray.payload`: :class:`PayloadRef`, results by reference.

The names below are the public surface. The second group is the kit for
another pool of actors (the rollout workers,
:mod:`agent_backend.rollout.ray_workers`, are built on it): the supervisor
base, its replica record, the Ray plumbing an actor's owner needs, and
how an actor imports a ``module:function``.
"""

from __future__ import annotations

from agent_backend.backends.ray.actor import import_function
from agent_backend.backends.ray.backend import RayActorInfo, RayBackend, RayResult, RayStatistics
from agent_backend.backends.ray.config import LocalRayConfig, RayPoolConfig, RayToolConfig
from agent_backend.backends.ray.payload import PayloadRef
from agent_backend.backends.ray.replicas import Replica
from agent_backend.backends.ray.runtime import (
    ACTOR_DEATHS,
    actor_options,
    describe_cause,
    describe_when_ready,
)
from agent_backend.backends.ray.supervisor import ActorSupervisor

__all__ = [
    "ACTOR_DEATHS",
    "ActorSupervisor",
    "LocalRayConfig",
    "PayloadRef",
    "RayActorInfo",
    "RayBackend",
    "RayPoolConfig",
    "RayResult",
    "RayStatistics",
    "RayToolConfig",
    "Replica",
    "actor_options",
    "describe_cause",
    "describe_when_ready",
    "import_function",
]
