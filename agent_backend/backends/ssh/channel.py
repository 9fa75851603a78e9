"""The asyncssh side of the SSH backend: connections, and the protocol of one command channel.

:class:`SSHConnector` is the pool's connector: it opens connections to the
configured host, port and user only (``~/.ssh/config`` is never read), with
host keys verified unless ``insecure_skip_host_key_check`` says so, and closes
them. :func:`open_channel` starts one remote command on a connection;
:class:`_CommandChannel` collects its output into bounded buffers.

This module must never let an asyncssh exception reach a caller (they are
mapped to :mod:`agent_backend.errors`, except :class:`asyncssh.ChannelOpenError`,
which the host retries), nor abandon a half-opened channel.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import anyio
import asyncssh

from agent_backend.backends._errors import describe, map_exceptions
from agent_backend.backends.ssh.config import SSHHostConfig
from agent_backend.backends.ssh.pool import PooledConnection
from agent_backend.dispatch.output import OutputBuffer
from agent_backend.errors import BackendUnavailable, ConfigError, WorkerLost

__all__ = ["SSHConnection", "SSHConnector", "open_channel", "run_maintenance"]

logger = logging.getLogger("agent_backend.backends.ssh")

_CLOSE_WAIT = 2.0
# Handshake errors that retrying cannot fix (configuration, not the network).
_FATAL_CONNECT_ERRORS: tuple[type[Exception], ...] = (
    asyncssh.HostKeyNotVerifiable,
    asyncssh.PermissionDenied,
    asyncssh.KeyExchangeFailed,
)


class _Client(asyncssh.SSHClient):
    """Tells the pool, synchronously, when its connection dies."""

    def __init__(self) -> None:
        self.lost = False
        self.on_lost: Callable[[Exception | None], None] | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(exc)


class SSHConnection(PooledConnection):
    """One pooled asyncssh connection."""

    __slots__ = ("client", "conn", "peer")

    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client, serial: int) -> None:
        super().__init__(serial)
        self.conn = conn
        self.client = client
        self.peer: Any = conn.get_extra_info("peername")

    def watch(self, on_lost: Callable[[Exception | None], None] | None) -> None:
        self.client.on_lost = on_lost

    def has_died(self) -> bool:
        return self.client.lost


class SSHConnector:
    """Opens and closes the connections of one host (the pool's :class:`Connector`)."""

    def __init__(self, config: SSHHostConfig, username: str, name: str) -> None:
        self.config = config
        self.username = username
        self.name = name
        self.handshakes = 0
        """Handshake attempts (retries and probes included)."""
        self.handshake_failures = 0
        self._serials = itertools.count(1)
        self._algorithms: dict[str, Any] = (
            {"encryption_algs": "^" + ",".join(config.preferred_ciphers)}
            if config.preferred_ciphers
            else {}
        )
        self._known_hosts: Any = ()
        self._client_keys: Any = ()

    def load_credentials(self) -> None:
        """Read known_hosts and the client keys. Blocking: call it in a thread, once."""
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
        self._known_hosts, self._client_keys = known_hosts, client_keys

    async def connect(self) -> SSHConnection:
        config = self.config
        client = _Client()
        self.handshakes += 1
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
            self.handshake_failures += 1
            raise
        return SSHConnection(conn, client, next(self._serials))

    async def close(self, connection: SSHConnection) -> None:
        connection.watch(None)
        connection.conn.close()
        await wait_closed(connection)

    def is_fatal(self, exc: BackendUnavailable) -> bool:
        return isinstance(exc.__cause__, _FATAL_CONNECT_ERRORS)

    def sibling(self) -> SSHConnector:
        """A connector to the same host, user and port with the credentials already loaded,
        and counters of its own: for the owner lock's connection, which the pool does not
        count (:mod:`.owners`)."""
        other = SSHConnector(self.config, self.username, self.name)
        other._known_hosts, other._client_keys = self._known_hosts, self._client_keys
        return other


async def wait_closed(connection: SSHConnection) -> None:
    """Wait (bounded) for a closed connection to finish closing, else abort it."""
    with anyio.move_on_after(_CLOSE_WAIT) as bound:
        await connection.conn.wait_closed()
    if bound.cancelled_caught:
        connection.conn.abort()


class _CommandChannel(asyncssh.SSHClientSession[bytes]):
    """The protocol of one channel running one remote command: output, how it ended."""

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


async def open_channel(
    connection: SSHConnection,
    line: str,
    limits: tuple[int, int],
    *,
    host: str,
    open_timeout: float,
    protocol: _CommandChannel | None = None,
) -> tuple[asyncssh.SSHClientChannel[bytes], _CommandChannel]:
    """Open a channel running ``line`` (its output kept within ``limits``, or by ``protocol``
    when given). Shielded: a half-opened channel is never abandoned; the caller's
    cancellation or deadline takes effect right after (and kills the command)."""
    if protocol is None:
        protocol = _CommandChannel(*limits)
    session = protocol
    # A connection that cannot open a channel within open_timeout is sick: drop it
    # (it leaves the table in connection_lost, and this open fails as WorkerLost).
    watchdog = asyncio.get_running_loop().call_later(open_timeout, connection.conn.abort)
    try:
        with (
            map_exceptions(
                {(OSError, asyncssh.Error): WorkerLost},
                message=f"connection to {host} failed while opening a channel",
                backend="ssh",
                host=host,
                ignore=(asyncssh.ChannelOpenError,),
            ),
            anyio.CancelScope(shield=True),
        ):
            channel, _ = await connection.conn.create_session(lambda: session, line, encoding=None)
    except WorkerLost as exc:
        exc.worker = f"{host}#{connection.serial}"
        raise
    finally:
        watchdog.cancel()
    return channel, protocol


async def run_maintenance(
    connection: SSHConnection,
    line: str,
    *,
    host: str,
    open_timeout: float,
    timeout: float,  # noqa: ASYNC109 - a bound that yields None, not TimeoutError as fail_after would
) -> _CommandChannel | None:
    """A short maintenance command outside the lease table; None if it failed."""
    try:
        with anyio.move_on_after(timeout):
            _, protocol = await open_channel(
                connection, line, (4096, 4096), host=host, open_timeout=open_timeout
            )
            await protocol.closed.wait()
            return protocol
    except Exception as exc:
        logger.debug("%s: maintenance command failed: %s", host, describe(exc))
    return None
