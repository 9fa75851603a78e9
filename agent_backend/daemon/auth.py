"""Who may call the daemon: the bearer-token check on every request.

Every request but liveness must carry ``Authorization: Bearer <token>``,
compared with :func:`hmac.compare_digest` against every configured token
(where tokens come from: :mod:`agent_backend.tokens`).

This module must never log or echo a token, and never let a request
through without a match.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from agent_backend.daemon.errors import send_error
from agent_backend.errors import Unauthorized
from agent_backend.wire import API_PREFIX

__all__ = ["DISCOVERY_PREFIX", "OPEN_PATHS", "PRINCIPAL_KEY", "BearerAuth", "principal_of"]

#: The ASGI scope key the authenticated caller's id is put under.
PRINCIPAL_KEY: Final = "agent_backend.principal"
#: Paths answered without a token: liveness only.
OPEN_PATHS: Final = frozenset({f"{API_PREFIX}/health/live"})
#: Paths under this prefix reach the app without a token (it has none there: 404).
DISCOVERY_PREFIX: Final = "/.well-known/"


def principal_of(token: str) -> str:
    """A short, non-secret id for a token (metrics labels, limits, session ownership)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


class BearerAuth:
    """ASGI middleware: 401 for any request without a valid bearer token (liveness excepted)."""

    def __init__(self, app: ASGIApp, *, tokens: Sequence[str]) -> None:
        if not tokens:
            raise ValueError("BearerAuth needs at least one token")
        self.app = app
        self._tokens = [(token.encode(), principal_of(token)) for token in tokens]

    def _principal(self, scope: Scope) -> str | None:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, presented = header.partition(b" ")
        if scheme.lower() != b"bearer" or not presented:
            return None
        presented = presented.strip()
        found = None
        for token, principal in self._tokens:  # every token compared: no early exit
            if hmac.compare_digest(presented, token):
                found = principal
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # no websocket routes; refuse before anything
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if scope["path"] in OPEN_PATHS or scope["path"].startswith(DISCOVERY_PREFIX):
            # Discovery documents (OAuth metadata that MCP clients probe for) do not exist
            # here: a 404 says "no OAuth", where a 401 sends clients into an OAuth flow.
            await self.app(scope, receive, send)
            return
        principal = self._principal(scope)
        if principal is None:
            await send_error(send, Unauthorized("missing or wrong bearer token"))
            return
        scope[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)
