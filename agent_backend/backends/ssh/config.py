"""SSH pool configuration (pydantic, loaded from pool files) and the pool's statistics.

Pure data: this module must never connect, read a key file or start anything.
Paths are resolved against the pool file here; the files are read by the host
when it starts.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import asyncssh.encryption
import pydantic

from agent_backend.config import ConfigModel, ConfigPath
from agent_backend.dispatch.spec import EnvName
from agent_backend.sandbox import Guarantees, Isolation, SandboxLimits

__all__ = [
    "SSHHostConfig",
    "SSHHostSettings",
    "SSHHostStats",
    "SSHPoolConfig",
    "SSHStatistics",
    "walls_differ",
]


# What a sandbox of an SSH host cannot enforce (no per-session cgroups; /tmp is memory).
_UNENFORCED_LIMITS = frozenset({"memory_mb", "tasks", "cpus", "tmp_mb"})


class SSHHostSettings(ConfigModel):
    """How to reach and use one SSH host; every key has a default except the host itself."""

    port: int = pydantic.Field(default=22, ge=1, le=65535)
    """TCP port of the host's sshd."""
    username: str | None = None
    """Remote user. None: the local user running the pool."""
    known_hosts: ConfigPath = pydantic.Field(default="~/.ssh/known_hosts", validate_default=True)
    """OpenSSH known_hosts file holding the host's key. Host keys are always verified
    against it unless ``insecure_skip_host_key_check`` is true. Relative to the pool file."""
    insecure_skip_host_key_check: bool = False
    """Accept any host key (anyone on the network path can impersonate the host). Must be set
    explicitly; a WARNING is logged for every host it applies to."""
    client_keys: tuple[ConfigPath, ...] = ()
    """Private key files to authenticate with (public-key authentication only). Empty:
    asyncssh's defaults (``~/.ssh/id_*`` and a running ssh-agent). Relative to the pool file."""
    env: dict[EnvName, str] = pydantic.Field(default_factory=dict)
    """Environment variables exported for every command on the host (a command's own win).
    Set by the remote shell, so sshd's AcceptEnv is not needed."""
    workspace_root: str | None = None
    """Absolute remote directory under which session workspaces (mode 0700) are made; it must
    be the login user's own (made 0700 if missing; one owned by another user, or a symbolic
    link, is refused). None: ``/tmp/agent-backend-<uid>``, one per remote user, so that users
    of one host never share (or squat) each other's."""
    shell: str = "/bin/sh"
    """Remote shell that runs command lines (``shell -c LINE``). argv commands run directly
    from the login shell, like ``ssh host -- argv``."""
    max_connections: int = pydantic.Field(default=8, ge=1, le=256)
    """SSH connections kept to the host at most. New ones open only when all are full."""
    max_channels_per_connection: int = pydantic.Field(default=8, ge=1, le=64)
    """Concurrent calls per connection. Keep it below sshd's MaxSessions (10 by default;
    sshd frees sessions lazily, so exactly 10 still fails under load)."""
    preferred_ciphers: tuple[str, ...] = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
    """Ciphers offered first, ahead of asyncssh's defaults (which stay allowed after them).
    AES-GCM uses the CPU's AES instructions; asyncssh's chacha20-poly1305 costs about twice the
    client CPU per packet. Empty: asyncssh's default order."""
    connect_timeout: float = pydantic.Field(default=10.0, gt=0)
    """Seconds for TCP connect, key exchange and authentication of one connection."""
    keepalive_interval: float = pydantic.Field(default=15.0, ge=0)
    """Seconds between SSH keepalive requests on an idle connection; 0 disables them."""
    keepalive_count_max: int = pydantic.Field(default=3, ge=1)
    """Unanswered keepalives after which a connection is declared dead and dropped."""
    idle_ttl: float = pydantic.Field(default=300.0, ge=0)
    """Seconds a connection may stay unused (counted from the end of its last call) before
    it is closed; 0 keeps idle connections open forever."""
    max_concurrent_handshakes: int = pydantic.Field(default=4, ge=1, le=64)
    """SSH handshakes in flight to the host at once, so a burst of callers at a cold pool
    stays under sshd's MaxStartups (10 unauthenticated connections by default)."""
    handshake_interval: float = pydantic.Field(default=0.01, ge=0)
    """Minimum seconds between the starts of two handshakes to the host."""
    connect_retries: int = pydantic.Field(default=2, ge=0, le=20)
    """Further attempts of a failed handshake (refused, reset, timed out), with backoff.
    Host-key and authentication failures are not retried."""
    channel_open_retries: int = pydantic.Field(default=6, ge=0, le=100)
    """Further attempts when sshd refuses a channel (MaxSessions reached), with backoff;
    the refusing connection's capacity is lowered to the channels it has open."""
    retry_backoff: float = pydantic.Field(default=0.05, gt=0)
    """First backoff delay in seconds; doubles after each failure, with jitter."""
    retry_backoff_max: float = pydantic.Field(default=2.0, gt=0)
    """Upper bound of a backoff delay in seconds."""
    down_after_failures: int = pydantic.Field(default=3, ge=1)
    """Consecutive failed connection attempts (each after its retries) with no connection
    open after which the host is marked down: calls to it fail at once, placement skips it."""
    probe_interval: float = pydantic.Field(default=5.0, gt=0)
    """Seconds between reconnection probes of a host marked down."""
    kill_grace: float = pydantic.Field(default=0.5, ge=0, le=60)
    """Seconds between TERM and KILL when a timed-out or cancelled call's remote process
    group is ended."""
    file_op_timeout: float = pydantic.Field(default=60.0, gt=0)
    """Seconds for one file operation (make/remove workspace, read, write, list)."""
    isolation: Isolation = "namespaces"
    """The walls around every command (docs/sandboxes.md, "SSH hosts"). ``namespaces`` (the
    default): each
    call runs on the host inside a bubblewrap sandbox of its own (user, mount, PID, network,
    IPC, UTS namespaces; the session workspace the only writable host directory; no
    capabilities; ``limits``); a host that cannot build it (no ``bwrap``, user namespaces off)
    is refused with what it lacks, never used unconfined. ``none``: as the login user, with
    nothing between a command and the host (an explicit choice, never a default).
    ``--isolation`` on the command line sets it for every host. One tier per pool: every host
    must say the same."""
    limits: SandboxLimits = pydantic.Field(default_factory=SandboxLimits)
    """Limits under ``isolation = "namespaces"`` (``[limits]``): ``open_files`` and
    ``file_size_mb``, hard rlimits of every process. The others (``memory_mb``, ``tasks``,
    ``cpus``, ``tmp_mb``) are the local pool's cgroup limits: an SSH host has no per-session
    cgroups, so setting them here is refused."""

    @pydantic.field_validator("workspace_root", "shell")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if (
            not posixpath.isabs(value)
            or posixpath.normpath(value) != value.rstrip("/")
            or value == "/"
        ):
            raise ValueError("must be a normalized absolute remote path other than /")
        return value.rstrip("/")

    @pydantic.field_validator("limits")
    @classmethod
    def _enforced_limits(cls, value: SandboxLimits) -> SandboxLimits:
        unenforced = sorted(value.model_fields_set & _UNENFORCED_LIMITS)
        if unenforced:
            raise ValueError(
                f"{', '.join(unenforced)}: not enforced on SSH hosts (no per-session cgroups); "
                "only open_files and file_size_mb apply"
            )
        return value

    @pydantic.field_validator("preferred_ciphers")
    @classmethod
    def _known_ciphers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        known = {alg.decode("ascii") for alg in asyncssh.encryption.get_encryption_algs()}
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown cipher(s) {unknown}; known: {sorted(known)}")
        return value


class SSHHostConfig(SSHHostSettings):
    """One SSH host of a pool."""

    host: str = pydantic.Field(min_length=1)
    """Host name or IP address (resolved at each connect; ``~/.ssh/config`` is not read)."""


class SSHPoolConfig(SSHHostSettings):
    """A pool of SSH hosts (``type = "ssh"``).

    Every host key set at the top level is a default for each ``[[hosts]]`` table,
    which may override it.
    """

    type: Literal["ssh"] = "ssh"
    """Selects the SSH backend."""
    hosts: tuple[SSHHostConfig, ...] = pydantic.Field(min_length=1)
    """The hosts; calls go to the least-loaded host that is up (sessions stay on theirs)."""
    close_timeout: float = pydantic.Field(default=10.0, gt=0)
    """Seconds ``aclose()`` waits for calls in flight to be ended before closing connections."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _hosts_inherit_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not isinstance(data.get("hosts"), list | tuple):
            return data
        shared = {k: v for k, v in data.items() if k in SSHHostSettings.model_fields}
        if not shared:
            return data
        hosts: list[Any] = []
        for entry in data["hosts"]:
            if isinstance(entry, SSHHostConfig):
                entry = entry.model_dump(exclude_unset=True)
            hosts.append({**shared, **entry} if isinstance(entry, Mapping) else entry)
        return {**data, "hosts": hosts}

    @pydantic.model_validator(mode="after")
    def _distinct_hosts(self) -> SSHPoolConfig:
        seen: set[tuple[str, int, str | None]] = set()
        for host in self.hosts:
            key = (host.host, host.port, host.username)
            if key in seen:
                raise ValueError(f"host {host.host}:{host.port} is listed twice")
            seen.add(key)
        return self

    @pydantic.model_validator(mode="after")
    def _one_tier(self) -> SSHPoolConfig:
        different = walls_differ(self.hosts)
        if different is not None:
            raise ValueError(different)
        return self


def walls_differ(hosts: Sequence[SSHHostSettings]) -> str | None:
    """Why ``hosts`` cannot be one pool's: their isolation or limits differ (a session may land
    on any of them). None: they agree."""
    for host in hosts[1:]:
        if (host.isolation, host.limits) != (hosts[0].isolation, hosts[0].limits):
            names = [getattr(h, "host", "?") for h in (hosts[0], host)]
            return (
                f"hosts {names[0]} and {names[1]} differ in isolation or limits: a pool has one "
                "tier, every host of it the same (a session may run on any of them)"
            )
    return None


# -- statistics -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SSHHostStats:
    """One host's pool at one instant."""

    host: str
    """``user@host:port``."""
    up: bool
    """False while marked down after repeated connection failures."""
    closed: bool
    connections_open: int
    connections_idle: int
    """Open connections with no call on them."""
    connections_connecting: int
    """Handshakes started and not finished."""
    leases_active: int
    """Calls holding a channel slot."""
    leases_queued: int
    """Calls waiting for a slot."""
    channels_open: int
    handshakes: int
    """Handshake attempts since start (retries and probes included)."""
    handshake_failures: int
    connections_lost: int
    """Connections that died under the pool (not closed by it)."""
    connections_reaped: int
    """Connections closed by the reaper after ``idle_ttl``."""
    channel_refusals: int
    """Channel opens sshd refused (MaxSessions)."""
    calls: int
    remote_kills: int
    """Remote process groups ended on timeout or cancellation."""
    consecutive_failures: int
    workspaces: int
    walls_refused: bool = False
    """Under ``isolation = "namespaces"``: the last check of the host's walls failed (placement
    prefers other hosts; each call to it checks again and raises what is missing)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SSHStatistics:
    """Every host of an SSH backend at one instant."""

    hosts: tuple[SSHHostStats, ...]
    closed: bool
    guarantees: Guarantees | None = None
    """The walls around every command (``isolation`` and ``limits`` in force)."""

    @property
    def leases_active(self) -> int:
        return sum(h.leases_active for h in self.hosts)

    @property
    def leases_queued(self) -> int:
        return sum(h.leases_queued for h in self.hosts)

    @property
    def connections_open(self) -> int:
        return sum(h.connections_open for h in self.hosts)

    @property
    def connections_idle(self) -> int:
        return sum(h.connections_idle for h in self.hosts)
