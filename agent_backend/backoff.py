"""Exponential backoff with jitter, for every retry loop of the project (pure, no I/O)."""

from __future__ import annotations

import random

__all__ = ["backoff_delay"]


def backoff_delay(
    attempt: int, *, first: float, ceiling: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry ``attempt`` (1 for the first retry).

    ``first`` doubled per retry, capped at ``ceiling``, then scaled by a random
    factor in [0.5, 1) so that many callers failing together do not retry in step.
    """
    delay = min(ceiling, first * 2.0 ** (attempt - 1))
    return delay * (0.5 + (rng or random).random() / 2)
