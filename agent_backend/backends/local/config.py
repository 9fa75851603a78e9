"""The local pool's configuration: what a ``type = "local"`` pool file may say.

Data only: this module must never start a process or touch the disk (a path
is resolved against the pool file's folder, not checked).
"""

from __future__ import annotations

from typing import Literal

import pydantic

from agent_backend.config import ConfigModel, ConfigPath
from agent_backend.dispatch.spec import EnvName
from agent_backend.sandbox import EgressEntry, Isolation, SandboxLimits

__all__ = ["LocalPoolConfig"]


class LocalPoolConfig(ConfigModel):
    """A pool that runs every call on this machine (``type = "local"``)."""

    type: Literal["local"] = "local"
    """Selects the local backend."""
    workspace_root: ConfigPath | None = None
    """Directory in which session workspaces (and the scratch directory) are created, made if
    missing. Relative paths are relative to the pool file. None: the system temporary directory."""
    default_cwd: ConfigPath | None = None
    """Working directory of commands run outside a session (it must exist). None: a private
    scratch directory made at start and removed at close, shared by all sessionless calls."""
    max_concurrent_calls: int = pydantic.Field(default=32, ge=1, le=4096)
    """Commands running at once; more wait for a slot, and the wait counts against their timeout."""
    env_passthrough: tuple[EnvName, ...] = (
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "TERM",
    )
    """Variables copied from this process's environment into every command's, when set.
    Nothing else is inherited (no API keys leak into tool commands by default)."""
    extra_env: dict[EnvName, str] = pydantic.Field(default_factory=dict)
    """Variables set for every command, over the passed-through ones (a call's own env wins)."""
    shell: str = "/bin/sh"
    """The shell that runs command lines (``shell -c LINE``)."""
    kill_grace: float = pydantic.Field(default=2.0, gt=0, le=60)
    """Seconds between SIGTERM and SIGKILL when a call's process group is ended."""
    spare_workspaces: int = pydantic.Field(default=64, ge=0, le=4096)
    """Empty workspaces kept made ahead, as many as were ever in use at once but at most this
    many, so that opening a session costs no disk operation. 0: each is made when asked for."""
    isolation: Isolation = "namespaces"
    """The walls around every command (docs/sandboxes.md). ``namespaces`` (the default): each
    session in its own PID, mount, network, IPC and UTS namespaces, as a uid of its own, within
    ``limits``; the pool refuses to start where the host cannot enforce that, and says what is
    missing. ``none``: as this process's user, with nothing between a command and the host (a
    trusted model on a developer's machine; ``--isolation none`` on the command line)."""
    limits: SandboxLimits = pydantic.Field(default_factory=SandboxLimits)
    """Per-session limits under ``isolation = "namespaces"`` (``[limits]`` in a pool file)."""
    workspace_quota_mb: int | None = pydantic.Field(default=None, ge=1, le=1 << 30)
    """The most a session's workspace may hold, in MiB, under ``isolation = "namespaces"``: each
    workspace (a fork's own changes, a grader's) is a tmpfs of this size, owned by its uid, and
    a write past it fails with ENOSPC. Its pages are memory, charged to the memory cgroup of
    whoever wrote them (``limits.memory_mb`` of its session). None: no quota, the workspace root's
    filesystem is the bound. Not allowed under ``isolation = "none"`` (nothing would enforce it)."""
    max_sandboxes: int = pydantic.Field(default=1024, ge=2, le=1 << 16)
    """The most sandboxes this pool holds at once under ``isolation = "namespaces"`` (sessions',
    spares', forks', graders' and the scratch directory's), counted when one is created, before
    it is ready. Past it, opening a session (or a fork) fails at once with
    :class:`~agent_backend.errors.BackendUnavailable` (HTTP 503) and no spare is made."""
    sandbox_read_only: tuple[ConfigPath, ...] = ()
    """More host paths every sandbox sees read-only at their own paths (a virtual environment,
    a dataset), beside the system directories; only under ``isolation = "namespaces"``."""
    sandbox_agent_idle: float | None = pydantic.Field(default=30.0, gt=0, le=86400)
    """Seconds a session's sandbox agent (the Python program that starts its commands, ~5 MB)
    stays without a call before it leaves; the next call starts it again (tens of ms of CPU;
    seconds on a machine loaded by a policy server). Longer than a model's usual turn, so that
    an episode's calls find it up. An idle sandbox then holds only its init, a shell (under
    1 MB). A spare's agent stays until a session takes it. None: agents stay for the sandbox's
    whole life."""
    sandbox_state_dir: ConfigPath = "/run/agent-backend"
    """Where sandboxing backends on this host record what they own (their uids), so that one
    that starts after another died removes what the dead one left (and nothing of a live one)."""
    egress_allow: tuple[EgressEntry, ...] = ()
    """The only destinations (``host:port``) a sandbox may open TCP connections to, relayed
    by this process (docs/sandboxes.md, "Egress"); anything else stays unreachable. A host is
    an IPv4 address, an IPv6 one in brackets, or a name, resolved once when the pool starts and
    written in every sandbox's ``/etc/hosts``. Under ``isolation = "none"`` nothing is
    restricted and this is not used."""

    @pydantic.model_validator(mode="after")
    def _quota_enforced(self) -> LocalPoolConfig:
        if self.isolation == "none" and self.workspace_quota_mb is not None:
            raise ValueError(
                "workspace_quota_mb needs isolation = 'namespaces' (a tmpfs per workspace): "
                "under 'none' nothing would enforce it"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _walls_fit(self) -> LocalPoolConfig:
        if self.isolation == "namespaces" and self.default_cwd is not None:
            raise ValueError(
                "default_cwd cannot be used with isolation = 'namespaces': commands outside a "
                "session run in a private scratch directory of their own sandbox"
            )
        return self
