"""One SSH host: commands and files over its :class:`~.pool.ConnectionPool`.

A call takes a lease (a channel slot on one connection), opens a channel, and
waits for the command to end, its deadline, a cancellation or the pool's stop;
in the last three cases every remote process of the call is ended (TERM,
grace, KILL: sshd "signal" plus ``kill`` of every process carrying the call's
token; :class:`~.remote.RemoteKills`), then the channel is closed. Commands of
a lost connection keep running under sshd (no pty, no SIGHUP); they are killed
by token over the next connection ("orphans").

Before the host's first command or workspace (single-flight: calls that come meanwhile wait),
it takes this owner's lock on the host and sweeps what dead owners left there
(:mod:`.owners`; a failure of either is a WARNING, never fatal).

Under ``isolation = "namespaces"`` a model's command runs in a sandbox made for the call
(:mod:`.walls`). After the sweep, one trial sandbox proves the host can build them; a host that
cannot is refused with :class:`~agent_backend.errors.SandboxUnavailable` naming what it lacks,
placement prefers other hosts, and each later call to it tries again (never unconfined). A
command's working directory must be inside one of this host's workspaces, the only writable
host directory it sees.

This module must never leave a remote process of a timed-out or cancelled call
running, let an asyncssh exception reach a caller, or remove a path it did not
make as a workspace, or run a model's command of a walled pool outside a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import getpass
import itertools
import logging
import math
import posixpath
import secrets
import shlex
import time
from collections.abc import Callable

import anyio
import anyio.to_thread
import asyncssh

from agent_backend.backends._errors import describe
from agent_backend.backends.ssh import owners, remote, walls
from agent_backend.backends.ssh.channel import (
    SSHConnection,
    SSHConnector,
    _CommandChannel,
    open_channel,
    run_maintenance,
    wait_closed,
)
from agent_backend.backends.ssh.config import SSHHostConfig, SSHHostStats
from agent_backend.backends.ssh.pool import ConnectionPool
from agent_backend.backoff import backoff_delay
from agent_backend.dispatch.backend import (
    Command,
    CommandResult,
    DirEntry,
    FileData,
    Host,
    Output,
)
from agent_backend.errors import (
    BackendUnavailable,
    PoolClosed,
    SandboxUnavailable,
    ToolTimeout,
    WorkerLost,
)
from agent_backend.lifecycle import TaskStarter

__all__ = ["SSHHost"]

logger = logging.getLogger("agent_backend.backends.ssh")

_FINAL_CLEANUP_TIMEOUT = 5.0  # seconds


class SSHHost(Host):
    """One SSH host and its pool of connections. Created and run by :class:`SSHBackend`."""

    def __init__(self, config: SSHHostConfig) -> None:
        self.config = config
        self.username = config.username or getpass.getuser()
        self.address = f"{config.host}:{config.port}"
        self.name = f"{self.username}@{self.address}"
        self._connector = SSHConnector(config, self.username, self.name)
        self.pool: ConnectionPool[SSHConnection] = ConnectionPool(
            self.name, config, self._connector, on_added=self._connection_added
        )
        """The connection pool (its state machine; read-only for callers)."""
        self._files = remote.RemoteFiles(self._script, self.name)
        self._in_flight = 0  # calls inside _execute
        self._running: set[_CommandChannel] = set()  # their remote commands, while they run
        self._calls_done = anyio.Event()
        self._kills = remote.RemoteKills(
            self.pool,
            self._maintenance,
            host=self.name,
            kill_grace=config.kill_grace,
            orphan_timeout=config.file_op_timeout,
        )
        self._workspaces: set[str] = set()
        self._instance = secrets.token_hex(4)
        """This host's owner id on the remote host: call tokens, workspace names, its lock."""
        self._call_ids = itertools.count(1)
        self._calls_started = 0
        self.owner_lock = owners.OwnerLock(
            self._connector,
            self.pool,
            host=self.name,
            instance=self._instance,
            root=config.workspace_root,
            base_env=config.env,
            open_timeout=config.connect_timeout,
            retry_backoff=config.retry_backoff,
            retry_ceiling=config.probe_interval,
        )
        """This owner's lock on the host (read-only for callers)."""
        self._owners_swept = False  # the lock taken (or not: logged) and dead owners swept once
        # isolation = "namespaces": proven once by a trial sandbox; refused while it fails.
        self._walled = config.isolation == "namespaces"
        self._walls_ready = False
        self._walls_refused = False
        self._first_use = anyio.Lock()  # single-flight: the sweep, then the walls' trial
        self._first_use_waiting = 0  # calls waiting for it
        if config.insecure_skip_host_key_check:
            logger.warning(
                "%s: host key verification is OFF (insecure_skip_host_key_check = true); "
                "anyone on the network path can impersonate this host",
                self.name,
            )

    # -- predicates and statistics ------------------------------------------------------------

    def is_up(self) -> bool:
        return not self.pool.down and self.pool.is_open()

    def is_closed(self) -> bool:
        return self.pool.state in ("closing", "closed")

    def is_suspect(self) -> bool:
        """Up, but its connections died or its last handshake failed and nothing is open:
        the backend places calls elsewhere while it finds out (reconnects, or marks it down).
        Also while it cannot build the walls its pool asks for (each call to it checks again)."""
        return self._walls_refused or self.pool.is_suspect()

    def calls_in_flight(self) -> int:
        """Calls in flight: holding a channel slot, queued for one, or waiting for what runs
        before the host's first call (the owner lock and sweep, the check of the walls)."""
        return self.pool.table.active_leases() + self.pool.queued() + self._first_use_waiting

    def statistics(self) -> SSHHostStats:
        pool = self.pool
        table = pool.table.statistics()
        return SSHHostStats(
            host=self.name,
            up=not pool.down,
            closed=self.is_closed(),
            connections_open=table.resources,
            connections_idle=table.idle,
            connections_connecting=pool.connecting,
            leases_active=table.active_leases,
            leases_queued=pool.queued(),
            channels_open=sum(c.open_channels for c in pool.table.resources()),
            handshakes=self._connector.handshakes,
            handshake_failures=self._connector.handshake_failures,
            connections_lost=pool.connections_lost,
            connections_reaped=pool.connections_reaped,
            channel_refusals=pool.channel_refusals,
            calls=self._calls_started,
            remote_kills=self._kills.count,
            consecutive_failures=pool.consecutive_failures,
            workspaces=len(self._workspaces),
            walls_refused=self._walls_refused,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        state = " closed" if s.closed else (" down" if not s.up else "")
        return (
            f"<SSHHost {self.address} [leases: {s.leases_active} active, {s.leases_queued} queued"
            f" | conns: {s.connections_open} open, {s.connections_idle} idle]{state}>"
        )

    def connections(self) -> list[SSHConnection]:
        """The registered connections, oldest first (for tests and diagnostics)."""
        return self.pool.table.resources()

    def workspaces(self) -> frozenset[str]:
        """The workspaces made and not yet removed."""
        return frozenset(self._workspaces)

    @property
    def instance(self) -> str:
        """This host's owner id on the remote host (``AGENT_BACKEND_CALL=<instance>.<n>``,
        ``ws.<instance>.*``, ``owners/<instance>.lock``)."""
        return self._instance

    # -- lifecycle (driven by SSHBackend) -----------------------------------------------------

    async def _start(self, tasks: TaskStarter) -> None:
        # Key files are read once, in a thread: a blocking read on the loop would
        # freeze every host starting in the same gather.
        await anyio.to_thread.run_sync(self._connector.load_credentials)
        self.pool.start(tasks)

    def _begin_close(self) -> None:
        """Synchronously: refuse new calls and connections, fail waiters, end calls in flight."""
        if self.is_closed():
            return
        self.pool.begin_close()
        for channel in self._running:
            channel.stop()  # each call kills its remote command, then raises PoolClosed
        if self._in_flight == 0:
            self._calls_done.set()

    async def _wait_calls(self) -> None:
        await self._calls_done.wait()

    async def _shutdown(self) -> None:
        """Close every connection (the caller shields this); leave nothing remote behind."""
        connections = self.pool.take_all()
        if self._kills.orphans or self._workspaces:
            await self._final_cleanup([c for c in connections if not c.lost])
        # Nothing of ours left on the host: the lock file goes too; else a successor sweeps.
        await self.owner_lock.aclose(release=not (self._kills.orphans or self._workspaces))
        for connection in connections:
            connection.conn.close()
        for connection in connections:
            await wait_closed(connection)
        self.pool.state = "closed"

    async def _final_cleanup(self, live: list[SSHConnection]) -> None:
        """Kill orphans of lost connections and remove workspaces left by unfinished sessions."""
        orphans = self._kills.orphans
        parts = [remote.kill_script(orphans, "KILL")] if orphans else []
        if self._workspaces:
            paths = " ".join(shlex.quote(p) for p in sorted(self._workspaces))
            parts.append(f"chmod -R u+rwx -- {paths} 2>/dev/null; rm -rf -- {paths}")
        line = "; ".join([*parts, "exit 0"])
        with anyio.move_on_after(_FINAL_CLEANUP_TIMEOUT):
            connection = live[0] if live else None
            one_off = connection is None and not self.pool.down
            if one_off:
                # Not a pool reconnect: a single connection, closed below, only so that
                # workspaces and orphaned commands are not leaked when no pooled
                # connection is left (all reaped or lost).
                with contextlib.suppress(BackendUnavailable):
                    connection = await self._connector.connect()
            if connection is not None:
                channel = await self._maintenance(connection, line, _FINAL_CLEANUP_TIMEOUT)
                if channel is not None and channel.exit_status == 0:
                    self._kills.orphans.clear()
                    self._workspaces.clear()
                if one_off:
                    connection.conn.close()
                    await connection.conn.wait_closed()
        if self._workspaces:
            logger.warning(
                "%s: could not remove workspaces at close: %s", self.name, sorted(self._workspaces)
            )

    # -- running commands ---------------------------------------------------------------------

    async def run(self, command: Command) -> CommandResult:
        config = self.config
        started = time.monotonic()
        line_for: Callable[[str], str]
        if self._walled:
            self._calls_started += 1  # a call from now, though it may wait for the walls check
        if not await self._check_first_use(timeout=command.timeout):
            if not self._walled:
                self._calls_started += 1  # counted as a call that waited for a channel is
            return self._busy_result(started)
        if not self._walled:
            line_for = functools.partial(
                remote.command_line, command, base_env=config.env, shell=config.shell
            )
        else:
            workspace = self._workspace_of(command.cwd)
            if command.cwd is not None and workspace is None:
                return self._outside_workspace()
            line_for = functools.partial(
                remote.sandboxed_command_line,
                command,
                base_env=config.env,
                shell=config.shell,
                workspace=workspace,
                limits=config.limits,
            )
        return await self._execute(
            line_for,
            stdin=command.stdin,
            timeout=command.timeout,
            stdout_limit=command.output_limit,
            stderr_limit=command.output_limit,
            counted=not self._walled,
        )

    async def _execute(
        self,
        line_for: Callable[[str], str],
        *,
        stdin: bytes | None,
        timeout: float,  # noqa: ASYNC109 - the command's limit: its remote processes are killed at it
        stdout_limit: int,
        stderr_limit: int,
        counted: bool = True,
    ) -> CommandResult:
        self.pool.check_usable()
        started = time.monotonic()
        token = f"{self._instance}.{next(self._call_ids)}"
        line = line_for(token)
        if counted:  # else counted by the caller, or not a call (a trial of the walls)
            self._calls_started += 1
        self._in_flight += 1
        try:
            return await self._attempt(
                line,
                token,
                stdin=stdin,
                started=started,
                deadline=started + timeout,
                limits=(stdout_limit, stderr_limit),
            )
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and not self.pool.is_open():
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
        owner = remote.CallOwner(token)
        pool = self.pool
        refusals = 0
        while True:
            pool.check_usable()
            # Fast path: a free slot and nobody queued (FIFO): no waiting, no timer.
            lease = pool.try_acquire(owner)
            if lease is None:
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    lease = await pool.lease(owner)
                if lease is None:
                    return self._busy_result(started)
            connection = lease.resource
            try:
                channel, protocol = await self._open(connection, line, limits)
            except asyncssh.ChannelOpenError as exc:
                pool.release(lease)
                refusals += 1
                pool.channel_refused(connection, exc.reason)
                if refusals > self.config.channel_open_retries:
                    raise BackendUnavailable(
                        f"{self.name} refused {refusals} channel opens in a row ({exc.reason});"
                        " is max_channels_per_connection above sshd's MaxSessions?",
                        backend="ssh",
                        host=self.name,
                    ) from exc
                delay = backoff_delay(
                    refusals, first=self.config.retry_backoff, ceiling=self.config.retry_backoff_max
                )
                with anyio.move_on_after(min(delay, max(0.0, deadline - time.monotonic()))):
                    await pool.closing.wait()
                continue
            except BaseException:
                pool.release(lease)
                raise
            pool.channel_opened(connection)
            try:
                return await self._drive(
                    connection, channel, protocol, token, stdin, started, deadline
                )
            finally:
                pool.release(lease)

    async def _open(
        self, connection: SSHConnection, line: str, limits: tuple[int, int]
    ) -> tuple[asyncssh.SSHClientChannel[bytes], _CommandChannel]:
        return await open_channel(
            connection, line, limits, host=self.name, open_timeout=self.config.connect_timeout
        )

    def _connection_added(self) -> None:
        self._kills.schedule_orphan_cleanup()
        self.owner_lock.connection_added()

    async def _maintenance(
        self,
        connection: SSHConnection,
        line: str,
        timeout: float,  # noqa: ASYNC109 - passed on to run_maintenance
    ) -> _CommandChannel | None:
        return await run_maintenance(
            connection,
            line,
            host=self.name,
            open_timeout=self.config.connect_timeout,
            timeout=timeout,
        )

    async def _drive(
        self,
        connection: SSHConnection,
        channel: asyncssh.SSHClientChannel[bytes],
        protocol: _CommandChannel,
        token: str,
        stdin: bytes | None,
        started: float,
        deadline: float,
    ) -> CommandResult:
        connection.open_channels += 1
        self._running.add(protocol)
        if not self.pool.is_open():
            protocol.stop()  # stop began while the channel was opening
        try:
            if stdin is not None:  # else the remote stdin is /dev/null (see the prologue)
                with contextlib.suppress(OSError, asyncssh.Error):
                    channel.write(stdin)
                    channel.write_eof()
            loop = asyncio.get_running_loop()
            timer = loop.call_at(
                loop.time() + max(0.0, deadline - time.monotonic()), protocol.expire
            )
            try:
                await protocol.wake.wait()
            except BaseException:  # the caller was cancelled: no remote orphan
                with anyio.CancelScope(shield=True):
                    await self._kills.terminate(connection, channel, protocol, token)
                raise
            finally:
                timer.cancel()
            terminated = not protocol.closed.is_set()  # timed out, or the pool is stopping
            if terminated:
                with anyio.CancelScope(shield=True):
                    await self._kills.terminate(connection, channel, protocol, token)
        finally:
            connection.open_channels -= 1
            self._running.discard(protocol)
        if terminated and protocol.stopping:
            raise PoolClosed(f"{self.name} was closed while the call was running")
        timed_out = terminated
        ended = protocol.exit_status is not None or protocol.exit_signal is not None
        if not ended and (connection.lost or not timed_out):
            self._kills.note_orphan(token)  # its processes may still run remotely
            cause = describe(protocol.error) if protocol.error is not None else "channel closed"
            raise WorkerLost(
                f"connection #{connection.serial} to {self.name} was lost during the call ({cause})",
                worker=f"{self.name}#{connection.serial}",
                cause=cause,
                backend="ssh",
                host=self.name,
            )
        return CommandResult(
            exit_status=protocol.exit_status,
            signal=protocol.exit_signal or ("KILL" if timed_out and not ended else None),
            stdout=protocol.stdout.result(),
            stderr=protocol.stderr.result(),
            duration=time.monotonic() - started,
            timed_out=timed_out,
            host=self.name,
        )

    # -- before the first call: owner records, walls ------------------------------------------

    async def _check_first_use(self, *, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Return once this host took its owner lock and swept what dead owners left (once;
        a failure of either is logged, never fatal), and, under ``isolation = "namespaces"``,
        once a trial sandbox ran; :class:`SandboxUnavailable` (naming what the host lacks)
        while it cannot. Single-flight: callers that find it under way wait for it, up to
        ``timeout`` (then False: the call did not start); the caller that runs it runs it to
        its end (each step has its own bound), so that a short call does not cut it short."""
        if self._owners_swept and (self._walls_ready or not self._walled):
            return True
        self._first_use_waiting += 1  # in flight, for placement: they run next
        try:
            acquired = False
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await self._first_use.acquire()
                acquired = True
            if not acquired:
                return False
            try:
                if not self._owners_swept:
                    await self._take_ownership()
                if self._walled:
                    await self._trial_sandbox()
            finally:
                self._first_use.release()
        finally:
            self._first_use_waiting -= 1
        return True

    async def _take_ownership(self) -> None:
        """Take this owner's lock on the host and sweep what dead owners left there
        (:mod:`.owners`: on a connection of its own), while the pool opens a connection as for
        a call: a host that cannot be reached fails here as a call would (counted towards
        marking it down; the first-use check runs again on the next call), in the time of
        one handshake, not two. The lease is held until the sweep is done, so that the
        connection is not reaped before the call that waits for it. Raises only what
        leasing raises."""
        self.pool.check_usable()
        timeout = self.config.file_op_timeout
        self._in_flight += 1  # so that a close waits for it
        try:
            lease = None
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(self.owner_lock.take, timeout=timeout))
                try:
                    with anyio.move_on_after(timeout):
                        lease = await self.pool.lease(remote.CallOwner(f"{self._instance}.owners"))
                except (BackendUnavailable, PoolClosed) as exc:
                    failure = exc
                if lease is None:
                    tg.cancel_scope.cancel()
            if lease is None:
                raise failure or BackendUnavailable(
                    f"no SSH channel to {self.name} became free within {timeout:g} s",
                    backend="ssh",
                    host=self.name,
                )
            self.pool.release(lease)
            if not self.owner_lock.refused():
                self.pool.background.spawn(self.owner_lock.keep, "owner lock")
            self._owners_swept = True
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and not self.pool.is_open():
                self._calls_done.set()

    async def _trial_sandbox(self) -> None:
        """Run ``true`` in a sandbox, unless a caller that held the lock before did."""
        if self._walls_ready:
            return
        timeout = self.config.file_op_timeout
        trial = Command(argv=("true",), timeout=timeout)
        result = await self._execute(
            functools.partial(
                remote.sandboxed_command_line,
                trial,
                base_env=self.config.env,
                shell=self.config.shell,
                workspace=None,
                limits=self.config.limits,
            ),
            stdin=None,
            timeout=timeout,
            stdout_limit=4096,
            stderr_limit=4096,
            counted=False,
        )
        if result.exit_status == 0:
            self._walls_ready, self._walls_refused = True, False
            return
        if result.timed_out:
            raise ToolTimeout(
                f"checking the walls on {self.name} did not finish within {timeout:g} s",
                timeout=timeout,
                backend="ssh",
                host=self.name,
            )
        diagnosis = await self._script(
            remote.Script(walls.DIAGNOSE, ("bwrap",), "checking the walls"), counted=False
        )
        missing = walls.missing_on_host(
            diagnosis.stdout.data.decode("utf-8", "replace"), result.stderr.text()
        )
        self._walls_refused = True
        raise SandboxUnavailable(
            f"isolation = 'namespaces' cannot be enforced on {self.name}; missing: "
            + "; ".join(missing),
            missing=missing,
            backend="ssh",
            host=self.name,
        )

    def _workspace_of(self, cwd: str | None) -> str | None:
        """The workspace of this host that ``cwd`` is in (None: in none, or no ``cwd``). Only
        picks what to bind: the kernel keeps the command inside it."""
        path = cwd
        for _ in range(256):
            if path is None or path in self._workspaces:
                return path
            parent = posixpath.dirname(path)
            if parent == path:
                return None
            path = parent
        return None

    def _outside_workspace(self) -> CommandResult:
        message = (
            b"cannot run: under isolation = 'namespaces' the working directory must be inside "
            b"a session workspace"
        )
        return CommandResult(
            exit_status=126, stderr=Output(message, len(message), False), host=self.name
        )

    def _busy_result(self, started: float) -> CommandResult:
        return CommandResult.not_started(
            self.name, time.monotonic() - started, f"no SSH channel to {self.name} became free"
        )

    # -- files --------------------------------------------------------------------------------

    async def _script(self, script: remote.Script, *, counted: bool = True) -> CommandResult:
        timeout = self.config.file_op_timeout
        line_for = functools.partial(
            remote.script_line,
            script.script,
            script.args,
            base_env=self.config.env,
            stdin=script.stdin is not None,
        )
        result = await self._execute(
            line_for,
            stdin=script.stdin,
            timeout=timeout,
            stdout_limit=script.limit,
            stderr_limit=4096,
            counted=counted,
        )
        if result.timed_out:
            raise ToolTimeout(
                f"{script.what} on {self.name} did not finish within {timeout:g} s",
                timeout=timeout,
                backend="ssh",
                host=self.name,
            )
        return result

    async def make_workspace(self) -> str:
        # Owner records first; a session on a host that cannot wall its commands: refused now.
        await self._check_first_use()
        path = await self._files.make_workspace(self.config.workspace_root, self._instance)
        if not self.pool.is_open():  # closed while it was being made: do not leak it
            raise PoolClosed(f"{self.name} is closed")
        self._workspaces.add(path)
        return path

    async def remove_workspace(self, path: str) -> None:
        """Remove a workspace this host made; any other path is left alone (never removed)."""
        if path not in self._workspaces:
            return
        await self._files.remove_tree(path)
        self._workspaces.discard(path)

    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        return await self._files.read_file(workspace, path, limit=limit)

    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        await self._files.write_file(workspace, path, data, make_parents=make_parents)

    async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
        return await self._files.list_dir(workspace, path)
