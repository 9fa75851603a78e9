"""How long to wait before retrying an HTTP request: ``Retry-After``, else jittered backoff.

Shared by :class:`agent_backend.Client` (the daemon's client) and
:class:`~agent_backend.rollout.server_client.PolicyServerClient` (policy
servers), so that both read a server's ``Retry-After`` the same way. Pure:
no I/O, no clock but the one passed in, and nothing from the layers above
(``import agent_backend.client`` must not pull in dispatch through it).

A 429 or 503 that carries ``Retry-After`` (RFC 9110 10.2.3: delay-seconds or
an HTTP-date) is retried after at least that long, spread at random up to half
as long again (:func:`retry_after_delay`): a server at its limit refuses a
burst of callers at once, and callers that all wait exactly what it asked
come back at once and are refused together again. The spread only lengthens
the wait the server asked for, never shortens it; it is the "jitter" of AWS's
"Exponential Backoff And Jitter" (Marc Brooker, 2015) put above a wait the
server chose rather than below a backoff the client chose. A caller may cap
the wait (its ``ceiling``), so that a server asking for an hour does not
park it for an hour. Any other retry waits
:func:`~agent_backend.backoff.backoff_delay`. Which statuses are worth a retry
at all, and for how long, is the caller's decision.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from typing import Final

from agent_backend.backoff import backoff_delay

__all__ = [
    "RETRY_AFTER_SPREAD",
    "RETRY_AFTER_STATUSES",
    "parse_retry_after",
    "retry_after_delay",
    "retry_delay",
]

#: Statuses whose ``Retry-After`` is honoured (RFC 9110: 503; RFC 6585: 429).
RETRY_AFTER_STATUSES: Final = frozenset({429, 503})
#: A ``Retry-After`` of ``s`` seconds is waited for a random time in ``[s, s * (1 + this))``.
RETRY_AFTER_SPREAD: Final = 0.5


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` value asks for, or None when absent or unreadable.

    ``"2"`` is 2 seconds; an HTTP-date is the time from ``now`` (default: the
    wall clock) until it, 0 when it is past. Negative or non-finite numbers
    are unreadable.
    """
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; a naive result means "-0000"
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def retry_after_delay(
    asked: float, *, ceiling: float = math.inf, rng: random.Random | None = None
) -> float:
    """Seconds to wait when a server asked for ``asked`` seconds (a parsed ``Retry-After``).

    ``asked`` times a random factor in ``[1, 1 + RETRY_AFTER_SPREAD)``, so that
    callers refused together come back spread over half the interval; never
    more than ``ceiling`` (which may cut it below ``asked``: the caller's choice).
    """
    return min(asked * (1.0 + RETRY_AFTER_SPREAD * (rng or random).random()), ceiling)


def retry_delay(
    retry: int,
    *,
    first: float,
    ceiling: float,
    status: int | None = None,
    retry_after: str | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retry ``retry`` (1 for the first).

    ``status`` and ``retry_after`` are those of the answer that failed (None
    after a connection error): a readable ``Retry-After`` on a 429 or 503 wins
    (:func:`retry_after_delay`, capped at ``ceiling``); otherwise ``first``
    doubled per retry, capped at ``ceiling``, with jitter.
    """
    if status in RETRY_AFTER_STATUSES:
        asked = parse_retry_after(retry_after)
        if asked is not None:
            return retry_after_delay(asked, ceiling=ceiling, rng=rng)
    return backoff_delay(retry, first=first, ceiling=ceiling, rng=rng)
