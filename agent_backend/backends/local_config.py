"""The local pool's configuration: what a ``type = "local"`` pool file may say.

Data only: this module must never start a process or touch the disk (a path
is resolved against the pool file's folder, not checked).
"""

from __future__ import annotations

from typing import Literal

import pydantic

from agent_backend.config import ConfigModel, ConfigPath
from agent_backend.dispatch.spec import EnvName
from agent_backend.sandbox import Isolation, SandboxLimits

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
    isolation: Isolation = "none"
    """The walls around every command (docs/sandboxes.md). ``namespaces``: each call in its own
    PID, mount, network, IPC and UTS namespaces, as a uid of its session's own, within
    ``limits``; the pool refuses to start where the host cannot enforce that. ``none``: as this
    process's user, with nothing between a command and the host."""
    limits: SandboxLimits = pydantic.Field(default_factory=SandboxLimits)
    """Per-session limits under ``isolation = "namespaces"`` (``[limits]`` in a pool file)."""
    sandbox_read_only: tuple[ConfigPath, ...] = ()
    """More host paths every sandbox sees read-only at their own paths (a virtual environment,
    a dataset), beside the system directories; only under ``isolation = "namespaces"``."""
    sandbox_state_dir: ConfigPath = "/run/agent-backend"
    """Where sandboxing backends on this host record what they own (their uids), so that one
    that starts after another died removes what the dead one left (and nothing of a live one)."""

    @pydantic.model_validator(mode="after")
    def _walls_fit(self) -> LocalPoolConfig:
        if self.isolation == "namespaces" and self.default_cwd is not None:
            raise ValueError(
                "default_cwd cannot be used with isolation = 'namespaces': commands outside a "
                "session run in a private scratch directory of their own sandbox"
            )
        return self
