"""The SSH backend: commands and files on remote hosts, over pooled asyncssh connections.

The package, one job per module:

* :mod:`.config`: the pydantic pool and host configuration, and the statistics;
* :mod:`.pool`: one host's connection pool, a synchronous lease/reap/reconnect
  state machine that does its I/O through a connector (testable without a network);
* :mod:`.ramp`: the pacing of new handshakes (slots, spacing, backoff after failures);
* :mod:`.channel`: asyncssh: the connector, and the protocol of one command channel;
* :mod:`.remote`: command lines, the kill script, file operations as shell scripts;
* :mod:`.walls`: the ``namespaces`` tier: its guarantees, what a host lacks for it;
* :mod:`.host`: :class:`SSHHost`, calls, remote kills and orphans;
* :mod:`.backend`: :class:`SSHBackend`, the hosts' lifecycle.

Per host (:class:`SSHHost`) a pool of connections, each carrying at most
``max_channels_per_connection`` concurrent channels (one channel per call);
how the pool leases, reaps and reconnects is drawn in :mod:`.pool`, how a call
ends its remote processes in :mod:`.host` and :mod:`.remote`, how the backend
stops in :mod:`.backend`. A re-created connection is always to the configured
host, port and user (``~/.ssh/config`` is never read).

Remote hosts need a POSIX shell and GNU coreutils/findutils/procps (any Linux); under
``isolation = "namespaces"`` also bubblewrap and user namespaces for the login user
(docs/sandboxes.md, "SSH hosts").

This package must never: close a connection that holds a lease; start a
pool connection after stop began; resurrect a closed connection; connect anywhere
but the configured host, port and user; skip host-key verification unless
``insecure_skip_host_key_check`` says so; let an asyncssh exception reach a
caller (they are mapped to :mod:`agent_backend.errors`); leave a remote
process of a timed-out or cancelled call running; or run a model's command of a
``namespaces`` pool outside its sandbox.
"""

import warnings

with warnings.catch_warnings():
    # asyncssh imports cryptography's DSA support when it is imported, and cryptography 51
    # deprecates DSA: a warning nobody using this package can act on (OpenSSH refuses DSA
    # keys by default), which `python -W error` turns into an ImportError-like failure.
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    import asyncssh  # noqa: F401

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
