"""The daemon's sessions: :class:`~agent_backend.dispatch.Session`\\ s by id, owned by a token.

A session opened with one token is invisible to every other token (404, as
if it did not exist). Each token may hold ``max_per_token`` sessions; one
more is refused with :class:`~agent_backend.errors.TooManySessions` (429,
``Retry-After``: closing one, or the reaper, makes room). A session opened
``counted=False`` (a token's one stateless MCP session) is outside that cap,
so that a token at its cap can still make stateless calls; there is at most
one per token, so the sessions a token can hold stay bounded. A session the
dispatcher reaped for idleness is forgotten on next sight and answered with
:class:`~agent_backend.errors.PoolClosed` (410) once, then 404.
This module must never hand one token's session to another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import anyio

from agent_backend.dispatch import Dispatcher, Session
from agent_backend.errors import NotFound, PoolClosed, TooManySessions

__all__ = ["SessionTable"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Owned:
    session: Session
    principal: str
    counted: bool = True
    """Whether it counts against the token's ``max_per_token``."""


class SessionTable:
    def __init__(
        self, dispatcher: Dispatcher, *, max_per_token: int, retry_after: float = 1.0
    ) -> None:
        self.dispatcher = dispatcher
        self.max_per_token = max_per_token
        self.retry_after = retry_after
        """The ``Retry-After`` of a refusal at the cap."""
        self._sessions: dict[str, _Owned] = {}
        self._opening: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<SessionTable [sessions: {len(self._sessions)} | opening: {sum(self._opening.values())}]>"

    def __len__(self) -> int:
        return len(self._sessions)

    def _count(self, principal: str) -> int:
        for sid, owned in list(self._sessions.items()):
            if owned.session.is_closed():
                del self._sessions[sid]
        owned_now = sum(
            1 for owned in self._sessions.values() if owned.principal == principal and owned.counted
        )
        return owned_now + self._opening.get(principal, 0)

    @contextlib.contextmanager
    def _reserving(self, principal: str, n: int) -> Iterator[None]:
        """Count ``n`` sessions of ``principal`` as open while they are being made."""
        self._opening[principal] = self._opening.get(principal, 0) + n
        try:
            yield
        finally:
            self._opening[principal] -= n
            if not self._opening[principal]:
                del self._opening[principal]

    def _too_many(self, message: str) -> TooManySessions:
        return TooManySessions(message, limit=self.max_per_token, retry_after=self.retry_after)

    async def open(self, principal: str, *, counted: bool = True) -> Session:
        """A new open session of ``principal``; ``counted=False``: outside its cap (see above)."""
        if counted and self._count(principal) >= self.max_per_token:
            raise self._too_many(
                f"this token has {self.max_per_token} sessions open, the most it may; close one "
                "(idle ones are closed after the daemon's session_ttl) and retry"
            )
        with self._reserving(principal, 1) if counted else contextlib.nullcontext():
            session = self.dispatcher.session()
            await session.open()
        self._sessions[session.id] = _Owned(session, principal, counted)
        return session

    async def fork(self, principal: str, session_id: str, n: int) -> list[Session]:
        """``n`` new sessions of ``principal``, each starting as a copy of its session
        ``session_id``'s workspace; each counts against the token's sessions."""
        session = self.get(principal, session_id)
        if self._count(principal) + n > self.max_per_token:
            raise self._too_many(
                f"this token may have {self.max_per_token} sessions open; {n} more would pass "
                "that: close some first"
            )
        with self._reserving(principal, n):
            forks = await session.fork(n)
        for fork in forks:
            self._sessions[fork.id] = _Owned(fork, principal)
        return forks

    def get(self, principal: str, session_id: str) -> Session:
        owned = self._sessions.get(session_id)
        if owned is None or owned.principal != principal:
            raise NotFound(f"no session {session_id!r}; open one with POST /v1/sessions")
        if owned.session.is_closed():
            del self._sessions[session_id]
            raise PoolClosed(f"session {session_id!r} was closed (idle too long); open a new one")
        return owned.session

    async def close(self, principal: str, session_id: str) -> None:
        owned = self._sessions.get(session_id)
        if owned is None or owned.principal != principal:
            raise NotFound(f"no session {session_id!r}")
        del self._sessions[session_id]
        await owned.session.aclose()

    async def aclose(self) -> None:
        """Close every session (concurrently); idempotent."""
        owned, self._sessions = list(self._sessions.values()), {}
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for item in owned:
                    group.start_soon(item.session.aclose)
