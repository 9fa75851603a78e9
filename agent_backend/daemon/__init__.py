"""The tool-execution daemon: one :class:`~agent_backend.dispatch.Dispatcher` behind an HTTP API.

``agent-backend serve`` runs it; :class:`agent_backend.Client` calls it. See
``docs/daemon.md``. Everything here sits on the public API of
``dispatch``, ``pool`` and ``tools``, and nothing below imports it.
"""

from agent_backend.daemon.app import DaemonApp, DaemonState, create_app
from agent_backend.daemon.background import BackgroundDaemon, run_in_thread
from agent_backend.daemon.server import DaemonServer
from agent_backend.daemon.settings import DaemonSettings
from agent_backend.tokens import TokenSource, default_token_path, is_loopback, load_token

__all__ = [
    "BackgroundDaemon",
    "DaemonApp",
    "DaemonServer",
    "DaemonSettings",
    "DaemonState",
    "TokenSource",
    "create_app",
    "default_token_path",
    "is_loopback",
    "load_token",
    "run_in_thread",
]
