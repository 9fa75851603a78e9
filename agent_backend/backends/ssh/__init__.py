"""The SSH backend: commands and files on remote hosts, over pooled asyncssh connections.

Per host (:class:`SSHHost`) a pool of connections, each carrying at most
``max_channels_per_connection`` concurrent channels (one channel per call).
The pool's bookkeeping is a :class:`~agent_backend.dispatch.leases.LeaseTable`
(capacity = channels per connection): every call holds a lease on the
connection its channel runs on (the busiest connection that has room: packing
measured ~9% more calls/s than spreading at 8 callers, and lets surplus
connections go idle and be reaped), and the reaper closes only connections the
table hands back, which by construction hold no lease, have been idle past
``idle_ttl`` since their *last lease ended*, and are still the very object
registered. Every state change is synchronous (one event loop, no awaits in
between); connection I/O happens after, shielded from cancellation.

::

    callers ──► _lease() ──► LeaseTable.acquire()  ── lease ──► channel ──► remote command
                   │ none free                                     │ timeout / cancel / stop:
                   ▼                                                ▼ TERM, grace, KILL (sshd
              FIFO waiters ◄── _assign() on every release,          "signal" + kill(1) of every
                   │            connection added or lost            process with the call's
                   │                                                token), close the channel
                   ▼
        demand > connecting x capacity and open + connecting < max_connections
                   │
                   ▼
              connector task ──► ramp (≤ max_concurrent_handshakes, handshake_interval,
                                 backoff after failures) ──► asyncssh.connect(host, port, user)
                   │ ok: LeaseTable.add()             │ failed, nothing open: waiters get
                   ▼                                  ▼ BackendUnavailable; after
              waiters served                            down_after_failures: host down, probed

Reconnects are single-flight by accounting: callers that find a connection dead
(it leaves the table once, in ``connection_lost``) queue as waiters, and
connectors are started only for demand that connections already being opened
will not cover. A re-created connection is always to the configured host, port
and user (``~/.ssh/config`` is never read). Stopping (:meth:`SSHBackend.aclose`)
first marks every host closing (no connector starts, a connector that finishes
closes its connection instead of adding it), ends the calls in flight (their
remote processes are killed), cancels background work, then closes every
connection, once. The one connection it may still open is a single short one
to remove workspaces and kill orphans when no pooled connection is left.

Every remote command runs with ``AGENT_BACKEND_CALL=<token>`` in its environment,
inherited by all it starts: the kill path finds a call's processes by that token
(``/proc/*/environ``), which also proves they are ours. Commands of a lost
connection keep running under sshd (no pty, no SIGHUP); they are killed by
token over the next connection.

Remote hosts need a POSIX shell and GNU coreutils/findutils/procps (any Linux).

This module must never: close a connection that holds a lease; start a
pool connection after stop began; resurrect a closed connection; connect anywhere
but the configured host, port and user; skip host-key verification unless
``insecure_skip_host_key_check`` says so; let an asyncssh exception reach a
caller (they are mapped to :mod:`agent_backend.errors`); or leave a remote
process of a timed-out or cancelled call running.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import getpass
import itertools
import logging
import os
import posixpath
import random
import secrets
import shlex
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import asyncssh

from agent_backend.backends._errors import describe, map_exceptions
from agent_backend.backends.ssh.config import (
    ENV_NAME,
    SSHHostConfig,
    SSHHostSettings,
    SSHHostStats,
    SSHPoolConfig,
    SSHStatistics,
)
from agent_backend.backoff import backoff_delay
from agent_backend.dispatch.backend import (
    Backend,
    Command,
    CommandResult,
    DirEntry,
    FileData,
    Host,
    Output,
)
from agent_backend.dispatch.leases import Lease, LeaseTable
from agent_backend.dispatch.output import OutputBuffer
from agent_backend.errors import (
    BackendUnavailable,
    ConfigError,
    PoolClosed,
    PoolError,
    ToolTimeout,
    WorkerLost,
    clip,
)

__all__ = [
    "SSHBackend",
    "SSHHost",
    "SSHHostConfig",
    "SSHHostSettings",
    "SSHHostStats",
    "SSHPoolConfig",
    "SSHStatistics",
]

logger = logging.getLogger("agent_backend.backends.ssh")

# Every remote command carries AGENT_BACKEND_CALL=<token> in its environment (and
# so does everything it starts): the kill path finds its processes by that token,
# which also proves they are ours (no pid reuse can make it kill a stranger).
_CALL_VAR = "AGENT_BACKEND_CALL"
# Bounds of the shielded cleanup steps (seconds).
_KILL_WAIT = 2.0
_SIGNAL_CHANNEL_TIMEOUT = 2.0
_CLOSE_WAIT = 2.0
_CAPACITY_COOLDOWN = 10.0
_FINAL_CLEANUP_TIMEOUT = 5.0
# Handshake errors that retrying cannot fix (configuration, not the network).
_FATAL_CONNECT_ERRORS: tuple[type[Exception], ...] = (
    asyncssh.HostKeyNotVerifiable,
    asyncssh.PermissionDenied,
    asyncssh.KeyExchangeFailed,
)
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

# Remote scripts for the file operations, run as ``/bin/sh -c SCRIPT sh ARGS...``
# (arguments are never spliced into the script). Exit codes 2-6 map to errnos above.
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


# -- asyncssh glue ----------------------------------------------------------------------------


class _Client(asyncssh.SSHClient):
    """Tells the pool, synchronously, when its connection dies."""

    def __init__(self) -> None:
        self.lost = False
        self.on_lost: Callable[[Exception | None], None] | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(exc)


class _Connection:
    """One pooled SSH connection; its identity is its key in the lease table."""

    __slots__ = ("client", "conn", "lost", "open_channels", "peer", "restore_at", "serial")

    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client, serial: int) -> None:
        self.conn = conn
        self.client = client
        self.serial = serial
        self.lost = False
        self.open_channels = 0
        self.restore_at: float | None = None  # when a lowered capacity goes back up
        self.peer: Any = conn.get_extra_info("peername")

    def __repr__(self) -> str:
        state = "lost" if self.lost else "open"
        return f"<SSHConnection #{self.serial} {state}, {self.open_channels} channels>"


class _Session(asyncssh.SSHClientSession[bytes]):
    """One remote command: its output into bounded buffers, how it ended."""

    def __init__(self, stdout_limit: int, stderr_limit: int) -> None:
        self.stdout = OutputBuffer(stdout_limit)
        self.stderr = OutputBuffer(stderr_limit)
        self.exit_status: int | None = None
        self.exit_signal: str | None = None
        self.error: Exception | None = None
        # Plain asyncio events and a loop timer: the hot path needs no cancel scope.
        self.closed = asyncio.Event()
        """The channel is closed (the command ended, or the connection died)."""
        self.wake = asyncio.Event()
        """Closed, timed out, or told to stop: the driving call looks at why."""
        self.expired = False
        self.stopping = False

    def expire(self) -> None:
        self.expired = True
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.stderr.feed(data)
        else:
            self.stdout.feed(data)

    def eof_received(self) -> bool:
        # True: do not answer the server's EOF with ours (one packet less per call);
        # the channel closes when the server closes it after the exit status.
        return True

    def exit_status_received(self, status: int) -> None:
        self.exit_status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self.exit_signal = signal

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = exc
        self.closed.set()
        self.wake.set()


class _Waiter:
    __slots__ = ("error", "event", "lease", "owner")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.event = anyio.Event()
        self.lease: Lease[_Connection] | None = None
        self.error: Exception | None = None


class _Call:
    """The owner of a call's leases."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __repr__(self) -> str:
        return f"<call {self.token}>"


def _quote_first(word: str) -> str:
    """Always quoted, so the first word is never a reserved word, an alias or an assignment."""
    return "'" + word.replace("'", "'\"'\"'") + "'"


# -- one host ---------------------------------------------------------------------------------


class SSHHost(Host):
    """One SSH host and its pool of connections. Created and run by :class:`SSHBackend`."""

    def __init__(self, config: SSHHostConfig) -> None:
        self.config = config
        self.username = config.username or getpass.getuser()
        self.address = f"{config.host}:{config.port}"
        self.name = f"{self.username}@{self.address}"
        self._capacity = config.max_channels_per_connection
        self._table: LeaseTable[_Connection] = LeaseTable(idle_ttl=config.idle_ttl or None)
        self._waiters: deque[_Waiter] = deque()
        self._connecting = 0
        self._unstarted = 0
        self._deferred: list[tuple[Callable[[], Awaitable[None]], str]] = []
        self._deferred_ready = asyncio.Event()
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._tg: anyio.abc.TaskGroup | None = None
        self._handshake_slots = anyio.Semaphore(config.max_concurrent_handshakes)
        self._next_handshake_at = 0.0
        self._backoff_until = 0.0
        self._backoff = config.retry_backoff
        self._down = False
        self._consecutive_failures = 0
        self._last_error = ""
        self._algorithms: dict[str, Any] = (
            {"encryption_algs": "^" + ",".join(config.preferred_ciphers)}
            if config.preferred_ciphers
            else {}
        )
        self._known_hosts: Any = ()
        self._client_keys: Any = ()
        self._in_flight = 0  # calls inside _execute
        self._running: set[_Session] = set()  # their remote commands, while they run
        self._closing = anyio.Event()
        self._calls_done = anyio.Event()
        self._to_close: list[_Connection] = []
        self._orphans: list[str] = []  # tokens of calls lost with their connection
        self._orphan_killer = False
        self._workspaces: set[str] = set()
        self._instance = secrets.token_hex(4)
        self._call_ids = itertools.count(1)
        self._serials = itertools.count(1)
        self._handshakes = 0
        self._handshake_failures = 0
        self._connections_lost = 0
        self._connections_reaped = 0
        self._channel_refusals = 0
        self._calls_started = 0
        self._remote_kills = 0
        if config.insecure_skip_host_key_check:
            logger.warning(
                "%s: host key verification is OFF (insecure_skip_host_key_check = true); "
                "anyone on the network path can impersonate this host",
                self.name,
            )

    # -- predicates and statistics ------------------------------------------------------------

    def is_up(self) -> bool:
        return not self._down and self._state == "open"

    def is_closed(self) -> bool:
        return self._state in ("closing", "closed")

    def load(self) -> int:
        return self._table.active_leases() + len(self._waiters)

    def statistics(self) -> SSHHostStats:
        table = self._table.statistics()
        return SSHHostStats(
            host=self.name,
            up=not self._down,
            closed=self.is_closed(),
            connections_open=table.resources,
            connections_idle=table.idle,
            connections_connecting=self._connecting,
            leases_active=table.active_leases,
            leases_queued=len(self._waiters),
            channels_open=sum(c.open_channels for c in self._table.resources()),
            handshakes=self._handshakes,
            handshake_failures=self._handshake_failures,
            connections_lost=self._connections_lost,
            connections_reaped=self._connections_reaped,
            channel_refusals=self._channel_refusals,
            calls=self._calls_started,
            remote_kills=self._remote_kills,
            consecutive_failures=self._consecutive_failures,
            workspaces=len(self._workspaces),
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = " closed" if s.closed else (" down" if not s.up else "")
        return (
            f"<SSHPool {self.address} [leases: {s.leases_active} active, {s.leases_queued} queued"
            f" | conns: {s.connections_open} open, {s.connections_idle} idle]{state}>"
        )

    def connections(self) -> list[_Connection]:
        """The registered connections, oldest first (for tests and diagnostics)."""
        return self._table.resources()

    def workspaces(self) -> frozenset[str]:
        """The workspaces made and not yet removed."""
        return frozenset(self._workspaces)

    # -- lifecycle (driven by SSHBackend) -----------------------------------------------------

    async def _start(self, tg: anyio.abc.TaskGroup) -> None:
        # Key files are read once, in a thread: never a blocking read on the loop (PITFALLS 14).
        self._known_hosts, self._client_keys = await anyio.to_thread.run_sync(
            self._load_credentials
        )
        if self._state != "new":
            raise PoolClosed(f"{self.name} was closed while starting")
        self._tg = tg
        self._state = "open"
        self._spawn(self._spawn_deferred_forever, "spawner")
        if self._table.idle_ttl is not None:
            self._spawn(self._reap_forever, "reaper")

    def _load_credentials(self) -> tuple[Any, Any]:
        config = self.config
        known_hosts: Any = None
        if not config.insecure_skip_host_key_check:
            try:
                known_hosts = asyncssh.read_known_hosts(config.known_hosts)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"{self.name}: cannot read known_hosts {config.known_hosts!r}: {describe(exc)}",
                    key="known_hosts",
                    expected="a readable OpenSSH known_hosts file holding the host's key",
                ) from None
        client_keys: Any = ()
        if config.client_keys:
            try:
                client_keys = asyncssh.load_keypairs(list(config.client_keys))
            except (OSError, ValueError, asyncssh.KeyImportError) as exc:
                raise ConfigError(
                    f"{self.name}: cannot load client_keys: {describe(exc)}",
                    key="client_keys",
                    expected="readable, unencrypted private key files",
                ) from None
        return known_hosts, client_keys

    def _begin_close(self) -> None:
        """Synchronously: refuse new calls and connections, fail waiters, end calls in flight."""
        if self._state in ("closing", "closed"):
            return
        self._state = "closing"
        self._to_close.extend(self._table.close())
        self._closing.set()  # wakes calls sleeping in a retry backoff
        self._fail_waiters(lambda: PoolClosed(f"{self.name} is closing"))
        for session in self._running:
            session.stop()  # each call kills its remote command, then raises PoolClosed
        if self._in_flight == 0:
            self._calls_done.set()

    async def _wait_calls(self) -> None:
        await self._calls_done.wait()

    async def _shutdown(self) -> None:
        """Close every connection (the caller shields this); leave nothing remote behind."""
        connections = [*self._to_close, *self._table.drained()]
        self._to_close = []
        for connection in self._table.resources():  # calls that would not end in time
            self._table.remove(connection)
            connections.append(connection)
        for connection in connections:
            connection.client.on_lost = None
        self._connecting = 0  # background work has ended (the supervisor waited for it)
        if self._orphans or self._workspaces:
            await self._final_cleanup([c for c in connections if not c.lost])
        for connection in connections:
            connection.conn.close()
        for connection in connections:
            with anyio.move_on_after(_CLOSE_WAIT) as bound:
                await connection.conn.wait_closed()
            if bound.cancelled_caught:
                connection.conn.abort()
        self._state = "closed"

    async def _final_cleanup(self, live: list[_Connection]) -> None:
        """Kill orphans of lost connections and remove workspaces left by unfinished sessions."""
        parts = [self._kill_script(self._orphans, "KILL")] if self._orphans else []
        if self._workspaces:
            paths = " ".join(shlex.quote(p) for p in sorted(self._workspaces))
            parts.append(f"chmod -R u+rwx -- {paths} 2>/dev/null; rm -rf -- {paths}")
        line = "; ".join([*parts, "exit 0"])
        with anyio.move_on_after(_FINAL_CLEANUP_TIMEOUT):
            connection = live[0] if live else None
            one_off = connection is None and not self._down
            if one_off:
                # Not a pool reconnect: a single connection, closed below, only so that
                # workspaces and orphaned commands are not leaked when no pooled
                # connection is left (all reaped or lost).
                with contextlib.suppress(BackendUnavailable):
                    connection = await self._connect_once()
            if connection is not None:
                session = await self._run_internal(connection, line, within=_FINAL_CLEANUP_TIMEOUT)
                if session is not None and session.exit_status == 0:
                    self._orphans.clear()
                    self._workspaces.clear()
                if one_off:
                    connection.conn.close()
                    await connection.conn.wait_closed()
        if self._workspaces:
            logger.warning(
                "%s: could not remove workspaces at close: %s", self.name, sorted(self._workspaces)
            )

    def _is_open(self) -> bool:
        return self._state == "open"

    def _check_usable(self) -> None:
        if self._state in ("closing", "closed"):
            raise PoolClosed(f"{self.name} is closed")
        if self._state == "new":
            raise PoolError(f"{self.name} is not started: use the backend in `async with` first")
        if self._down:
            raise BackendUnavailable(
                f"{self.name} is down after {self._consecutive_failures} failed connection attempts"
                f" ({self._last_error}); probing every {self.config.probe_interval:g} s",
                backend="ssh",
                host=self.name,
            )

    # -- the pool: waiters, connectors, leases -------------------------------------------------

    def _assign(self) -> None:
        """Hand free slots to waiters in order; start connectors for the demand left over."""
        waiters = self._waiters
        if self._table.closed:
            return
        while waiters:
            lease = self._table.acquire(waiters[0].owner, pack=True)
            if lease is None:
                break
            waiter = waiters.popleft()
            waiter.lease = lease
            waiter.event.set()
        if not waiters or self._state != "open" or self._down or self._tg is None:
            return
        demand = len(waiters) - self._connecting * self._capacity
        room = self.config.max_connections - len(self._table) - self._connecting
        while demand > 0 and room > 0:
            self._connecting += 1
            demand -= self._capacity
            room -= 1
            self._spawn(self._connector, "connector")

    def _spawn(self, work: Callable[[], Awaitable[None]], what: str) -> None:
        """Start background work in the backend's task group.

        From an asyncssh callback (``connection_lost`` runs outside any task, where
        anyio cannot spawn) the work is handed to :meth:`_spawn_deferred_forever`.
        ``_unstarted`` counts tasks spawned but not yet running: the supervisor
        lets them start before it cancels the group, so that no coroutine is
        dropped unstarted (its cleanup, such as a connector's accounting, runs).
        """
        assert self._tg is not None
        if asyncio.current_task() is None:
            self._deferred.append((work, what))
            self._deferred_ready.set()
            return
        self._unstarted += 1
        self._tg.start_soon(self._background, work, name=f"ssh {what} {self.name}")

    async def _spawn_deferred_forever(self) -> None:
        while True:
            await self._deferred_ready.wait()
            self._deferred_ready.clear()
            deferred, self._deferred = self._deferred, []
            if self._is_open():  # else: closing, and _shutdown settles the accounting
                for work, what in deferred:
                    self._spawn(work, what)

    async def _background(self, work: Callable[[], Awaitable[None]]) -> None:
        self._unstarted -= 1
        await work()

    def _fail_waiters(self, make_error: Callable[[], Exception]) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.error = make_error()
            waiter.event.set()

    async def _lease(self, owner: object) -> Lease[_Connection]:
        self._check_usable()
        if not self._waiters:  # FIFO: nobody overtakes a queued caller
            lease = self._table.acquire(owner, pack=True)
            if lease is not None:
                return lease
        waiter = _Waiter(owner)
        self._waiters.append(waiter)
        self._assign()
        try:
            await waiter.event.wait()
        except BaseException:
            # Cancelled or timed out while queued: leave the queue (or give back a
            # slot granted in the meantime) and rebalance before re-raising.
            if waiter.lease is not None:
                self._release(waiter.lease)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        if waiter.error is not None:
            raise waiter.error
        assert waiter.lease is not None
        return waiter.lease

    def _release(self, lease: Lease[_Connection]) -> None:
        self._table.release(lease)
        connection = lease.resource
        if connection.restore_at is not None and time.monotonic() >= connection.restore_at:
            connection.restore_at = None
            if self._table.is_registered(connection):
                self._table.set_capacity(connection, self._capacity)
        if self._state == "open":
            self._assign()

    async def _connector(self) -> None:
        """Open one connection for queued demand (never raises: it runs in the task group)."""
        try:
            try:
                connection = await self._handshake()
            finally:
                self._connecting -= 1
        except PoolClosed:
            return
        except BackendUnavailable as exc:
            self._on_connect_failure(exc)
            return
        except Exception as exc:  # a bug must not take the task group (and the pool) down
            logger.exception("%s: connector failed", self.name)
            self._on_connect_failure(
                BackendUnavailable(describe(exc), backend="ssh", host=self.name)
            )
            return
        await self._adopt(connection)

    async def _adopt(self, connection: _Connection) -> None:
        if self._state != "open":  # stop began during the handshake: never add it
            with anyio.CancelScope(shield=True):
                await self._close_connection(connection)
            return
        self._table.add(connection, capacity=self._capacity)
        connection.client.on_lost = functools.partial(self._on_connection_lost, connection)
        self._consecutive_failures = 0
        self._backoff = self.config.retry_backoff
        if connection.client.lost:
            self._on_connection_lost(connection, None)
        self._assign()
        self._schedule_orphan_cleanup()

    def _on_connect_failure(self, exc: BackendUnavailable) -> None:
        self._consecutive_failures += 1
        self._last_error = exc.message
        if self._state != "open":
            return
        nothing_open = not self._table and self._connecting == 0
        if nothing_open and self._consecutive_failures >= self.config.down_after_failures:
            self._mark_down()
        elif nothing_open:
            self._fail_waiters(
                lambda: BackendUnavailable(exc.message, backend="ssh", host=self.name)
            )
        else:
            self._assign()

    def _mark_down(self) -> None:
        self._down = True
        logger.warning(
            "%s: marked down after %d failed connection attempts (%s); probing every %g s",
            self.name,
            self._consecutive_failures,
            self._last_error,
            self.config.probe_interval,
        )
        self._fail_waiters(
            lambda: BackendUnavailable(
                f"{self.name} is down: {self._last_error}", backend="ssh", host=self.name
            )
        )
        self._spawn(self._probe_until_up, "probe")

    async def _probe_until_up(self) -> None:
        while self._is_open() and self._down:
            await anyio.sleep(self.config.probe_interval)
            if not self._is_open():
                return
            try:
                connection = await self._connect_once()
            except BackendUnavailable as exc:
                self._last_error = exc.message
                continue
            except Exception:
                logger.exception("%s: probe failed", self.name)
                continue
            self._down = False
            logger.warning("%s: reachable again, marked up", self.name)
            await self._adopt(connection)
            return

    def _on_connection_lost(self, connection: _Connection, exc: Exception | None) -> None:
        connection.lost = True
        # Only the registered object leaves the table, once: a stale callback of
        # an old connection can never remove (or close) a newer one (PITFALLS 12).
        if self._table.remove(connection):
            self._connections_lost += 1
            logger.info("%s: connection #%d lost: %s", self.name, connection.serial, exc)
            if self._state == "open":
                self._assign()

    async def _handshake(self) -> _Connection:
        """Ramped and retried: at most max_concurrent_handshakes, spaced, backing off."""
        last: BackendUnavailable | None = None
        for _ in range(self.config.connect_retries + 1):
            async with self._handshake_slots:
                now = time.monotonic()
                start_at = max(now, self._next_handshake_at, self._backoff_until)
                self._next_handshake_at = start_at + self.config.handshake_interval
                if start_at > now:
                    await anyio.sleep(start_at - now)
                if self._state != "open":
                    raise PoolClosed(f"{self.name} is closing")
                try:
                    return await self._connect_once()
                except BackendUnavailable as exc:
                    if isinstance(exc.__cause__, _FATAL_CONNECT_ERRORS):
                        raise
                    last = exc
            self._backoff_until = time.monotonic() + self._backoff * random.uniform(0.5, 1.0)
            self._backoff = min(self._backoff * 2, self.config.retry_backoff_max)
        assert last is not None
        raise last

    async def _connect_once(self) -> _Connection:
        config = self.config
        client = _Client()
        self._handshakes += 1
        try:
            with map_exceptions(
                {(OSError, asyncssh.Error, TimeoutError): BackendUnavailable},
                message=f"cannot connect to {self.name}",
                backend="ssh",
                host=self.name,
            ):
                with anyio.fail_after(config.connect_timeout + 1.0):
                    conn = await asyncssh.connect(
                        config.host,
                        config.port,
                        username=self.username,
                        known_hosts=self._known_hosts,
                        client_keys=self._client_keys,
                        agent_path=None if config.client_keys else (),
                        preferred_auth="publickey",
                        config=None,  # never ~/.ssh/config: same host, port and user always
                        connect_timeout=config.connect_timeout,
                        keepalive_interval=config.keepalive_interval,
                        keepalive_count_max=config.keepalive_count_max,
                        client_factory=lambda: client,
                        **self._algorithms,
                    )
        except BackendUnavailable:
            self._handshake_failures += 1
            raise
        return _Connection(conn, client, next(self._serials))

    async def _close_connection(self, connection: _Connection) -> None:
        """Close one connection that left the table. The caller shields this."""
        connection.client.on_lost = None
        connection.conn.close()
        with anyio.move_on_after(_CLOSE_WAIT) as bound:
            await connection.conn.wait_closed()
        if bound.cancelled_caught:
            connection.conn.abort()

    async def _reap_forever(self) -> None:
        ttl = self._table.idle_ttl
        assert ttl is not None
        while True:
            expiry = self._table.next_expiry()
            delay = ttl / 2 if expiry is None else min(ttl / 2, expiry - time.monotonic())
            await anyio.sleep(max(delay, 0.005))
            # Ownership-checked in the table: only unleased, expired, still-registered ones.
            for connection in self._table.reap():
                self._connections_reaped += 1
                logger.debug("%s: closing idle connection #%d", self.name, connection.serial)
                with anyio.CancelScope(shield=True):
                    await self._close_connection(connection)

    def _channel_refused(self, connection: _Connection, exc: asyncssh.ChannelOpenError) -> None:
        """sshd refused a channel: carry at most the channels open now, for a while.

        Either sshd's MaxSessions is below max_channels_per_connection, or sshd has
        not yet freed sessions that were just closed (it frees them lazily). The
        lowered capacity is restored after ``_CAPACITY_COOLDOWN`` seconds; if the
        limit is real, the next refusal lowers it again.
        """
        self._channel_refusals += 1
        open_now = connection.open_channels
        if not self._table.is_registered(connection) or open_now < 1:
            return
        capacity = self._table.capacity_of(connection)
        connection.restore_at = time.monotonic() + _CAPACITY_COOLDOWN
        if open_now < capacity:
            self._table.set_capacity(connection, open_now)
            logger.info(
                "%s: sshd refused a channel with %d open (%s); connection #%d carries at most %d"
                " for %g s (if this repeats, max_channels_per_connection is above sshd's MaxSessions)",
                self.name,
                open_now,
                exc.reason,
                connection.serial,
                open_now,
                _CAPACITY_COOLDOWN,
            )

    def _retry_delay(self, attempt: int) -> float:
        config = self.config
        return backoff_delay(attempt, first=config.retry_backoff, ceiling=config.retry_backoff_max)

    # -- running commands ---------------------------------------------------------------------

    def _prologue(
        self, token: str, env: Mapping[str, str], cwd: str | None, *, stdin: bool
    ) -> list[str]:
        """What the login shell does first: the call token, the environment, stdin, cwd.

        Shell builtins only (no extra process, no extra SSH packet): without input,
        stdin is /dev/null rather than an EOF sent over the channel.
        """
        merged = {**self.config.env, **env}
        for name in merged:
            if not ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        exports = "".join(f"{name}={shlex.quote(value)} " for name, value in merged.items())
        parts = [f"export {exports}{_CALL_VAR}={token}"]
        if not stdin:
            parts.append("exec </dev/null")
        if cwd is not None:
            parts.append(f"cd -- {shlex.quote(cwd)} || exit 127")
        return parts

    def _command_line(self, command: Command, token: str) -> str:
        parts = self._prologue(token, command.env, command.cwd, stdin=command.stdin is not None)
        if command.argv is not None:
            first, *rest = command.argv
            parts.append(" ".join([_quote_first(first), *map(shlex.quote, rest)]))
        else:
            assert command.shell is not None
            parts.append(f"exec {shlex.quote(self.config.shell)} -c {shlex.quote(command.shell)}")
        return "; ".join(parts)

    def _script_line(self, script: str, args: Sequence[str], stdin: bool, token: str) -> str:
        parts = self._prologue(token, {}, None, stdin=stdin)
        parts.append(f"exec /bin/sh -c {shlex.quote(script)} sh {' '.join(map(shlex.quote, args))}")
        return "; ".join(parts)

    async def run(self, command: Command) -> CommandResult:
        return await self._execute(
            functools.partial(self._command_line, command),
            stdin=command.stdin,
            time_limit=command.timeout,
            stdout_limit=command.output_limit,
            stderr_limit=command.output_limit,
        )

    async def _execute(
        self,
        line_for: Callable[[str], str],
        *,
        stdin: bytes | None,
        time_limit: float,
        stdout_limit: int,
        stderr_limit: int,
    ) -> CommandResult:
        self._check_usable()
        started = time.monotonic()
        token = f"{self._instance}.{next(self._call_ids)}"
        line = line_for(token)
        self._calls_started += 1
        self._in_flight += 1
        try:
            return await self._attempt(
                line,
                token,
                stdin=stdin,
                started=started,
                deadline=started + time_limit,
                limits=(stdout_limit, stderr_limit),
            )
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._state != "open":
                self._calls_done.set()

    async def _attempt(
        self,
        line: str,
        token: str,
        *,
        stdin: bytes | None,
        started: float,
        deadline: float,
        limits: tuple[int, int],
    ) -> CommandResult:
        owner = _Call(token)
        refusals = 0
        while True:
            self._check_usable()
            # Fast path: a free slot and nobody queued (FIFO): no waiting, no timer.
            lease = None if self._waiters else self._table.acquire(owner, pack=True)
            if lease is None:
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    lease = await self._lease(owner)
                if lease is None:
                    return self._busy_result(started)
            connection = lease.resource
            try:
                channel, session = await self._open_session(connection, line, limits)
            except asyncssh.ChannelOpenError as exc:
                self._release(lease)
                refusals += 1
                self._channel_refused(connection, exc)
                if refusals > self.config.channel_open_retries:
                    raise BackendUnavailable(
                        f"{self.name} refused {refusals} channel opens in a row ({exc.reason});"
                        " is max_channels_per_connection above sshd's MaxSessions?",
                        backend="ssh",
                        host=self.name,
                    ) from exc
                delay = min(self._retry_delay(refusals), max(0.0, deadline - time.monotonic()))
                with anyio.move_on_after(delay):
                    await self._closing.wait()
                continue
            except BaseException:
                self._release(lease)
                raise
            try:
                return await self._drive(
                    connection, channel, session, token, stdin, started, deadline
                )
            finally:
                self._release(lease)

    async def _open_session(
        self, connection: _Connection, line: str, limits: tuple[int, int]
    ) -> tuple[asyncssh.SSHClientChannel[bytes], _Session]:
        """Open a channel running ``line``. Shielded: a half-opened channel is never abandoned;
        the caller's cancellation or deadline takes effect right after (and kills the command)."""
        session = _Session(*limits)
        # A connection that cannot open a channel within connect_timeout is sick: drop it
        # (it leaves the table in connection_lost, and this open fails as WorkerLost).
        watchdog = asyncio.get_running_loop().call_later(
            self.config.connect_timeout, connection.conn.abort
        )
        try:
            with (
                map_exceptions(
                    {(OSError, asyncssh.Error): WorkerLost},
                    message=f"connection to {self.name} failed while opening a channel",
                    backend="ssh",
                    host=self.name,
                    ignore=(asyncssh.ChannelOpenError,),
                ),
                anyio.CancelScope(shield=True),
            ):
                channel, _ = await connection.conn.create_session(
                    lambda: session, line, encoding=None
                )
        except WorkerLost as exc:
            exc.worker = f"{self.name}#{connection.serial}"
            raise
        finally:
            watchdog.cancel()
        return channel, session

    async def _drive(
        self,
        connection: _Connection,
        channel: asyncssh.SSHClientChannel[bytes],
        session: _Session,
        token: str,
        stdin: bytes | None,
        started: float,
        deadline: float,
    ) -> CommandResult:
        connection.open_channels += 1
        self._running.add(session)
        if self._state != "open":
            session.stop()  # stop began while the channel was opening
        try:
            if stdin is not None:  # else the remote stdin is /dev/null (see _prologue)
                with contextlib.suppress(OSError, asyncssh.Error):
                    channel.write(stdin)
                    channel.write_eof()
            loop = asyncio.get_running_loop()
            timer = loop.call_at(
                loop.time() + max(0.0, deadline - time.monotonic()), session.expire
            )
            try:
                await session.wake.wait()
            except BaseException:  # the caller was cancelled: no remote orphan
                with anyio.CancelScope(shield=True):
                    await self._terminate(connection, channel, session, token)
                raise
            finally:
                timer.cancel()
            terminated = not session.closed.is_set()  # timed out, or the pool is stopping
            if terminated:
                with anyio.CancelScope(shield=True):
                    await self._terminate(connection, channel, session, token)
        finally:
            connection.open_channels -= 1
            self._running.discard(session)
        if terminated and session.stopping:
            raise PoolClosed(f"{self.name} was closed while the call was running")
        timed_out = terminated
        ended = session.exit_status is not None or session.exit_signal is not None
        if not ended and (connection.lost or not timed_out):
            self._note_orphan(token)  # its processes may still run remotely
            cause = describe(session.error) if session.error is not None else "channel closed"
            raise WorkerLost(
                f"connection #{connection.serial} to {self.name} was lost during the call ({cause})",
                worker=f"{self.name}#{connection.serial}",
                cause=cause,
                backend="ssh",
                host=self.name,
            )
        return CommandResult(
            exit_status=session.exit_status,
            signal=session.exit_signal or ("KILL" if timed_out and not ended else None),
            stdout=session.stdout.result(),
            stderr=session.stderr.result(),
            duration=time.monotonic() - started,
            timed_out=timed_out,
            host=self.name,
        )

    async def _terminate(
        self,
        connection: _Connection,
        channel: asyncssh.SSHClientChannel[bytes],
        session: _Session,
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
        self._remote_kills += 1
        with anyio.move_on_after(self.config.kill_grace + 3 * _KILL_WAIT):
            for signame, wait in (("TERM", self.config.kill_grace), ("KILL", _KILL_WAIT)):
                if connection.lost:
                    break
                if not session.closed.is_set():
                    with contextlib.suppress(OSError, asyncssh.Error, ValueError):
                        channel.send_signal(signame)
                await self._signal_calls(connection, [token], signame)
                with anyio.move_on_after(wait):
                    await session.closed.wait()
        if connection.lost or not session.closed.is_set():
            self._note_orphan(token)
        with contextlib.suppress(OSError, asyncssh.Error):
            channel.close()

    async def _signal_calls(
        self, preferred: _Connection, tokens: Sequence[str], signame: str
    ) -> None:
        """Run the kill script on ``preferred``, else on another live connection of the host."""
        line = self._kill_script(tokens, signame)
        others = [c for c in self._table.resources() if c is not preferred]
        for connection in (preferred, *others):
            if connection.lost:
                continue
            session = await self._run_internal(connection, line, within=_SIGNAL_CHANNEL_TIMEOUT)
            if session is not None:
                return

    @staticmethod
    def _kill_script(tokens: Sequence[str], signame: str) -> str:
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
            f"v={_CALL_VAR}; "
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

    async def _run_internal(
        self, connection: _Connection, line: str, *, within: float
    ) -> _Session | None:
        """A short maintenance command outside the lease table; None if it failed."""
        try:
            with anyio.move_on_after(within):
                _, session = await self._open_session(connection, line, (4096, 4096))
                await session.closed.wait()
                return session
        except Exception as exc:
            logger.debug("%s: maintenance command failed: %s", self.name, describe(exc))
        return None

    def _note_orphan(self, token: str) -> None:
        self._orphans.append(token)
        self._schedule_orphan_cleanup()

    def _schedule_orphan_cleanup(self) -> None:
        if self._orphans and not self._orphan_killer and self._is_open() and self._tg is not None:
            self._orphan_killer = True
            self._spawn(self._kill_orphans, "orphan cleanup")

    async def _kill_orphans(self) -> None:
        """Kill the processes of calls lost with their connection, on spare capacity only.

        Never queues (queueing would look like demand and open a connection): it
        takes a free slot when nobody waits, else tries again shortly.
        """
        try:
            owner = _Call("orphan-cleanup")
            give_up = time.monotonic() + self.config.file_op_timeout
            # With no connection left, stop: the next one adopted schedules this again.
            while self._orphans and self._is_open() and self._table and time.monotonic() < give_up:
                lease = None if self._waiters else self._table.acquire(owner, pack=True)
                if lease is None:
                    await anyio.sleep(0.05)
                    continue
                orphans, self._orphans = self._orphans, []
                script = self._kill_script(orphans, "KILL")
                try:
                    session = await self._run_internal(
                        lease.resource, script, within=self.config.file_op_timeout
                    )
                finally:
                    self._release(lease)
                if session is None or session.exit_status != 0:
                    self._orphans.extend(orphans)
                    logger.warning("%s: could not kill orphaned remote commands", self.name)
                return
        finally:
            self._orphan_killer = False

    def _busy_result(self, started: float) -> CommandResult:
        message = f"the command did not start within its timeout: no SSH channel to {self.name} became free".encode()
        return CommandResult(
            exit_status=None,
            stderr=Output(message, len(message), False),
            duration=time.monotonic() - started,
            timed_out=True,
            host=self.name,
        )

    # -- files --------------------------------------------------------------------------------

    async def _script(
        self,
        script: str,
        args: Sequence[str],
        *,
        what: str,
        stdin: bytes | None = None,
        limit: int = 1 << 20,
    ) -> CommandResult:
        timeout = self.config.file_op_timeout
        result = await self._execute(
            functools.partial(self._script_line, script, args, stdin is not None),
            stdin=stdin,
            time_limit=timeout,
            stdout_limit=limit,
            stderr_limit=4096,
        )
        if result.timed_out:
            raise ToolTimeout(
                f"{what} on {self.name} did not finish within {timeout:g} s",
                timeout=timeout,
                backend="ssh",
                host=self.name,
            )
        return result

    def _file_error(self, result: CommandResult, path: str, what: str) -> OSError:
        code = _FILE_ERRNOS.get(result.exit_status or 0)
        if code is not None:
            return OSError(code, os.strerror(code), path)
        detail = clip(result.stderr.text().strip(), 300) or f"exit status {result.exit_status}"
        return OSError(errno.EIO, f"{what} failed on {self.name}: {detail}", path)

    @staticmethod
    def _absolute(path: str) -> str:
        if not posixpath.isabs(path):
            raise ValueError(f"remote paths must be absolute, got {path!r}")
        return path

    async def make_workspace(self) -> str:
        result = await self._script(
            _MAKE_WORKSPACE, (self.config.workspace_root,), what="making a workspace"
        )
        lines = result.stdout.data.decode("utf-8", "surrogateescape").splitlines()
        if result.exit_status != 0 or len(lines) != 2:
            raise BackendUnavailable(
                f"cannot make a workspace under {self.config.workspace_root} on {self.name}:"
                f" {clip(result.stderr.text().strip(), 300)}",
                backend="ssh",
                host=self.name,
            )
        path = lines[1]
        if self._state != "open":  # closed while it was being made: do not leak it
            raise PoolClosed(f"{self.name} is closed")
        self._workspaces.add(path)
        return path

    async def remove_workspace(self, path: str) -> None:
        """Remove a workspace this host made; any other path is left alone (never removed)."""
        if path not in self._workspaces:
            return
        result = await self._script(_REMOVE_TREE, (path,), what="removing a workspace")
        if result.exit_status != 0:
            raise self._file_error(result, path, "removing a workspace")
        self._workspaces.discard(path)

    async def realpath(self, path: str) -> str:
        result = await self._script(_REALPATH, (self._absolute(path),), what="realpath")
        if result.exit_status != 0:
            raise self._file_error(result, path, "realpath")
        return result.stdout.data.decode("utf-8", "surrogateescape").removesuffix("\n")

    async def read_file(self, path: str, *, limit: int) -> FileData:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        result = await self._script(
            _READ_FILE, (self._absolute(path), str(limit)), what="reading a file", limit=limit + 64
        )
        if result.exit_status != 0:
            raise self._file_error(result, path, "reading a file")
        size_line, _, data = result.stdout.data.partition(b"\n")
        if result.stdout.truncated or not size_line.isdigit():
            raise OSError(errno.EIO, f"unexpected reply reading a file on {self.name}", path)
        return FileData(data, int(size_line))

    async def write_file(self, path: str, data: bytes) -> None:
        result = await self._script(
            _WRITE_FILE, (self._absolute(path),), what="writing a file", stdin=data
        )
        if result.exit_status != 0:
            raise self._file_error(result, path, "writing a file")

    async def list_dir(self, path: str) -> list[DirEntry]:
        result = await self._script(
            _LIST_DIR, (self._absolute(path),), what="listing a directory", limit=_LIST_LIMIT
        )
        if result.exit_status != 0:
            raise self._file_error(result, path, "listing a directory")
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


# -- the backend ------------------------------------------------------------------------------


class SSHBackend(Backend):
    """A pool of SSH hosts: ``async with SSHBackend.from_config(cfg) as backend:``."""

    kind: ClassVar[str] = "ssh"

    def __init__(self, hosts: Sequence[SSHHostConfig], *, close_timeout: float = 10.0) -> None:
        if not hosts:
            raise ConfigError(
                "an SSH pool needs at least one host", key="hosts", expected="one or more hosts"
            )
        self._hosts = tuple(SSHHost(config) for config in hosts)
        self._close_timeout = close_timeout
        self._state: Literal["new", "starting", "open", "closing", "closed"] = "new"
        self._stop = anyio.Event()
        self._closed = anyio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: SSHPoolConfig) -> SSHBackend:
        return cls(config.hosts, close_timeout=config.close_timeout)

    @property
    def hosts(self) -> Sequence[SSHHost]:
        return self._hosts

    def is_closed(self) -> bool:
        return self._state in ("closing", "closed")

    def statistics(self) -> SSHStatistics:
        return SSHStatistics(
            hosts=tuple(h.statistics() for h in self._hosts), closed=self.is_closed()
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = " closed" if s.closed else ""
        return (
            f"<SSHBackend {len(self._hosts)} hosts [leases: {s.leases_active} active,"
            f" {s.leases_queued} queued | conns: {s.connections_open} open, {s.connections_idle} idle]{state}>"
        )

    async def start(self) -> None:
        if self._state != "new":
            if self.is_closed():
                raise PoolClosed("the SSH backend is closed")
            raise PoolError("the SSH backend is already started")
        self._state = "starting"
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[anyio.abc.TaskGroup] = loop.create_future()
        # Background work (connectors, reaper, probes) runs in a task group owned
        # by one supervisor task, so aclose() may be called from any task and
        # any cancel scope; aclose() stops it and waits for it: nothing outlives it.
        self._supervisor = loop.create_task(self._supervise(ready), name="agent-backend ssh pool")
        tg = await ready
        for host in self._hosts:
            await host._start(tg)
        if self._state == "starting":
            self._state = "open"

    async def _supervise(self, ready: asyncio.Future[anyio.abc.TaskGroup]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                ready.set_result(tg)
                await self._stop.wait()
                # Let tasks spawned just before stop start first (each then sees the
                # pool closing and ends), so that none is cancelled before it ran.
                for _ in range(1000):
                    if not any(host._unstarted for host in self._hosts):
                        break
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
        finally:
            if not ready.done():
                ready.cancel()

    async def aclose(self) -> None:
        """End calls in flight, stop background work, close every connection; idempotent."""
        if self._state == "closed":
            return
        if self._state == "closing":
            await self._closed.wait()
            return
        self._state = "closing"
        failure: BaseException | None = None
        try:
            with anyio.CancelScope(shield=True):
                for host in self._hosts:
                    host._begin_close()
                with anyio.move_on_after(self._close_timeout):
                    for host in self._hosts:
                        await host._wait_calls()
                self._stop.set()
                supervisor = self._supervisor
                if supervisor is not None:
                    with anyio.move_on_after(self._close_timeout):
                        await asyncio.wait({supervisor})
                    if not supervisor.done():
                        supervisor.cancel()
                        await asyncio.wait({supervisor})
                    if not supervisor.cancelled() and supervisor.exception() is not None:
                        failure = supervisor.exception()
                async with anyio.create_task_group() as closers:
                    for host in self._hosts:
                        closers.start_soon(host._shutdown)
        finally:
            self._state = "closed"
            self._closed.set()
        if failure is not None:
            raise failure
