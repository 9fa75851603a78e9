"""A cgroup per sandbox (cgroup v1: memory, pids, cpu, freezer), under this process's own cgroups.

Each controller's tree gets ``agent-backend-<token>/`` (one per owner, the
token of :class:`~agent_backend.sandbox.registry.Registry`) beside this
process's own cgroup, and in it one child per sandbox with its limits written
before any process joins. A process joins at birth: the thread that spawns it
moves into the sandbox's cgroups (v1 moves a single thread with its ``tasks``
file) and back after the spawn, so there is no instant in which a child runs
outside them. Removing a sandbox's cgroup freezes it, SIGKILLs every member,
thaws it and removes the directories: a fork bomb cannot outrun a frozen group.

This module must never write outside the ``agent-backend-*`` directories it
made, nor remove a cgroup of an owner whose lock is held (live).
Blocking calls: run them in a worker thread (or the spawner's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

from agent_backend.sandbox.config import SandboxLimits

__all__ = ["CONTROLLERS", "Cgroup", "CgroupTree", "cgroup_v1_missing", "remove_dead_owner"]

logger = logging.getLogger("agent_backend.sandbox")

CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_MOUNTS = "/sys/fs/cgroup"
_PERIOD_US = 100_000


def _own_paths() -> dict[str, str]:
    """This process's cgroup in each v1 hierarchy, e.g. ``{"memory": "/a/b"}``."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as file:
        for line in file:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                if controller:
                    paths[controller] = path
    return paths


def cgroup_v1_missing() -> list[str]:
    """The v1 controllers this process cannot make cgroups in (empty: all of them usable)."""
    missing: list[str] = []
    own = _own_paths()
    for controller in CONTROLLERS:
        base = os.path.join(_MOUNTS, controller) + own.get(controller, "/")
        if controller not in own or not os.access(base, os.W_OK):
            missing.append(controller)
    return missing


@dataclasses.dataclass(frozen=True, slots=True)
class Cgroup:
    """One sandbox's cgroups: their directories, and the ``tasks`` files a thread joins by."""

    name: str
    directories: tuple[str, ...]

    @property
    def tasks_files(self) -> tuple[str, ...]:
        return tuple(os.path.join(d, "tasks") for d in self.directories)


class CgroupTree:
    """This owner's subtree in each controller: ``<own cgroup>/../agent-backend-<token>``."""

    def __init__(self, token: str) -> None:
        own = _own_paths()
        self.token = token
        # Inside our own cgroup (v1 lets a cgroup hold tasks and children): whatever limits
        # this process lives under bind its sandboxes too.
        self.parents = _parents(own)
        self.roots = {c: os.path.join(p, f"agent-backend-{token}") for c, p in self.parents.items()}
        # Where the spawning thread goes back to after each spawn.
        self.home_tasks_files = tuple(
            os.path.join(os.path.join(_MOUNTS, c) + own[c], "tasks") for c in CONTROLLERS
        )

    def create(self) -> None:
        for root in self.roots.values():
            os.makedirs(root, exist_ok=True)

    def make(self, name: str, limits: SandboxLimits) -> Cgroup:
        """The sandbox ``name``'s cgroups, made with ``limits`` written (before any member)."""
        made: list[str] = []
        try:
            for controller in CONTROLLERS:
                path = os.path.join(self.roots[controller], name)
                os.mkdir(path, 0o755)
                made.append(path)
                _write_limits(controller, path, limits)
        except BaseException:
            for path in made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return Cgroup(name, tuple(made))

    @contextlib.contextmanager
    def born_in(self, cgroup: Cgroup) -> Iterator[None]:
        """The calling thread alone inside ``cgroup`` (v1 ``tasks``), back home on the way out:
        a process it starts meanwhile is born there."""
        tid = str(threading.get_native_id())
        try:
            for path in cgroup.tasks_files:
                _write_file(path, tid)
            yield
        finally:
            for path in self.home_tasks_files:
                with contextlib.suppress(OSError):
                    _write_file(path, tid)

    def remove(self, cgroup: Cgroup) -> None:
        """Kill every member (frozen first), then remove the directories."""
        _destroy(list(cgroup.directories))

    def empty(self, cgroup: Cgroup) -> None:
        """Kill every member (frozen first); the cgroups stay, limits and all."""
        _kill_members(list(cgroup.directories))

    def names(self) -> list[str]:
        """The sandboxes' cgroups this owner has now (by name)."""
        with contextlib.suppress(FileNotFoundError):
            return sorted(
                e.name for e in os.scandir(self.roots["pids"]) if e.is_dir(follow_symlinks=False)
            )
        return []

    def close(self) -> None:
        """Remove every sandbox's cgroups and this owner's subtree; idempotent."""
        remove_owner_tree(self.parents, self.token)


def _parents(own: dict[str, str]) -> dict[str, str]:
    return {c: os.path.join(_MOUNTS, c) + own.get(c, "/").rstrip("/") for c in CONTROLLERS}


def remove_dead_owner(token: str, parents: dict[str, str]) -> None:
    """Remove a dead owner's cgroups under ``parents`` (its :attr:`CgroupTree.parents`), their
    members killed first. Only ``agent-backend-<token>`` directories are touched."""
    kept = {
        c: os.path.normpath(p)
        for c, p in parents.items()
        if c in CONTROLLERS and os.path.normpath(p).startswith(os.path.join(_MOUNTS, c))
    }
    remove_owner_tree(kept, token)


def remove_owner_tree(parents: dict[str, str], token: str) -> None:
    """Kill and remove every sandbox cgroup of ``token``, then its ``agent-backend-<token>`` dirs."""
    roots = [os.path.join(p, f"agent-backend-{token}") for p in parents.values()]
    names: set[str] = set()
    for root in roots:
        with contextlib.suppress(FileNotFoundError):
            names.update(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    for name in sorted(names):
        _destroy([os.path.join(root, name) for root in roots])
    for root in roots:
        with contextlib.suppress(FileNotFoundError):
            _rmdir(root)


def _write_limits(controller: str, path: str, limits: SandboxLimits) -> None:
    if controller == "memory":
        memory = str(limits.memory_mb << 20)
        _write(path, "memory.limit_in_bytes", memory)
        # Without swap accounting in the kernel the file is absent; memory alone binds then.
        with contextlib.suppress(FileNotFoundError):
            _write(path, "memory.memsw.limit_in_bytes", memory)
    elif controller == "pids":
        _write(path, "pids.max", str(limits.tasks))
    elif controller == "cpu":
        _write(path, "cpu.cfs_period_us", str(_PERIOD_US))
        _write(path, "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * _PERIOD_US))))


def _write(directory: str, name: str, value: str) -> None:
    _write_file(os.path.join(directory, name), value)


def _write_file(path: str, value: str) -> None:
    with open(path, "w") as file:
        file.write(value)


def _members(directory: str) -> list[int]:
    try:
        with open(os.path.join(directory, "cgroup.procs")) as file:
            return [int(line) for line in file if line.strip()]
    except FileNotFoundError:
        return []


def _destroy(directories: list[str]) -> None:
    _kill_members(directories)
    for directory in directories:
        _rmdir(directory)


def _kill_members(directories: list[str]) -> None:
    freezer = next((d for d in directories if "/freezer/" in d), None)
    members_of = next((d for d in directories if "/pids/" in d), directories[0])
    for _ in range(100):
        members = _members(members_of)
        if not members:
            break
        if freezer is not None:
            with contextlib.suppress(OSError):
                _write(freezer, "freezer.state", "FROZEN")
        for pid in _members(members_of):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if freezer is not None:
            with contextlib.suppress(OSError):
                _write(freezer, "freezer.state", "THAWED")
        time.sleep(0.002)


def _rmdir(directory: str) -> None:
    # A killed member leaves its cgroup when its exit is complete, a moment after SIGKILL.
    for attempt in range(500):
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == 499:
                logger.warning("cannot remove cgroup %s: %s", directory, exc)
                return
            time.sleep(0.01)
