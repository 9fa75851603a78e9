"""What runs on the remote host: command lines, the kill script, file operations as shell scripts.

Every remote command runs with ``AGENT_BACKEND_CALL=<token>`` in its environment,
inherited by all it starts: the kill script finds a call's processes by that
token (``/proc/*/environ``), which also proves they are ours (no pid reuse can
make it kill a stranger). File operations are fixed scripts run as
``/bin/sh -c SCRIPT sh ARGS...``: arguments are never spliced into a script.

A timed-out, cancelled or stopped call's processes are ended by
:class:`RemoteKills` (TERM, grace, KILL); commands of a lost connection keep
running under sshd (no pty, no SIGHUP) and are killed by token over the next
connection, on spare capacity only.

Remote hosts need a POSIX shell and GNU coreutils/findutils/procps (any Linux).
This module must never splice an argument into a script, signal a process that
does not carry one of our call tokens, or queue for a channel to kill orphans
(queueing would look like demand and open a connection).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Literal

import anyio
import asyncssh

from agent_backend.backends.ssh.channel import SSHConnection, _CommandChannel
from agent_backend.backends.ssh.pool import ConnectionPool
from agent_backend.dispatch.backend import (
    Command,
    CommandResult,
    DirEntry,
    FileData,
    absolute_path,
)
from agent_backend.errors import BackendUnavailable, clip

__all__ = [
    "CALL_VAR",
    "CallOwner",
    "RemoteFiles",
    "RemoteKills",
    "RunScript",
    "Script",
    "command_line",
    "kill_script",
    "script_line",
]

logger = logging.getLogger("agent_backend.backends.ssh")

CALL_VAR = "AGENT_BACKEND_CALL"

_FILE_ERRNOS = {
    2: errno.ENOENT,
    3: errno.EISDIR,
    4: errno.ENOTDIR,
    5: errno.EACCES,
    6: errno.EINVAL,
}
_KINDS: dict[str, Literal["file", "dir", "symlink", "other"]] = {
    "f": "file",
    "d": "dir",
    "l": "symlink",
}

# Exit codes 2-6 of these scripts map to the errnos above.
_MAKE_WORKSPACE = (
    'umask 077 && mkdir -p -- "$1" && cd -- "$1" && pwd -P'
    ' && d=$(mktemp -d -- "$1/ws.XXXXXXXXXX") && cd -- "$d" && pwd -P'
)
_REMOVE_TREE = 'chmod -R u+rwx -- "$@" 2>/dev/null; rm -rf -- "$@"'
_REALPATH = 'exec realpath -m -- "$1"'
_READ_FILE = (
    'f=$1; [ -e "$f" ] || exit 2; [ -d "$f" ] && exit 3; [ -r "$f" ] || exit 5;'
    ' [ -f "$f" ] || exit 6; s=$(stat -L -c %s -- "$f") || exit 1;'
    ' printf "%s\\n" "$s"; exec head -c "$2" -- "$f"'
)
_WRITE_FILE = (
    'f=$1; case $f in */*) d=${f%/*};; *) d=.;; esac; [ -n "$d" ] || d=/;'
    ' [ -d "$d" ] || exit 2; [ -d "$f" ] && exit 3; [ -w "$d" ] || exit 5;'
    ' if [ -e "$f" ] && [ ! -f "$f" ]; then exit 6; fi;'
    ' t=$(mktemp -- "$f.XXXXXXXX") || exit 5;'
    ' if cat > "$t" && chmod 644 -- "$t" && mv -f -- "$t" "$f"; then exit 0; fi;'
    ' rm -f -- "$t"; exit 1'
)
_LIST_DIR = (
    '[ -e "$1" ] || exit 2; [ -d "$1" ] || exit 4; { [ -r "$1" ] && [ -x "$1" ]; } || exit 5;'
    ' exec find "$1" -mindepth 1 -maxdepth 1 -printf "%y %s %f\\0"'
)
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

    def _error(self, result: CommandResult, path: str, what: str) -> OSError:
        code = _FILE_ERRNOS.get(result.exit_status or 0)
        if code is not None:
            return OSError(code, os.strerror(code), path)
        detail = clip(result.stderr.text().strip(), 300) or f"exit status {result.exit_status}"
        return OSError(errno.EIO, f"{what} failed on {self._host}: {detail}", path)

    async def make_workspace(self, root: str) -> str:
        """A new mode-0700 directory under ``root``; its resolved path."""
        result = await self._run(Script(_MAKE_WORKSPACE, (root,), "making a workspace"))
        lines = result.stdout.data.decode("utf-8", "surrogateescape").splitlines()
        if result.exit_status != 0 or len(lines) != 2:
            raise BackendUnavailable(
                f"cannot make a workspace under {root} on {self._host}:"
                f" {clip(result.stderr.text().strip(), 300)}",
                backend="ssh",
                host=self._host,
            )
        return lines[1]

    async def remove_tree(self, path: str) -> None:
        result = await self._run(Script(_REMOVE_TREE, (path,), "removing a workspace"))
        if result.exit_status != 0:
            raise self._error(result, path, "removing a workspace")

    async def realpath(self, path: str) -> str:
        result = await self._run(Script(_REALPATH, (absolute_path(path),), "realpath"))
        if result.exit_status != 0:
            raise self._error(result, path, "realpath")
        return result.stdout.data.decode("utf-8", "surrogateescape").removesuffix("\n")

    async def read_file(self, path: str, *, limit: int) -> FileData:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        result = await self._run(
            Script(
                _READ_FILE, (absolute_path(path), str(limit)), "reading a file", limit=limit + 64
            )
        )
        if result.exit_status != 0:
            raise self._error(result, path, "reading a file")
        size_line, _, data = result.stdout.data.partition(b"\n")
        if result.stdout.truncated or not size_line.isdigit():
            raise OSError(errno.EIO, f"unexpected reply reading a file on {self._host}", path)
        return FileData(data, int(size_line))

    async def write_file(self, path: str, data: bytes) -> None:
        result = await self._run(
            Script(_WRITE_FILE, (absolute_path(path),), "writing a file", stdin=data)
        )
        if result.exit_status != 0:
            raise self._error(result, path, "writing a file")

    async def list_dir(self, path: str) -> list[DirEntry]:
        result = await self._run(
            Script(_LIST_DIR, (absolute_path(path),), "listing a directory", limit=_LIST_LIMIT)
        )
        if result.exit_status != 0:
            raise self._error(result, path, "listing a directory")
        if result.stdout.truncated:
            raise OSError(errno.EFBIG, f"directory listing larger than {_LIST_LIMIT} bytes", path)
        entries: list[DirEntry] = []
        for record in result.stdout.data.split(b"\0"):
            if not record:
                continue
            kind, size, name = record.decode("utf-8", "surrogateescape").split(" ", 2)
            resolved = _KINDS.get(kind, "other")
            entries.append(DirEntry(name, resolved, int(size) if resolved == "file" else 0))
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
