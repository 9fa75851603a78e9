"""The daemon's client for code without an event loop: :class:`SyncClient`, :class:`SyncSession`.

The same calls as :class:`~agent_backend.client.Client` (it is one, run on an
event loop of its own on a private thread, through an anyio blocking portal).
This module must never run a call on the caller's thread (the portal's loop
owns the connections) and must stop that thread at :meth:`SyncClient.close`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

import anyio.from_thread

from agent_backend.client.remote import Client, RemoteSession, ToolsFormat
from agent_backend.lifecycle import SyncResource
from agent_backend.wire import Readiness, ToolResult

if TYPE_CHECKING:
    from agent_backend.dispatch import CallLike

__all__ = ["SyncClient", "SyncSession"]


class SyncClient(SyncResource):
    """:class:`Client` for code without an event loop; its loop runs on a private thread.

    ``with SyncClient(url) as client: client.call(("exec", {"command": "ls"}))``.
    ``options`` are :class:`Client`'s, and so is what a call does when the daemon is at
    its limit: a refusal with ``Retry-After`` is waited on (the caller's thread blocks)
    until ``busy_timeout``, or the call's ``timeout`` plus 5 s, then raised.
    """

    def __init__(self, url: str | None = None, **options: Any) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self.client = Client(url, **options)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False

    def __repr__(self) -> str:
        return f"<SyncClient {self.client.url}{' closed' if self._closed else ''}>"

    def close(self) -> None:
        """Close the connections and stop the private thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self.client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,
        session: SyncSession | None = None,
        idempotency_key: str | None = None,
    ) -> ToolResult:
        remote = session.remote if session is not None else None
        return self._portal.call(
            lambda: self.client.call(
                call, timeout=timeout, session=remote, idempotency_key=idempotency_key
            )
        )

    def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,
        session: SyncSession | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        remote = session.remote if session is not None else None
        items = list(calls)
        return self._portal.call(
            lambda: self.client.call_many(
                items, timeout=timeout, session=remote, idempotency_key=idempotency_key
            )
        )

    def session(self) -> SyncSession:
        """``with client.session() as session: session.call(...)``."""
        return SyncSession(self)

    def tools(self, format: ToolsFormat = "openai") -> list[dict[str, Any]]:
        return self._portal.call(self.client.tools, format)

    def ready(self) -> Readiness:
        return self._portal.call(self.client.ready)


class SyncSession(SyncResource):
    """A :class:`RemoteSession` for :class:`SyncClient`."""

    def __init__(self, owner: SyncClient) -> None:
        self.owner = owner
        self.remote = RemoteSession(owner.client)

    def __repr__(self) -> str:
        return repr(self.remote).replace("RemoteSession", "SyncSession", 1)

    @property
    def id(self) -> str:
        return self.remote.id

    def __enter__(self) -> Self:
        self.open()
        return self

    def open(self) -> None:
        self.owner._portal.call(self.remote.open)

    def close(self) -> None:
        self.owner._portal.call(self.remote.aclose)

    def call(
        self, call: CallLike, *, timeout: float | None = None, idempotency_key: str | None = None
    ) -> ToolResult:
        return self.owner.call(call, timeout=timeout, session=self, idempotency_key=idempotency_key)

    def call_many(
        self,
        calls: Iterable[CallLike],
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> list[ToolResult]:
        return self.owner.call_many(
            calls, timeout=timeout, session=self, idempotency_key=idempotency_key
        )
