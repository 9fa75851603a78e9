"""Walls the kernel enforces around the commands a model writes: namespaces, cgroups, rlimits.

* :mod:`~agent_backend.sandbox.config`: the isolation tier and the limits a pool file sets;
* :mod:`~agent_backend.sandbox.guarantees`: what a pool guarantees, and what a host lacks;
* :mod:`~agent_backend.sandbox.bwrap`: the command line that starts a sandbox;
* :mod:`~agent_backend.sandbox.agent`: the program inside it that starts each command;
* :mod:`~agent_backend.sandbox.cgroups`: a cgroup per sandbox, joined at birth;
* :mod:`~agent_backend.sandbox.egress`: the relay to the destinations a pool allows;
* :mod:`~agent_backend.sandbox.registry`: owners and their uids, on disk, for reconciliation;
* :mod:`~agent_backend.sandbox.layers`: frozen layers, and copy-on-write workspaces over them.

Below the backends and above ``dispatch``: a backend (local today) decides when a sandbox is
made and removed, and talks to its agent; this package says what one is. Nothing here runs a
command.
"""

from agent_backend.sandbox.bwrap import sandbox_argv
from agent_backend.sandbox.cgroups import Cgroup, CgroupTree, remove_dead_owner
from agent_backend.sandbox.config import Isolation, SandboxLimits
from agent_backend.sandbox.egress import EgressEntry, EgressRelay, SandboxRelays
from agent_backend.sandbox.guarantees import (
    AGENT_PYTHON,
    Guarantees,
    closed_ancestor,
    guarantees_of,
    missing_for_namespaces,
)
from agent_backend.sandbox.layers import LayerStore
from agent_backend.sandbox.registry import Registry

__all__ = [
    "AGENT_PYTHON",
    "Cgroup",
    "CgroupTree",
    "EgressEntry",
    "EgressRelay",
    "Guarantees",
    "Isolation",
    "LayerStore",
    "Registry",
    "SandboxLimits",
    "SandboxRelays",
    "closed_ancestor",
    "guarantees_of",
    "missing_for_namespaces",
    "remove_dead_owner",
    "sandbox_argv",
]
