"""What a pool's walls guarantee, and what a host lacks for the walls a pool asks for.

A pool reports :class:`Guarantees` (``pool check``, ``statistics()``, the
daemon's readiness and start banner), so a reader sees what is enforced, not
what was meant. :func:`missing_for_namespaces` names each thing this host
lacks for the ``namespaces`` tier, with how to get it; a pool that asks for
that tier refuses to start while the list is not empty (never a fallback).

This module must never change the host: it only looks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence

from agent_backend.sandbox.cgroups import cgroup_v1_missing
from agent_backend.sandbox.config import Isolation, SandboxLimits

__all__ = [
    "AGENT_PYTHON",
    "Guarantees",
    "closed_ancestor",
    "guarantees_of",
    "missing_for_namespaces",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Guarantees:
    """The walls in force around every command of a pool, in words, one per kind of wall."""

    isolation: Isolation
    filesystem: str
    processes: str
    network: str
    uid: str
    limits: dict[str, str]
    disk: str = ""
    """The workspace's disk: its quota, and how forks and snapshots copy it."""

    def lines(self) -> list[str]:
        """One ``name: guarantee`` line each, for a banner or ``pool check``."""
        lines = [
            f"isolation: {self.isolation}",
            f"filesystem: {self.filesystem}",
            f"processes: {self.processes}",
            f"network: {self.network}",
            f"uid: {self.uid}",
        ]
        lines += [f"disk: {self.disk}"] if self.disk else []
        lines += [f"limit {name}: {value}" for name, value in self.limits.items()]
        return lines


def guarantees_of(
    isolation: Isolation,
    limits: SandboxLimits,
    *,
    egress: Sequence[str] = (),
    workspace_quota_mb: int | None = None,
) -> Guarantees:
    """The guarantees of a pool with ``isolation`` and ``limits`` that has started; ``egress``:
    the destinations its sandboxes may reach (``egress_allow``; nothing is restricted under
    ``none``); ``workspace_quota_mb``: each workspace's size (None: no quota)."""
    if isolation == "none":
        none = "none (this process's user, namespaces and limits: pool isolation = 'none')"
        return Guarantees(
            isolation="none",
            filesystem="none: the whole host as this process's user sees it",
            processes="a process group per call; daemonized processes can escape it",
            network="host: every address this process can reach",
            uid=none,
            limits={},
            disk="no quota (the workspace root's filesystem); forks and snapshots are whole "
            "copies (cp -a, reflinks where the filesystem has them)",
        )
    return Guarantees(
        isolation="namespaces",
        filesystem="own mount namespace: system directories read-only, the session workspace "
        "the only writable directory besides a private /tmp",
        processes="own PID namespace per session: what a call starts dies when it ends (when "
        "calls of one session overlap, when the last of them ends) and at the session's close",
        network="own network namespace: loopback only"
        + ("; egress allowed to: " + ", ".join(egress) if egress else ", no egress"),
        uid="own uid per session (user namespace), no capabilities, no_new_privs",
        limits={
            "memory": f"{limits.memory_mb} MiB per session (memory cgroup)",
            "tasks": f"{limits.tasks} per session (pids cgroup)",
            "cpu": f"{limits.cpus:g} cores per session (cpu cgroup quota)",
            "open files": f"{limits.open_files} per process (RLIMIT_NOFILE)",
            "file size": f"{limits.file_size_mb} MiB per file (RLIMIT_FSIZE)",
            "tmp": f"{limits.tmp_mb} MiB private /tmp per session (tmpfs)",
        },
        disk=(
            "no quota (the workspace root's filesystem)"
            if workspace_quota_mb is None
            else f"{workspace_quota_mb} MiB per workspace, a fork's own changes included (tmpfs, "
            "charged to its session's memory): past it, ENOSPC"
        )
        + "; forks and snapshots are copy-on-write overlayfs layers, read through idmapped "
        "mounts; graders run in a fresh sandbox on a snapshot",
    )


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None


#: The interpreter of the agent in every sandbox (:mod:`agent_backend.sandbox.agent`): the
#: host's own, under ``/usr``, which every sandbox sees read-only.
AGENT_PYTHON = "/usr/bin/python3"


def missing_for_namespaces(*, bwrap: str = "bwrap", setpriv: str = "setpriv") -> list[str]:
    """What this host lacks for the ``namespaces`` tier, each with how to get it (empty: none)."""
    missing: list[str] = []
    if not os.path.isdir("/proc/self/ns"):
        return ["Linux namespaces (the namespaces tier runs on Linux only)"]
    if os.geteuid() != 0:
        missing.append(
            "root: a uid of its own per session needs the daemon to run as root (or see "
            "docs/sandboxes.md for running unconfined as a user)"
        )
    if shutil.which(bwrap) is None:
        missing.append(f"{bwrap!r} (bubblewrap): apt-get install bubblewrap")
    if shutil.which(setpriv) is None:
        missing.append(f"{setpriv!r}: apt-get install util-linux")
    if not os.access(AGENT_PYTHON, os.X_OK):
        missing.append(
            f"{AGENT_PYTHON} (runs each sandbox's agent): apt-get install python3-minimal"
        )
    if _read_int("/proc/sys/user/max_user_namespaces") == 0:
        missing.append("user namespaces: sysctl -w user.max_user_namespaces=65536")
    if _read_int("/proc/sys/kernel/unprivileged_userns_clone") == 0:
        missing.append("user namespaces for users: sysctl -w kernel.unprivileged_userns_clone=1")
    if _read_int("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == 1:
        missing.append(
            "user namespaces under AppArmor: sysctl -w "
            "kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile for bwrap)"
        )
    absent = cgroup_v1_missing()
    if absent:
        missing.append(
            "cgroup v1 controllers " + ", ".join(absent) + " mounted and writable under "
            "/sys/fs/cgroup (cgroup v2 hosts are not supported yet)"
        )
    return missing


def closed_ancestor(path: str) -> str | None:
    """The first directory from ``/`` down to ``path`` that other users cannot pass through
    (no ``o+x``): a sandbox's own uid could not reach a workspace below it. None: all open."""
    current = "/"
    for part in os.path.realpath(path).strip("/").split("/"):
        if not part:
            continue
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except FileNotFoundError:
            return None  # made by the backend, with a mode that lets its sandboxes through
        if not mode & 0o001:
            return current
    return None
