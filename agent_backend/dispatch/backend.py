"""The small abstract base every backend implements: hosts that run commands and hold files.

A *backend* is a set of *hosts* of one kind (this machine; SSH hosts), opened
and closed as one async resource; a Ray pool has no hosts and *hosts tools*
instead (see the end of this docstring). A *host* is one place a
command runs: it executes a :class:`Command` and returns a
:class:`CommandResult`, and it offers the few file operations the built-in
file tools need. Everything above this module (dispatch, sessions, daemon)
speaks only these types; everything below it (``backends/*``) implements
them and maps its own exceptions to ``agent_backend.errors`` at the boundary.

Contract for implementations:

* ``run`` never raises for a command that ran and failed (non-zero exit,
  killed by its timeout): that is a result. It raises
  :class:`~agent_backend.errors.BackendError` subclasses only for
  infrastructure failures (host unreachable, connection lost mid-call).
* Timeout and cancellation kill the whole process group (or the remote
  process): nothing the command started outlives the call.
* Output is captured incrementally into :class:`~agent_backend.dispatch.output.OutputBuffer`,
  bounded in memory whatever the command prints.
* ``aclose()`` is idempotent and leaves nothing running or open.

A backend whose workers run Python tools themselves (Ray actors) *hosts*
those tools instead of, or besides, offering hosts: :meth:`Backend.hosted_tools`
lists them once the backend is open, and :meth:`Backend.call_hosted` runs
one; the :class:`~agent_backend.dispatch.Dispatcher` routes their calls there.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Self

from agent_backend.dispatch.spec import ENV_NAME_PATTERN
from agent_backend.errors import BackendUnavailable, PathOutsideWorkspace
from agent_backend.lifecycle import AsyncResource
from agent_backend.tools import Tool

__all__ = [
    "Backend",
    "Command",
    "CommandResult",
    "DirEntry",
    "FileData",
    "Host",
    "HostedResult",
    "Output",
    "absolute_path",
    "file_error",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """A captured stream: all of it, or its head and tail when it was longer than the bound."""

    data: bytes
    """What was kept: the whole stream, or head + a marker line + tail."""
    total_bytes: int
    """How many bytes the stream really had."""
    truncated: bool

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


EMPTY_OUTPUT = Output(b"", 0, False)


_ENV_NAME = re.compile(ENV_NAME_PATTERN)


def absolute_path(path: str) -> str:
    """``path``, refused unless absolute: a host's paths never depend on its working directory."""
    if not posixpath.isabs(path):
        raise ValueError(f"host paths must be absolute, got {path!r}")
    return path


def file_error(exc: OSError, path: str, *, backend: str, host: str) -> Exception:
    """What a host's file method raises for ``exc``, an error of resolving ``path`` beneath a workspace.

    ``EXDEV`` (the kernel refused a path that leaves the workspace) is
    :class:`~agent_backend.errors.PathOutsideWorkspace`; ``ENOSYS`` (openat2
    cannot be called: its message names what the host lacks) is
    :class:`~agent_backend.errors.BackendUnavailable`; anything else is ``exc`` itself.
    """
    if exc.errno == errno.EXDEV:
        return PathOutsideWorkspace(path)
    if exc.errno == errno.ENOSYS:
        return BackendUnavailable(
            f"the file tools cannot run on {host}: {exc.strerror}", backend=backend, host=host
        )
    return exc


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One command for a host. Exactly one of ``argv`` and ``shell`` is set."""

    argv: tuple[str, ...] | None = None
    """Run this program with these arguments; on SSH each is quoted for the remote shell."""
    shell: str | None = None
    """Run this command line with the host's shell (``/bin/sh -c``)."""
    cwd: str | None = None
    """Absolute working directory on the host (a session's workspace); None: the host's default."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment variables."""
    stdin: bytes | None = None
    """Bytes written to standard input, which is then closed; None: empty input."""
    timeout: float
    """Seconds before the process (group) is killed and the result marked ``timed_out``."""
    output_limit: int = 65536
    """Bytes kept per stream (head and tail); the rest is counted, not stored."""

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.shell is None):
            raise ValueError("a Command needs exactly one of argv and shell")
        if self.argv is not None and not self.argv:
            raise ValueError("argv must not be empty")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")
        for name in self.env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    """How a command ended. ``exit_status`` is None when it was killed (``signal`` says by what)."""

    exit_status: int | None
    signal: str | None = None
    stdout: Output = EMPTY_OUTPUT
    stderr: Output = EMPTY_OUTPUT
    duration: float = 0.0
    timed_out: bool = False
    host: str = ""

    @classmethod
    def not_started(cls, host: str, duration: float, why: str) -> CommandResult:
        """A command that never started within its timeout (``why``: what it waited for).

        A timeout, as the model sees it: the host was busy, and trying again later may work.
        """
        message = f"the command did not start within its timeout: {why}".encode()
        return cls(
            exit_status=None,
            stderr=Output(message, len(message), False),
            duration=duration,
            timed_out=True,
            host=host,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class FileData:
    data: bytes
    """At most the requested limit of bytes, from the start of the file."""
    size: int
    """The file's full size."""


DirKind = Literal["file", "dir", "symlink", "other"]
_DIR_KINDS: dict[str, DirKind] = {"file": "file", "dir": "dir", "symlink": "symlink"}


@dataclasses.dataclass(frozen=True, slots=True)
class DirEntry:
    name: str
    """As the directory holds it (undecodable bytes as surrogate escapes), never escaped."""
    kind: DirKind
    size: int
    """The size of a file; 0 for anything else."""

    @classmethod
    def of(cls, name: str, kind: str, size: int) -> DirEntry:
        """An entry from untyped parts (a worker thread's or a remote helper's): unknown kinds are "other"."""
        known = _DIR_KINDS.get(kind, "other")
        return cls(name, known, size if known == "file" else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class HostedResult:
    """What a tool hosted by the backend returned (:meth:`Backend.call_hosted`)."""

    value: Any
    """The tool's return value, or a handle to a result kept where it was made (a Ray payload)."""
    worker: str
    """The worker that ran the (last) attempt, e.g. a Ray actor's name."""
    summary: Any = None
    """JSON-able text for the model in place of ``value`` (a kept result's size and checksum);
    None: ``value`` itself is rendered."""


class Host(abc.ABC):
    """One place commands run and files live.

    Workspaces are absolute paths on that host. The file methods take a
    workspace and a path relative to it, and resolve that path *beneath* the
    workspace with the kernel (``openat2(2)`` with ``RESOLVE_BENEATH |
    RESOLVE_NO_MAGICLINKS``, on the host itself): never by comparing path
    strings, never by resolving and then opening by name. So ``..`` that climbs
    out, absolute paths, absolute symlinks and symlinks that point out raise
    :class:`~agent_backend.errors.PathOutsideWorkspace`, however the tree
    changes during the call; symlinks that stay inside work. A regular file
    with more than one hard link is refused (``OSError`` with ``EMLINK``): it
    may be another name of a file outside. Other failures are the matching
    ``OSError`` (``FileNotFoundError``, ``IsADirectoryError``, ...). A host
    where openat2 cannot be called raises
    :class:`~agent_backend.errors.BackendUnavailable`: there is no weaker fallback.
    """

    name: str
    """Stable, human-readable: ``local`` or ``user@host:port``."""

    @abc.abstractmethod
    async def run(self, command: Command) -> CommandResult: ...

    @abc.abstractmethod
    async def make_workspace(self) -> str:
        """Create a new private (0700) directory and return its absolute, symlink-free path."""

    @abc.abstractmethod
    async def remove_workspace(self, path: str) -> None:
        """Remove a directory made by :meth:`make_workspace`, with everything in it."""

    @abc.abstractmethod
    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        """At most ``limit`` bytes from the start of regular file ``path`` beneath ``workspace``."""

    @abc.abstractmethod
    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        """Create (mode 0644) or replace regular file ``path`` beneath ``workspace``.

        Its parent directory must exist, unless ``make_parents``: then missing
        directories are made, each beneath ``workspace`` (no command is run).
        """

    @abc.abstractmethod
    async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
        """The entries of directory ``path`` beneath ``workspace``, sorted by name.

        Names are as the directory holds them, control characters included:
        whoever shows them to a model escapes them.
        """

    @abc.abstractmethod
    def calls_in_flight(self) -> int:
        """Calls in flight on this host now, for least-loaded placement."""

    def is_up(self) -> bool:
        """False while the host is marked down after repeated failures."""
        return True

    # Forks and snapshots: optional; a host that has none says so (BackendUnavailable).

    async def fork_workspace(self, path: str, n: int) -> list[str]:
        """``n`` new workspaces, each a copy of workspace ``path`` as it is now.

        Each is a workspace as :meth:`make_workspace` makes them (removed with
        :meth:`remove_workspace`, private, with walls of its own where the host
        has walls) that starts with what ``path`` holds: files, directories,
        symbolic links, modes. From then on they are independent: what is
        written in one (or in ``path``, which keeps working) is seen by no
        other. A host copies on write where it can (then a fork costs the same
        whatever the workspace's size) and says how (the local host's
        ``fork_method``). Raises :class:`~agent_backend.errors.PoolError` while
        ``path`` has a call or file operation in flight (fork between calls),
        :class:`~agent_backend.errors.BackendUnavailable` where the host cannot
        fork.
        """
        raise BackendUnavailable(f"{self.name} cannot fork workspaces", host=self.name)

    async def snapshot_workspace(self, path: str) -> str:
        """A frozen, read-only copy of workspace ``path`` as it is now: its handle, a path on
        the host.

        Nothing written to ``path`` afterwards reaches it, and nothing may write to
        it: it is read (by the host, by :meth:`run_on_snapshot`) until
        :meth:`remove_snapshot`. Raises as :meth:`fork_workspace` does.
        """
        raise BackendUnavailable(f"{self.name} cannot snapshot workspaces", host=self.name)

    async def remove_snapshot(self, snapshot: str) -> None:
        """Remove a snapshot this host made (idempotent); any other path is left alone."""
        raise BackendUnavailable(f"{self.name} cannot snapshot workspaces", host=self.name)

    async def run_on_snapshot(
        self, snapshot: str, command: Command, *, assets: Sequence[str] = ()
    ) -> CommandResult:
        """Run ``command`` (a grader) in a fresh sandbox whose workspace is a writable copy of
        ``snapshot``, with the host paths ``assets`` shown read-only.

        The fresh workspace is its working directory (``command.cwd``, if set,
        is relative to it); its writes never reach the snapshot, and it is
        removed when the command ends. Each asset is shown, read-only, as
        ``../assets/<its base name>`` from the workspace (``$GRADER_ASSETS``
        names that directory): where the host has walls, no other sandbox (the
        agent's included) is ever shown an asset, so an agent can neither read
        nor change its grader's hidden inputs, and a grader sees the workspace
        as it was at the snapshot, whatever the agent did after. The result is
        as :meth:`run`'s.
        """
        raise BackendUnavailable(f"{self.name} cannot run graders on snapshots", host=self.name)


class Backend(AsyncResource):
    """A set of hosts of one kind, opened and closed together (``async with``)."""

    kind: ClassVar[str]

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    @abc.abstractmethod
    async def start(self) -> None:
        """Open what the backend needs (background tasks, first connections)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close everything; idempotent; nothing is left running or open afterwards."""

    def guarantees(self) -> list[str]:
        """The walls in force around what the backend runs, one ``name: guarantee`` line each
        (isolation, filesystem, processes, network, uid, each limit); empty: none declared."""
        return []

    @property
    @abc.abstractmethod
    def hosts(self) -> Sequence[Host]: ...

    capacity_unit: ClassVar[str] = "host"
    """What :meth:`capacity` counts, in words (``no ssh host is up``)."""

    def capacity(self) -> tuple[int, int]:
        """What can take a call now, of how many: its hosts that are up, of all its hosts."""
        return sum(1 for host in self.hosts if host.is_up()), len(self.hosts)

    def pick_host(self) -> Host:
        """The least-loaded host that is up."""
        up = [host for host in self.hosts if host.is_up()]
        if not up:
            raise BackendUnavailable(f"no {self.kind} host is up", backend=self.kind)
        return min(up, key=lambda host: host.calls_in_flight())

    def hosted_tools(self) -> Sequence[Tool]:
        """The tools the backend's workers run themselves (known once it is open); () here."""
        return ()

    async def call_hosted(
        self,
        tool: str,
        arguments: Mapping[str, Any] | str,
        *,
        timeout: float,  # noqa: ASYNC109 - the tool's limit, enforced by the backend
    ) -> HostedResult:
        """Run hosted tool ``tool``: the backend checks ``arguments`` against its schema.

        Raises what the tool's backend raises: model-facing errors for bad
        arguments, :class:`~agent_backend.errors.ToolFailed` when the tool
        raised, :class:`~agent_backend.errors.ToolTimeout` when it was stopped
        at ``timeout``, and backend errors for infrastructure failures.
        """
        raise BackendUnavailable(f"the {self.kind} backend hosts no tools", backend=self.kind)

    @abc.abstractmethod
    def statistics(self) -> Any:
        """A frozen dataclass describing the backend's state now."""
