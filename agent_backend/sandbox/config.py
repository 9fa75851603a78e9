"""What a pool file may say about the walls around its commands: the isolation tier and the limits.

Data only: this module must never start a process or touch the disk.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import pydantic

from agent_backend.config import ConfigModel

__all__ = ["Isolation", "SandboxLimits"]

Isolation: TypeAlias = Literal["none", "namespaces"]
"""``none``: commands run as this process's user, in its namespaces, without limits.
``namespaces``: each command runs behind kernel walls (docs/sandboxes.md)."""


class SandboxLimits(ConfigModel):
    """Per-session limits, enforced by the kernel; a command cannot raise them."""

    memory_mb: int = pydantic.Field(default=2048, ge=16, le=1 << 22)
    """Memory (and swap) of everything a session runs, in MiB (the memory cgroup); past it the
    kernel's OOM killer ends a process of that session, never one of another."""
    tasks: int = pydantic.Field(default=256, ge=8, le=1 << 22)
    """Processes and threads a session may have alive at once (the pids cgroup): a fork bomb
    stops there."""
    cpus: float = pydantic.Field(default=1.0, gt=0, le=1024)
    """CPU time per wall second a session may use, in cores (the cpu cgroup's quota)."""
    open_files: int = pydantic.Field(default=1024, ge=16, le=1 << 20)
    """Descriptors a process may hold open (RLIMIT_NOFILE, hard and soft)."""
    file_size_mb: int = pydantic.Field(default=1024, ge=1, le=1 << 30)
    """Largest file a process may write, in MiB (RLIMIT_FSIZE)."""
    tmp_mb: int = pydantic.Field(default=256, ge=1, le=1 << 22)
    """Size of the private ``/tmp`` each session gets (a tmpfs, charged to the session's memory)."""
