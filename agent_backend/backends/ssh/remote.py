"""What runs on the remote host: command lines, the kill script, file operations.

Every remote command runs with ``AGENT_BACKEND_CALL=<token>`` in its environment,
inherited by all it starts: the kill script finds a call's processes by that
token (``/proc/*/environ``), which also proves they are ours (no pid reuse can
make it kill a stranger). Workspaces are made and removed by fixed shell
scripts run as ``/bin/sh -c SCRIPT sh ARGS...``: arguments are never spliced
into a script. A workspace is named ``ws.<instance>.XXXXXXXXXX`` after the host's owner id
(the call tokens' ``<instance>.`` prefix), so that a successor maps it to its owner
(:mod:`.owners`).

The file tools' operations run on the remote host with the same code as on
this machine: the source of :mod:`agent_backend.backends.local.files` (the
standard library only), followed by a short entry point, is run with
``python3 -I -S -c SOURCE OP WORKSPACE PATH ...``. So the remote kernel
resolves every path beneath the workspace with ``openat2(2)``, refuses files
with more than one hard link, and the result is read back from stdout (an
``OSError`` as its errno's name and message on stderr, exit status 3).

Under ``isolation = "namespaces"`` a model's command (not the file operations, the workspace
scripts or the kill script: our own code) runs inside a bubblewrap sandbox made for the call
(:func:`sandboxed_command_line`); it keeps the token, and its PID namespace ends with it.

A timed-out, cancelled or stopped call's processes are ended by
:class:`RemoteKills` (TERM, grace, KILL); commands of a lost connection keep
running under sshd (no pty, no SIGHUP) and are killed by token over the next
connection, on spare capacity only.

Remote hosts need a POSIX shell and GNU coreutils/procps (any Linux); the file
tools also need ``python3`` (3.7 or later) on the login PATH and Linux 5.6 or
later (openat2). This module must never splice an argument into a script,
resolve or check a file tool's path itself, signal a process that does not
carry one of our call tokens, or queue for a channel to kill orphans
(queueing would look like demand and open a connection).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.resources
import logging
import os
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
import asyncssh

from agent_backend.backends.local import files as local_files
from agent_backend.backends.ssh.channel import SSHConnection, _CommandChannel
from agent_backend.backends.ssh.pool import ConnectionPool
from agent_backend.dispatch.backend import (
    Command,
    CommandResult,
    DirEntry,
    FileData,
    absolute_path,
    file_error,
)
from agent_backend.errors import BackendUnavailable, clip
from agent_backend.sandbox import SandboxLimits
from agent_backend.sandbox.bwrap import remote_sandbox_argv

__all__ = [
    "CALL_VAR",
    "RUN_PYTHON",
    "CallOwner",
    "RemoteFiles",
    "RemoteKills",
    "RunScript",
    "Script",
    "command_line",
    "kill_script",
    "sandboxed_command_line",
    "script_line",
]

logger = logging.getLogger("agent_backend.backends.ssh")

CALL_VAR = "AGENT_BACKEND_CALL"

# $1: the workspace root, or empty for the login user's own under /tmp. A root that is a
# symbolic link or another user's (made first in a shared /tmp) is refused, never used.
# $2: the owner (the host's instance): ws.<owner>.XXXXXXXXXX, so that a successor finds a dead
# owner's workspaces by name (.owners).
_MAKE_WORKSPACE = (
    'r=${1:-/tmp/agent-backend-$(id -u)}; umask 077 && mkdir -p -- "$r" || exit 1;'
    ' if [ -L "$r" ] || [ ! -O "$r" ]; then'
    ' echo "the workspace root $r is not a directory of this user ($(id -un))" >&2; exit 1; fi;'
    ' cd -- "$r" && pwd -P && d=$(mktemp -d -- "$r/ws.$2.XXXXXXXXXX") && cd -- "$d" && pwd -P'
)
_REMOVE_TREE = 'chmod -R u+rwx -- "$@" 2>/dev/null; rm -rf -- "$@"'

# The file operations: local/files.py's own source, then this entry point (python3 -c: argv[0]
# is "-c"). Kept to what Python 3.7 runs.
_FILES_MAIN = r"""


def _remote_file_operation(argv):
    operation, root, path = argv[1:4]
    out = sys.stdout.buffer
    try:
        if operation == "read":
            data, size = read_file(root, path, int(argv[4]))
            out.write(b"%d\n" % size)
            out.write(data)
        elif operation == "write":
            write_file(root, path, sys.stdin.buffer.read(), argv[4] == "1")
        elif operation == "list":
            for name, kind, size in list_dir(root, path):
                out.write(b"%s %d %s\0" % (kind.encode(), size, os.fsencode(name)))
        else:
            sys.exit(2)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        sys.stderr.write("%s %s\n" % (name, exc.strerror or exc))
        sys.exit(3)
    out.flush()


_remote_file_operation(sys.argv)
"""
_FILES_SOURCE = (
    importlib.resources.files(local_files.__package__ or "agent_backend.backends.local")
    .joinpath("files.py")
    .read_text(encoding="utf-8")
    + _FILES_MAIN
)
RUN_PYTHON = 'p=$1; shift; exec python3 -I -S -c "$p" "$@"'
_FILE_ERROR_EXIT = 3
_NO_PYTHON_EXITS = (126, 127)
_LIST_LIMIT = 16 << 20


class CallOwner:
    """The owner of one call's leases."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __repr__(self) -> str:
        return f"<call {self.token}>"


# -- command lines ----------------------------------------------------------------------------


def _quote_first(word: str) -> str:
    """Always quoted, so the first word is never a reserved word, an alias or an assignment."""
    return "'" + word.replace("'", "'\"'\"'") + "'"


def _prologue(
    base_env: Mapping[str, str],
    token: str,
    env: Mapping[str, str],
    cwd: str | None,
    *,
    stdin: bool,
) -> list[str]:
    """What the login shell does first: the call token, the environment, stdin, cwd.

    Shell builtins only (no extra process, no extra SSH packet): without input,
    stdin is /dev/null rather than an EOF sent over the channel.
    """
    merged = {**base_env, **env}  # names checked by Command and by the pool's config
    exports = "".join(f"{name}={shlex.quote(value)} " for name, value in merged.items())
    parts = [f"export {exports}{CALL_VAR}={token}"]
    if not stdin:
        parts.append("exec </dev/null")
    if cwd is not None:
        parts.append(f"cd -- {shlex.quote(cwd)} || exit 127")
    return parts


def command_line(command: Command, token: str, *, base_env: Mapping[str, str], shell: str) -> str:
    """The line the login shell runs for ``command`` (argv runs directly, a shell line via ``shell -c``)."""
    parts = _prologue(base_env, token, command.env, command.cwd, stdin=command.stdin is not None)
    if command.argv is not None:
        first, *rest = command.argv
        parts.append(" ".join([_quote_first(first), *map(shlex.quote, rest)]))
    else:
        assert command.shell is not None
        parts.append(f"exec {shlex.quote(shell)} -c {shlex.quote(command.shell)}")
    return "; ".join(parts)


def sandboxed_command_line(
    command: Command,
    token: str,
    *,
    base_env: Mapping[str, str],
    shell: str,
    workspace: str | None,
    limits: SandboxLimits,
) -> str:
    """The line for ``command`` under ``isolation = "namespaces"``: the prologue, then the
    fixed prelude shell and bubblewrap (:func:`~agent_backend.sandbox.bwrap.remote_sandbox_argv`),
    every word quoted. The token stays in the environment (bubblewrap keeps it), so the kill
    script finds the sandbox's processes as it finds any call's."""
    parts = _prologue(base_env, token, command.env, None, stdin=command.stdin is not None)
    if command.argv is not None:
        inner = list(command.argv)
    else:
        assert command.shell is not None
        inner = [shell, "-c", command.shell]
    argv = remote_sandbox_argv(inner, workspace=workspace, cwd=command.cwd, limits=limits)
    parts.append("exec " + " ".join(map(shlex.quote, argv)))
    return "; ".join(parts)


def script_line(
    script: str, args: Sequence[str], token: str, *, base_env: Mapping[str, str], stdin: bool
) -> str:
    parts = _prologue(base_env, token, {}, None, stdin=stdin)
    parts.append(f"exec /bin/sh -c {shlex.quote(script)} sh {' '.join(map(shlex.quote, args))}")
    return "; ".join(parts)


def kill_script(tokens: Sequence[str], signame: str) -> str:
    """Signal every process whose environment holds one of the call tokens.

    Tokens are matched as whole environment entries (``grep -z -x``), so only
    processes descending from our calls are signalled. A process group is
    signalled too when its leader is ours: the token is in the leader's
    environment, or in its command line (the login shell that ran the call).
    Patterns are built from shell variables, so that this script's own
    command line never matches them.
    """
    env_patterns = " ".join(f'-e "$v={token}"' for token in tokens)
    line_patterns = " ".join(f'-e "$v={token};"' for token in tokens)
    return (
        f"v={CALL_VAR}; "
        f"pids=$(grep -lzxF {env_patterns} /proc/[0-9]*/environ 2>/dev/null"
        " | sed -n 's|^/proc/\\([0-9]*\\)/environ$|\\1|p'); "
        '[ -n "$pids" ] || exit 0; '
        'for g in $(ps -o pgid= -p "$(echo $pids | tr " " ,)" 2>/dev/null | sort -u); do '
        '[ "$g" -gt 1 ] && [ "$g" != "$$" ] || continue; '
        f"if grep -qzxF {env_patterns} /proc/$g/environ 2>/dev/null"
        f" || grep -qaF {line_patterns} /proc/$g/cmdline 2>/dev/null; "
        f'then kill -s {signame} -- "-$g" 2>/dev/null; fi; done; '
        f"kill -s {signame} $pids 2>/dev/null; exit 0"
    )


# -- file operations --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Script:
    """One file operation: a fixed script and its arguments."""

    script: str
    args: tuple[str, ...]
    what: str
    """What it does, for error messages ("reading a file")."""
    stdin: bytes | None = None
    limit: int = 1 << 20
    """Bytes of stdout kept."""


RunScript = Callable[[Script], Awaitable[CommandResult]]
"""Runs a script on the host (a timeout raises ToolTimeout)."""


class RemoteFiles:
    """The host's file operations, each one script run by ``run``."""

    def __init__(self, run: RunScript, host: str) -> None:
        self._run = run
        self._host = host

    def _failed(self, result: CommandResult, what: str) -> str:
        detail = clip(result.stderr.text().strip(), 300) or f"exit status {result.exit_status}"
        return f"{what} failed on {self._host}: {detail}"

    async def make_workspace(self, root: str | None, owner: str) -> str:
        """A new mode-0700 directory ``ws.<owner>.*`` under ``root`` (None: the login user's
        own root under /tmp); its resolved path."""
        result = await self._run(Script(_MAKE_WORKSPACE, (root or "", owner), "making a workspace"))
        lines = result.stdout.data.decode("utf-8", "surrogateescape").splitlines()
        if result.exit_status != 0 or len(lines) != 2:
            raise BackendUnavailable(
                f"cannot make a workspace under {root or 'the user root'} on {self._host}:"
                f" {clip(result.stderr.text().strip(), 300)}",
                backend="ssh",
                host=self._host,
            )
        return lines[1]

    async def remove_tree(self, path: str) -> None:
        result = await self._run(Script(_REMOVE_TREE, (path,), "removing a workspace"))
        if result.exit_status != 0:
            raise OSError(errno.EIO, self._failed(result, "removing a workspace"), path)

    async def _operation(
        self,
        what: str,
        operation: str,
        workspace: str,
        path: str,
        *extra: str,
        stdin: bytes | None = None,
        limit: int = 1 << 20,
    ) -> CommandResult:
        """Run one of local/files.py's operations on the host, beneath ``workspace``."""
        args = (_FILES_SOURCE, operation, absolute_path(workspace), path, *extra)
        result = await self._run(Script(RUN_PYTHON, args, what, stdin=stdin, limit=limit))
        if result.exit_status == 0:
            return result
        if result.exit_status == _FILE_ERROR_EXIT:
            name, _, message = result.stderr.text().strip().partition(" ")
            code = getattr(errno, name, None) if name.startswith("E") else None
            if isinstance(code, int):
                error = OSError(code, message or os.strerror(code), path)
                raise file_error(error, path, backend="ssh", host=self._host) from None
        if result.exit_status in _NO_PYTHON_EXITS:
            raise BackendUnavailable(
                f"the file tools need python3 (3.7 or later) on the PATH of {self._host}:"
                f" {clip(result.stderr.text().strip(), 300)}",
                backend="ssh",
                host=self._host,
            )
        raise OSError(errno.EIO, self._failed(result, what), path)

    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        result = await self._operation(
            "reading a file", "read", workspace, path, str(limit), limit=limit + 64
        )
        size_line, _, data = result.stdout.data.partition(b"\n")
        if result.stdout.truncated or not size_line.isdigit():
            raise OSError(errno.EIO, f"unexpected reply reading a file on {self._host}", path)
        return FileData(data, int(size_line))

    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        await self._operation(
            "writing a file", "write", workspace, path, "1" if make_parents else "0", stdin=data
        )

    async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
        result = await self._operation(
            "listing a directory", "list", workspace, path, limit=_LIST_LIMIT
        )
        if result.stdout.truncated:
            raise OSError(errno.EFBIG, f"directory listing larger than {_LIST_LIMIT} bytes", path)
        entries: list[DirEntry] = []
        for record in result.stdout.data.split(b"\0"):
            if not record:
                continue
            kind, size, name = record.decode("utf-8", "surrogateescape").split(" ", 2)
            entries.append(DirEntry.of(name, kind, int(size)))
        entries.sort(key=lambda entry: entry.name)
        return entries


# -- remote kills and orphans -----------------------------------------------------------------

Maintenance = Callable[[SSHConnection, str, float], Awaitable[_CommandChannel | None]]
"""Run a short command on a connection outside the lease table, within a bound; None: failed."""

# Bounds of the shielded kill steps (seconds).
_KILL_WAIT = 2.0
_SIGNAL_CHANNEL_TIMEOUT = 2.0


class RemoteKills:
    """Ends the remote processes of a host's calls: on timeout, cancellation and stop, and
    the orphans that calls lost with their connection left running under sshd."""

    def __init__(
        self,
        pool: ConnectionPool[SSHConnection],
        maintenance: Maintenance,
        *,
        host: str,
        kill_grace: float,
        orphan_timeout: float,
    ) -> None:
        self._pool = pool
        self._maintenance = maintenance
        self._host = host
        self._kill_grace = kill_grace
        self._orphan_timeout = orphan_timeout
        self.orphans: list[str] = []
        """Tokens of calls whose processes may still run remotely."""
        self.count = 0
        """Calls whose remote processes were ended (timeout, cancellation, stop)."""
        self._killer = False

    async def terminate(
        self,
        connection: SSHConnection,
        channel: asyncssh.SSHClientChannel[bytes],
        protocol: _CommandChannel,
        token: str,
    ) -> None:
        """End every remote process of the call: TERM, grace, KILL; then close the channel.

        Each signal goes both as an SSH "signal" request (sshd honours it for
        non-root logins, to the session's process group) and by ``kill`` on a
        second channel to every process carrying the call's token and to their
        process groups (always works, and reaches children that left the group).
        The KILL sweep runs even when TERM ended the command, for anything that
        ignored TERM in the background. Bounded; the caller shields it.
        """
        self.count += 1
        with anyio.move_on_after(self._kill_grace + 3 * _KILL_WAIT):
            for signame, wait in (("TERM", self._kill_grace), ("KILL", _KILL_WAIT)):
                if connection.lost:
                    break
                if not protocol.closed.is_set():
                    with contextlib.suppress(OSError, asyncssh.Error, ValueError):
                        channel.send_signal(signame)
                await self._signal(connection, [token], signame)
                with anyio.move_on_after(wait):
                    await protocol.closed.wait()
        if connection.lost or not protocol.closed.is_set():
            self.note_orphan(token)
        with contextlib.suppress(OSError, asyncssh.Error):
            channel.close()

    async def _signal(self, preferred: SSHConnection, tokens: Sequence[str], signame: str) -> None:
        """Run the kill script on ``preferred``, else on another live connection of the host."""
        line = kill_script(tokens, signame)
        others = [c for c in self._pool.table.resources() if c is not preferred]
        for connection in (preferred, *others):
            if connection.lost:
                continue
            channel = await self._maintenance(connection, line, _SIGNAL_CHANNEL_TIMEOUT)
            if channel is not None:
                return

    def note_orphan(self, token: str) -> None:
        self.orphans.append(token)
        self.schedule_orphan_cleanup()

    def schedule_orphan_cleanup(self) -> None:
        if self.orphans and not self._killer and self._pool.is_open():
            self._killer = True
            self._pool.background.spawn(self._kill_orphans, "orphan cleanup")

    async def _kill_orphans(self) -> None:
        """Kill the processes of calls lost with their connection, on spare capacity only.

        Never queues (queueing would look like demand and open a connection): it
        takes a free slot when nobody waits, else tries again shortly.
        """
        pool = self._pool
        try:
            owner = CallOwner("orphan-cleanup")
            give_up = time.monotonic() + self._orphan_timeout
            # With no connection left, stop: the next one adopted schedules this again.
            while self.orphans and pool.is_open() and pool.table and time.monotonic() < give_up:
                lease = pool.try_acquire(owner)
                if lease is None:
                    await anyio.sleep(0.05)
                    continue
                orphans, self.orphans = self.orphans, []
                script = kill_script(orphans, "KILL")
                try:
                    channel = await self._maintenance(lease.resource, script, self._orphan_timeout)
                finally:
                    pool.release(lease)
                if channel is None or channel.exit_status != 0:
                    self.orphans.extend(orphans)
                    logger.warning("%s: could not kill orphaned remote commands", self._host)
                return
        finally:
            self._killer = False
