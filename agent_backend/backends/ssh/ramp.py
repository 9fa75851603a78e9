"""How one host's connections are opened: a few handshakes at a time, spaced, retried with backoff.

sshd drops bursts of new connections (``MaxStartups 10:30:100``: past 10
unauthenticated connections it refuses a growing share of new ones), so a
burst of callers at a cold pool must not become a burst of handshakes. A
:class:`HandshakeRamp` lets at most ``max_concurrent_handshakes`` run at once,
starts them at least ``handshake_interval`` apart, and after a failed one
waits a backoff (doubled per failure, with jitter, up to ``retry_backoff_max``)
that every later handshake to the host honours too.

This module must never retry a failure the connector calls fatal (a wrong
host key or credentials do not improve with retries), nor start a handshake
once the pool has stopped being open.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from agent_backend.backends.ssh.config import SSHHostSettings
from agent_backend.errors import BackendUnavailable, PoolClosed

__all__ = ["HandshakeRamp"]

T = TypeVar("T")


class HandshakeRamp:
    """The pacing of one host's handshakes (one per :class:`ConnectionPool`)."""

    def __init__(self, name: str, settings: SSHHostSettings) -> None:
        self.name = name
        self.settings = settings
        self._slots = anyio.Semaphore(settings.max_concurrent_handshakes)
        self._next_start_at = 0.0
        self._backoff_until = 0.0
        self._backoff = settings.retry_backoff

    def succeeded(self) -> None:
        """A connection was opened: the next failure backs off from the first delay again."""
        self._backoff = self.settings.retry_backoff

    async def connect(
        self,
        handshake: Callable[[], Awaitable[T]],
        *,
        is_fatal: Callable[[BackendUnavailable], bool],
        is_open: Callable[[], bool],
    ) -> T:
        """``handshake()``, ramped and retried ``connect_retries`` times; raises its last error.

        Raises :class:`PoolClosed` when the pool stopped being open while this waited.
        """
        settings = self.settings
        last: BackendUnavailable | None = None
        for _ in range(settings.connect_retries + 1):
            async with self._slots:
                now = time.monotonic()
                start_at = max(now, self._next_start_at, self._backoff_until)
                self._next_start_at = start_at + settings.handshake_interval
                if start_at > now:
                    await anyio.sleep(start_at - now)
                if not is_open():
                    raise PoolClosed(f"{self.name} is closing")
                try:
                    return await handshake()
                except BackendUnavailable as exc:
                    if is_fatal(exc):
                        raise
                    last = exc
            self._backoff_until = time.monotonic() + self._backoff * random.uniform(0.5, 1.0)
            self._backoff = min(self._backoff * 2, settings.retry_backoff_max)
        assert last is not None
        raise last
