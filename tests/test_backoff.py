"""The one backoff rule of every retry loop: doubling from ``first``, capped, half jitter."""

from __future__ import annotations

import random

from agent_backend.backoff import backoff_delay


def test_doubles_per_retry_within_half_jitter_and_caps() -> None:
    rng = random.Random(7)
    for attempt, full in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (9, 5.0)):
        for _ in range(200):
            delay = backoff_delay(attempt, first=0.5, ceiling=5.0, rng=rng)
            assert full * 0.5 <= delay < full


def test_jitter_spreads_callers() -> None:
    delays = {backoff_delay(3, first=1.0, ceiling=60.0) for _ in range(50)}
    assert len(delays) > 40
