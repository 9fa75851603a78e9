"""Owner records on an SSH host, so that a successor removes what a SIGKILLed daemon left.

Each :class:`~.host.SSHHost` has a random owner id (its *instance*, 8 hex digits): every call
token is ``<instance>.<n>`` (``AGENT_BACKEND_CALL`` in every remote process's environment),
and every workspace it makes is ``<root>/ws.<instance>.XXXXXXXXXX``. While the host's pool is
open, ``<root>/owners/<instance>.lock`` on the host is held with an exclusive ``flock`` by a
*holder*: a small ``python3`` process (:data:`OWNER_SOURCE`) started over SSH that reads its
stdin until EOF. However the daemon dies, its TCP connection ends, sshd closes the channel, the
holder reads EOF and exits, and the kernel drops the lock; a live owner's lock is never free.

Before a host makes its first workspace or runs its first command, it starts its holder, which
takes the lock, then sweeps once: every other ``owners/*.lock`` it can lock with
``LOCK_EX|LOCK_NB`` is a dead owner's, whose processes (this user's, carrying its token
prefix) are killed with SIGKILL, whose workspaces are removed, and whose lock file is removed
last (a sweep cut short is redone by the next successor). The holder prints ``locked``, then
what it removed; one process, one channel, one round trip.

The holder runs on a connection of its own (:class:`OwnerLock`), outside the pool's lease
table: the reaper closes only connections that hold no lease, so a holder on a pooled
connection would either pin it (a lease that is no call) or lose the lock when the connection
is reaped while this owner still has workspaces on the host. That connection carries the
holder's one channel and nothing else; a pooled connection carries calls only, so its channels
stay what ``max_channels_per_connection`` says. When that connection is lost, the lock is
taken again with the same instance on a new one (with backoff; after the pool's own reconnect
when the host was marked down). A clean close tells the holder to remove its lock file (only
when nothing of this owner is left on the host), then ends it.

This module must never lock, kill or remove anything of a live owner (one whose lock is not
free), follow a symbolic link out of the workspace root, or keep the host from being used
when the lock or the sweep fails (a WARNING says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping

import anyio
import asyncssh

from agent_backend.backends._errors import describe
from agent_backend.backends.ssh import remote
from agent_backend.backends.ssh.channel import (
    SSHConnection,
    SSHConnector,
    _CommandChannel,
    open_channel,
    wait_closed,
)
from agent_backend.backends.ssh.pool import ConnectionPool
from agent_backend.backoff import backoff_delay
from agent_backend.errors import AgentBackendError, clip

__all__ = ["OWNER_SOURCE", "OwnerLock", "lock_path"]

logger = logging.getLogger("agent_backend.backends.ssh")

# What the holder prints once it holds the lock; what the daemon writes before EOF on a clean
# close, so that the holder removes its lock file (an EOF alone: the connection ended).
_LOCKED = b"locked\n"
_RELEASE = b"release\n"
_CLOSE_WAIT = 2.0  # seconds for the holder to end after EOF on a clean close

# The workspace root and its owners/ directory, as _MAKE_WORKSPACE checks the root: made 0700
# if missing; a symbolic link or another user's is refused (exit status 1), never used.
_ROOT = r"""
import errno, fcntl, json, os, re, signal, stat, subprocess, sys


def _own_dir(path, what):
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        sys.stderr.write("%s %s is not a directory of this user\n" % (what, path))
        sys.exit(1)
    return path


def _owners(arg):
    os.umask(0o077)
    root = arg or "/tmp/agent-backend-%d" % os.getuid()
    os.makedirs(os.path.dirname(root.rstrip("/")) or "/", exist_ok=True)
    owners = os.path.join(root, "owners")
    return _own_dir(root, "the workspace root"), _own_dir(owners, "the owner records directory")


def _still_linked(fd, path):
    # A sweeper may remove a lock file between our open and our lock: then ours is no record.
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _open_lock(path):
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
"""

OWNER_SOURCE = (
    _ROOT
    + r"""

def _has_token(pid, prefix):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return False
    return any(entry.startswith(prefix) for entry in entries)


def _kill_owner(prefix):
    uid, me = os.geteuid(), os.getpid()
    killed = set()
    for _ in range(50):
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                if os.stat("/proc/" + name).st_uid != uid:
                    continue
            except OSError:
                continue
            if _has_token(int(name), prefix):
                found.append(int(name))
        if set(found) <= killed:
            break
        for pid in found:
            try:
                group = os.getpgid(pid)
                if group > 1 and group != os.getpgid(0) and _has_token(group, prefix):
                    os.killpg(group, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
    return len(killed)


def _remove_workspaces(root, dead):
    removed = 0
    for name in sorted(os.listdir(root)):
        if not name.startswith("ws.%s." % dead):
            continue
        path = os.path.join(root, name)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            # As _REMOVE_TREE: chmod -R and rm -rf follow no symbolic link.
            subprocess.call(["chmod", "-R", "u+rwx", "--", path], stderr=subprocess.DEVNULL)
            subprocess.call(["rm", "-rf", "--", path])
        else:
            os.unlink(path)
        if os.path.lexists(path):
            raise OSError(errno.ENOTEMPTY, "could not remove %s" % path)
        removed += 1
    return removed


def _sweep(root, owners, own, call_var):
    done = {"owners": 0, "workspaces": 0, "processes": 0, "errors": []}
    for name in sorted(os.listdir(owners)):
        dead = name[: -len(".lock")]
        if not name.endswith(".lock") or dead == own or not re.fullmatch(r"[0-9a-f]{1,64}", dead):
            continue
        path = os.path.join(owners, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # removed meanwhile (another successor), or not a plain file
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live owner's: never touched
            if not _still_linked(fd, path):
                continue
            prefix = ("%s=%s." % (call_var, dead)).encode()
            done["processes"] += _kill_owner(prefix)
            done["workspaces"] += _remove_workspaces(root, dead)
            os.unlink(path)  # last: a sweep cut short is redone by the next successor
            done["owners"] += 1
        except OSError as exc:
            done["errors"].append("%s: %s" % (dead, exc))
        finally:
            os.close(fd)
    return done


def _hold(argv):
    root, owners = _owners(argv[1])
    path = os.path.join(owners, argv[2] + ".lock")
    while True:
        fd = _open_lock(path)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _still_linked(fd, path):
            break
        os.close(fd)
    out = sys.stdout.buffer
    out.write(b"locked\n")
    out.flush()
    if argv[4] == "sweep":
        try:
            done = _sweep(root, owners, argv[2], argv[3])
        except Exception as exc:  # the lock is held all the same
            done = {"owners": 0, "workspaces": 0, "processes": 0, "errors": [repr(exc)]}
        out.write(json.dumps(done).encode() + b"\n")
        out.flush()
    release = False
    for line in sys.stdin.buffer:
        if line.strip() == b"release":
            release = True
    if release and _still_linked(fd, path):
        os.unlink(path)


_hold(sys.argv)
"""
)
"""The holder: ``python3 -c OWNER_SOURCE ROOT INSTANCE CALL_VAR SWEEP`` (ROOT empty: the
user's default). It holds ``owners/INSTANCE.lock`` and prints ``locked``; with SWEEP =
``sweep`` it then removes what dead owners left and prints one JSON object (``owners``,
``workspaces``, ``processes`` removed, and ``errors``). Then it reads stdin until EOF and
exits; after a ``release`` line it removes its lock file first."""


def lock_path(root: str, instance: str) -> str:
    """The lock file of ``instance`` under the workspace root ``root`` (for tests)."""
    return f"{root.rstrip('/')}/owners/{instance}.lock"


class _Holder(_CommandChannel):
    """The holder's channel: its output, when it said it holds the lock, and its sweep's
    report (``sweeps``: it was asked to sweep)."""

    def __init__(self, *, sweeps: bool) -> None:
        super().__init__(64 << 10, 4096)
        self.sweeps = sweeps
        self.locked = asyncio.Event()
        self.swept = asyncio.Event()
        self.report = b""

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        super().data_received(data, datatype)
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            return
        lines = self.stdout.result().data.split(b"\n")
        if lines[0] == _LOCKED.rstrip() and len(lines) > 1:
            self.locked.set()
            if len(lines) > 2:
                self.report = lines[1]
                self.swept.set()


class OwnerLock:
    """Holds this owner's lock on one host while the pool is open; sweeps once.

    Driven by its host: :meth:`take` before the first workspace or command, :meth:`keep` in
    the pool's background work from then on, :meth:`aclose` when the host shuts down.
    """

    def __init__(
        self,
        connector: SSHConnector,
        pool: ConnectionPool[SSHConnection],
        *,
        host: str,
        instance: str,
        root: str | None,
        base_env: Mapping[str, str],
        open_timeout: float,
        retry_backoff: float,
        retry_ceiling: float,
    ) -> None:
        self._connector = connector  # the pool's; a sibling with counters of its own is used
        self._own_connector: SSHConnector | None = None
        self._pool = pool
        self._host = host
        self._instance = instance
        self._root = root or ""
        self._base_env = base_env
        self._open_timeout = open_timeout
        self._backoff = (retry_backoff, retry_ceiling)
        self._connection: SSHConnection | None = None
        self._channel: asyncssh.SSHClientChannel[bytes] | None = None
        self._holder: _Holder | None = None
        self._added = anyio.Event()
        self._keeping = False
        self._closed = False
        self.takes = 0
        """Holders started (the first, and each after a lost connection)."""

    # -- predicates ---------------------------------------------------------------------------

    def is_held(self) -> bool:
        """The holder said it holds the lock, and its channel is still open."""
        holder = self._holder
        return holder is not None and holder.locked.is_set() and not holder.closed.is_set()

    def refused(self) -> bool:
        """The holder ran and exited with a status: the host refuses it (no retry helps)."""
        holder = self._holder
        return holder is not None and holder.exit_status is not None and holder.exit_status != 0

    def __repr__(self) -> str:
        state = "held" if self.is_held() else ("closed" if self._closed else "not held")
        return f"<OwnerLock {self._instance} on {self._host}: {state}>"

    # -- taking and keeping -------------------------------------------------------------------

    async def take(self, *, timeout: float) -> None:  # noqa: ASYNC109 - a bound, not an error
        """Start the holder, which takes the lock and sweeps; wait for both, within
        ``timeout``. Logs what the sweep removed (INFO), and why the lock or the sweep
        failed (WARNING); raises nothing but cancellation."""
        lock_failure: str | None = None
        with anyio.move_on_after(timeout) as bound:
            try:
                holder = self._holder
                if holder is None or holder.closed.is_set():  # else one started before: wait
                    lock_failure = await self._start(sweep=True)
                holder = self._holder
                if lock_failure is None and holder is not None:
                    await _first_of(holder.swept if holder.sweeps else holder.locked, holder.closed)
                    if not holder.locked.is_set():
                        lock_failure = self._ended_why(holder)
            except Exception as exc:  # a bug must not make the host unusable
                logger.exception("%s: taking the owner lock failed", self._host)
                lock_failure = describe(exc)
        if bound.cancelled_caught and lock_failure is None and not self.is_held():
            lock_failure = f"the lock was not taken within {timeout:g} s"
        if lock_failure is not None:
            logger.warning(
                "%s: could not take this owner's lock on the host (%s); what it leaves there"
                " after a crash is not removed by a successor",
                self._host,
                lock_failure,
            )
        holder = self._holder
        if holder is None or not holder.sweeps:
            sweep_failure: str | None = "no holder"
        elif holder.swept.is_set():
            sweep_failure = self._report(holder.report)
        elif bound.cancelled_caught:
            sweep_failure = f"it did not finish within {timeout:g} s"
        else:
            sweep_failure = lock_failure or self._ended_why(holder)
        if sweep_failure is not None:
            logger.warning(
                "%s: could not remove what dead owners left on the host: %s",
                self._host,
                sweep_failure,
            )

    def connection_added(self) -> None:
        """The pool adopted a connection: a host marked down may be up again."""
        self._added.set()

    async def keep(self) -> None:
        """Run in the pool's background work: when the holder's connection is lost, take the
        lock again with the same instance on a new connection (the old holder, if sshd has
        not noticed yet, holds it meanwhile; the new one waits for it). No second sweep."""
        if self._keeping:
            return
        self._keeping = True
        try:
            await self._keep()
        except Exception:  # a bug must not take the task group (and the pool) down
            logger.exception("%s: keeping the owner lock failed", self._host)
        finally:
            self._keeping = False

    async def _keep(self) -> None:
        while not self._closed and self._pool.is_open():
            holder = self._holder
            if holder is not None:
                await holder.closed.wait()
                if self._closed or not self._pool.is_open() or self.refused():
                    return
                logger.info(
                    "%s: this owner's lock ended with its connection; taking it again",
                    self._host,
                )
            await self._restart()

    async def _restart(self) -> None:
        failures = 0
        while not self._closed and self._pool.is_open():
            if self._pool.down:  # probed by the pool; retried when it adopts a connection
                self._added = anyio.Event()
                await self._added.wait()
                continue
            failure = await self._start(sweep=False)
            if failure is None:
                return
            failures += 1
            logger.debug("%s: taking the owner lock again failed: %s", self._host, failure)
            delay = backoff_delay(failures, first=self._backoff[0], ceiling=self._backoff[1])
            with anyio.move_on_after(delay):
                await self._pool.closing.wait()

    async def _start(self, *, sweep: bool) -> str | None:
        """A connection (the one open, else a new one) and a holder on it; why not if not."""
        connection = self._connection
        if connection is None or connection.has_died():
            if connection is not None:
                self._connection = None
                connection.conn.abort()
            if self._own_connector is None:
                self._own_connector = self._connector.sibling()
            try:
                connection = await self._own_connector.connect()
            except AgentBackendError as exc:
                return exc.message
            if self._closed:  # closed during the handshake: never keep it
                connection.conn.abort()
                return "closed"
            self._connection = connection
        line = remote.script_line(
            remote.RUN_PYTHON,
            (OWNER_SOURCE, self._root, self._instance, remote.CALL_VAR, "sweep" if sweep else ""),
            f"{self._instance}.owner",
            base_env=self._base_env,
            stdin=True,
        )
        holder = _Holder(sweeps=sweep)
        try:
            channel, _ = await open_channel(
                connection,
                line,
                (0, 0),
                host=self._host,
                open_timeout=self._open_timeout,
                protocol=holder,
            )
        except (AgentBackendError, asyncssh.ChannelOpenError) as exc:
            return describe(exc)
        self._channel, self._holder = channel, holder
        self.takes += 1
        if self._closed:
            await self._end(release=False)
        return None

    def _ended_why(self, holder: _Holder) -> str:
        detail = clip(holder.stderr.result().text().strip(), 300)
        if holder.exit_status is not None:
            return f"exit status {holder.exit_status}" + (f": {detail}" if detail else "")
        if holder.exit_signal is not None:
            return f"killed by {holder.exit_signal}"
        return describe(holder.error) if holder.error is not None else "connection closed"

    def _report(self, report: bytes) -> str | None:
        """Log what the sweep removed; why it failed if it did."""
        try:
            done = json.loads(report)
            counts = (int(done["owners"]), int(done["workspaces"]), int(done["processes"]))
            errors = [str(error) for error in done["errors"]]
        except (ValueError, KeyError, TypeError):
            return f"unexpected reply: {clip(report.decode('utf-8', 'replace'), 300)}"
        if any(counts):
            logger.info(
                "%s: removed what %d dead owner(s) left: %d workspace(s), %d process(es)",
                self._host,
                *counts,
            )
        return clip("; ".join(errors), 600) if errors else None

    # -- closing ------------------------------------------------------------------------------

    async def aclose(self, *, release: bool) -> None:
        """End the holder and its connection (bounded; the caller shields it); idempotent.
        ``release``: nothing of this owner is left on the host, so its lock file goes too."""
        if self._closed:
            return
        self._closed = True
        self._added.set()
        await self._end(release=release)

    async def _end(self, *, release: bool) -> None:
        channel, holder, connection = self._channel, self._holder, self._connection
        self._connection = None
        if channel is not None and holder is not None and not holder.closed.is_set():
            with contextlib.suppress(OSError, asyncssh.Error):
                if release and holder.locked.is_set():
                    channel.write(_RELEASE)
                channel.write_eof()
            with anyio.move_on_after(_CLOSE_WAIT):
                await holder.closed.wait()
            with contextlib.suppress(OSError, asyncssh.Error):
                channel.close()
        if connection is not None:
            connection.conn.close()
            await wait_closed(connection)


async def _first_of(*events: asyncio.Event) -> None:
    """Return once one of ``events`` is set."""
    async with anyio.create_task_group() as tg:

        async def wait(event: asyncio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)
