"""The local backend: tool commands run as subprocesses of this process, on this machine.

The package, one job per module:

* :mod:`.config`: :class:`LocalPoolConfig` (``type = "local"``), pure data;
* :mod:`.backend`: :class:`LocalBackend` and its one :class:`LocalHost`: admission,
  workspaces, file tools, the sandboxes' lifecycle;
* :mod:`.command`: one command from its spawn to its result, in its own process group;
* :mod:`.process`: the child process and its pipes;
* :mod:`.spawn`: the spawner thread (libc's ``posix_spawn``, off the event loop);
* :mod:`.owner`: who owns a workspace, so a successor removes what a dead backend left;
* :mod:`.workspaces`: making and removing workspaces, and the spares made ahead;
* :mod:`.files`: the file tools beneath a workspace's descriptor (``openat2``); its source
  also runs on SSH hosts, so it imports only the standard library;
* :mod:`.sandbox`: a session's sandbox and its agent, under ``isolation = "namespaces"``.

:mod:`.backend` says what the backend guarantees and must never do.
"""

from __future__ import annotations

from agent_backend.backends.local.backend import LocalBackend, LocalHost, LocalStatistics
from agent_backend.backends.local.config import LocalPoolConfig

__all__ = ["LocalBackend", "LocalHost", "LocalPoolConfig", "LocalStatistics"]
