"""MCP sessions over HTTP: each ``Mcp-Session-Id`` is one agent_backend session.

An ``initialize`` opens an :class:`McpSession`: a fresh id (random, not
guessable) bound to the token that sent it, the protocol version it
negotiated, and a :class:`~agent_backend.dispatch.Session` (its own
workspace) opened through the daemon's :class:`SessionTable`, so MCP
sessions count against the same ``max_sessions_per_token`` as
``POST /v1/sessions``. A ``DELETE`` closes it; the dispatcher's idle reaper
closes it after ``session_ttl`` without a call, and from then on its id is
404 (the client initializes anew, as the spec says).

A client that sends no ``Mcp-Session-Id`` (a stateless one) is served in
its token's *stateless session*: one per token, opened at its first call,
reaped when idle like any other, and opened afresh (an empty workspace)
on the call after a reap. It does not count against
``max_sessions_per_token`` (one per token at most, so still bounded): a
token whose sessions fill its cap can still make stateless calls.

Each session keeps the cancel scopes of its requests in flight, so that a
``notifications/cancelled`` naming one ends it. This module must never
hand one token's session to another, and never keep a closed session's id
answering.
"""

from __future__ import annotations

import dataclasses
import secrets

import anyio

from agent_backend.daemon.sessions import SessionTable
from agent_backend.dispatch import Session
from agent_backend.errors import NotFound

__all__ = ["McpSession", "McpSessions"]

RequestId = int | str


@dataclasses.dataclass(eq=False)
class McpSession:
    """One MCP session: its id, owner, negotiated version, workspace session and calls in flight."""

    id: str
    """The ``Mcp-Session-Id`` ("" for a token's stateless session)."""
    principal: str
    version: str
    session: Session
    calls: dict[RequestId, anyio.CancelScope] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"<McpSession {self.id or '(stateless)'} {self.version} {self.session.id}"
            f" [calls: {len(self.calls)} in flight]{' closed' if self.is_closed() else ''}>"
        )

    def is_closed(self) -> bool:
        return self.session.is_closed()

    def end_calls(self) -> None:
        """End every request in flight (the session is ending: no one waits for them)."""
        for scope in self.calls.values():
            scope.cancel()

    def cancel(self, request_id: RequestId) -> bool:
        """End request ``request_id`` if it is in flight here; whether it was."""
        scope = self.calls.get(request_id)
        if scope is None:
            return False
        scope.cancel()
        return True


class McpSessions:
    """The daemon's MCP sessions by id, and one stateless session per token."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table
        self._sessions: dict[str, McpSession] = {}
        self._stateless: dict[str, McpSession] = {}
        self._stateless_locks: dict[str, anyio.Lock] = {}

    def __repr__(self) -> str:
        return (
            f"<McpSessions [sessions: {len(self._sessions)} | stateless: {len(self._stateless)}]>"
        )

    def __len__(self) -> int:
        return len(self._sessions)

    def _prune(self) -> None:
        for sid, mcp in list(self._sessions.items()):
            if mcp.is_closed():
                del self._sessions[sid]

    async def create(self, principal: str, version: str) -> McpSession:
        """A new MCP session for ``principal`` (raises ``TooManySessions`` past the limit)."""
        self._prune()
        session = await self.table.open(principal)
        mcp = McpSession(secrets.token_urlsafe(24), principal, version, session)
        self._sessions[mcp.id] = mcp
        return mcp

    def get(self, principal: str, session_id: str) -> McpSession:
        """The open session ``session_id`` of ``principal``; :class:`NotFound` (404) otherwise."""
        mcp = self._sessions.get(session_id)
        if mcp is None or mcp.principal != principal:
            raise NotFound(
                "no such MCP session (it was closed, or never existed); "
                "send a new initialize request without Mcp-Session-Id"
            )
        if mcp.is_closed():
            del self._sessions[session_id]
            raise NotFound(
                "this MCP session was closed after it sat idle past the daemon's session TTL "
                "(its workspace is gone); send a new initialize request without Mcp-Session-Id"
            )
        return mcp

    async def stateless(self, principal: str, version: str) -> McpSession:
        """``principal``'s stateless session, opened now if it has none (or it was reaped)."""
        mcp = self._stateless.get(principal)
        if mcp is not None and not mcp.is_closed():
            return mcp
        lock = self._stateless_locks.setdefault(principal, anyio.Lock())
        async with lock:  # one open per token at a time: concurrent first calls share it
            mcp = self._stateless.get(principal)
            if mcp is None or mcp.is_closed():
                session = await self.table.open(principal, counted=False)
                mcp = McpSession("", principal, version, session)
                self._stateless[principal] = mcp
        return mcp

    def stateless_of(self, principal: str) -> McpSession | None:
        """``principal``'s open stateless session, if it has one (no opening)."""
        mcp = self._stateless.get(principal)
        return mcp if mcp is not None and not mcp.is_closed() else None

    async def close(self, principal: str, session_id: str) -> None:
        """End ``session_id``: its calls are ended and its workspace removed."""
        mcp = self.get(principal, session_id)
        del self._sessions[session_id]
        mcp.end_calls()  # answered 202, like a cancellation, not with a result
        await self.table.close(principal, mcp.session.id)

    def forget(self) -> None:
        """Drop every record (the session table closes the sessions themselves)."""
        self._sessions.clear()
        self._stateless.clear()
