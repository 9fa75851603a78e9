"""A client for the daemon with the same calls as :class:`~agent_backend.dispatch.Dispatcher`.

Switching between in-process and remote execution is one line::

    runner = Dispatcher(registry, pool)            # in this process
    runner = Client("http://127.0.0.1:8765")       # through a daemon
    async with runner:
        result = await runner.call(("exec", {"command": "ls"}))
        async with runner.session() as session:
            await session.call(("write_file", {"path": "a.txt", "content": "hi"}))

:class:`Client` (in :mod:`~agent_backend.client.remote`) talks HTTP to the
daemon, with retries under an idempotency key; :class:`SyncClient` (in
:mod:`~agent_backend.client.sync`) is the same client for code without an
event loop.
"""

from agent_backend.client.remote import DEFAULT_URL, URL_ENV, Client, RemoteSession, ToolsFormat
from agent_backend.client.sync import SyncClient, SyncSession

__all__ = [
    "DEFAULT_URL",
    "URL_ENV",
    "Client",
    "RemoteSession",
    "SyncClient",
    "SyncSession",
    "ToolsFormat",
]
