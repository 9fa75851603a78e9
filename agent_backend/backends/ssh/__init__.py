"""The SSH backend: commands and files on remote hosts, over pooled asyncssh connections.

The package, one job per module:

* :mod:`.config`: the pydantic pool and host configuration, and the statistics;
* :mod:`.pool`: one host's connection pool, a synchronous lease/reap/reconnect
  state machine that does its I/O through a connector (testable without a network);
* :mod:`.channel`: asyncssh: the connector, and the protocol of one command channel;
* :mod:`.remote`: command lines, the kill script, file operations as shell scripts;
* :mod:`.host`: :class:`SSHHost`, calls, remote kills and orphans;
* :mod:`.backend`: :class:`SSHBackend`, the hosts' lifecycle.

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

    callers ──► lease() ───► LeaseTable.acquire()  ── lease ──► channel ──► remote command
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

This package must never: close a connection that holds a lease; start a
pool connection after stop began; resurrect a closed connection; connect anywhere
but the configured host, port and user; skip host-key verification unless
``insecure_skip_host_key_check`` says so; let an asyncssh exception reach a
caller (they are mapped to :mod:`agent_backend.errors`); or leave a remote
process of a timed-out or cancelled call running.
"""

from agent_backend.backends.ssh.backend import SSHBackend
from agent_backend.backends.ssh.config import (
    SSHHostConfig,
    SSHHostSettings,
    SSHHostStats,
    SSHPoolConfig,
    SSHStatistics,
)
from agent_backend.backends.ssh.host import SSHHost

__all__ = [
    "SSHBackend",
    "SSHHost",
    "SSHHostConfig",
    "SSHHostSettings",
    "SSHHostStats",
    "SSHPoolConfig",
    "SSHStatistics",
]
