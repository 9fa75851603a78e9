"""Non-finite logprobs, handled where they are produced: :func:`check_logprobs`.

A policy server can answer a token with a NaN or infinite logprob (or none at
all: ``null``). Peers let one through: it became ``None`` and crashed tensor
creation, or a NaN in JSON made a server answer HTTP 500. The
policy client calls :func:`check_logprobs` on every completion it receives,
before anything else sees the numbers, and applies the configured
:data:`NonFinitePolicy`:

* ``mask``: the token stays in the completion but is not trained on: its
  mask becomes 0 and its logprob 0.0;
* ``drop``: the whole rollout is dropped: the returned check has
  ``drop=True`` and an ``error`` text; the caller ends the episode with
  ``stop_reason="rollout_error"`` and that error (the returned lists are
  masked as above, so even a record of the dropped rollout holds no NaN);
* ``fail``: :class:`~agent_backend.errors.NonFiniteLogprobs` is raised with
  the positions.

Every check is counted in a :class:`NonFiniteCounters` the pool can read.

This module must never do I/O, and never return a non-finite float.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Final, Literal, get_args

from agent_backend.errors import NonFiniteLogprobs
from agent_backend.rollout.trajectory import non_finite_positions

__all__ = [
    "NON_FINITE_POLICIES",
    "LogprobCheck",
    "NonFiniteCounters",
    "NonFinitePolicy",
    "NonFiniteStats",
    "check_logprobs",
]

#: What to do with a NaN, infinite or missing logprob (see the module docstring).
NonFinitePolicy = Literal["mask", "drop", "fail"]
NON_FINITE_POLICIES: Final[tuple[str, ...]] = get_args(NonFinitePolicy)

_SHOWN = 10


@dataclasses.dataclass(frozen=True, slots=True)
class NonFiniteStats:
    """A snapshot of :class:`NonFiniteCounters`."""

    completions: int = 0
    """Completions checked."""
    tokens: int = 0
    """Tokens checked."""
    non_finite_tokens: int = 0
    """Tokens whose logprob was NaN, infinite or missing."""
    masked_tokens: int = 0
    """Tokens masked out under the ``mask`` policy."""
    dropped_rollouts: int = 0
    """Completions that asked their rollout to be dropped (``drop`` policy)."""
    failures: int = 0
    """Completions that raised :class:`NonFiniteLogprobs` (``fail`` policy)."""


class NonFiniteCounters:
    """Running counts of :func:`check_logprobs` calls; safe to share across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = NonFiniteStats()

    def _add(self, **deltas: int) -> None:
        with self._lock:
            current = self._stats
            self._stats = dataclasses.replace(
                current, **{k: getattr(current, k) + v for k, v in deltas.items()}
            )

    def snapshot(self) -> NonFiniteStats:
        """The counts so far."""
        return self._stats

    def __repr__(self) -> str:
        s = self._stats
        return (
            f"<NonFiniteCounters completions={s.completions} tokens={s.tokens} "
            f"non_finite={s.non_finite_tokens} masked={s.masked_tokens} "
            f"dropped={s.dropped_rollouts} failures={s.failures}>"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class LogprobCheck:
    """What :func:`check_logprobs` made of one completion.

    ``logprobs`` and ``mask`` are always safe to store: every value finite,
    and 0.0 wherever the mask is 0.
    """

    logprobs: list[float]
    mask: list[int]
    count: int
    """How many logprobs were NaN, infinite or missing."""
    positions: tuple[int, ...]
    """Their indexes in the completion."""
    drop: bool
    """True when the policy is ``drop`` and ``count > 0``: the caller must drop the rollout."""
    error: str | None
    """A plain-text description for the trajectory's ``error`` when ``drop`` (else None)."""


def _describe(positions: Sequence[int], values: Sequence[float | None]) -> str:
    shown = ", ".join(f"{p}={values[p]!r}" for p in positions[:_SHOWN])
    more = f", ... and {len(positions) - _SHOWN} more" if len(positions) > _SHOWN else ""
    return f"{len(positions)} non-finite logprobs at completion positions [{shown}{more}]"


def check_logprobs(
    logprobs: Sequence[float | None],
    mask: Sequence[int] | None = None,
    policy: NonFinitePolicy = "fail",
    *,
    counters: NonFiniteCounters | None = None,
) -> LogprobCheck:
    """Apply ``policy`` to the non-finite logprobs of one completion.

    ``mask`` defaults to all 1 (every token sampled). Positions already
    masked out are normalised to 0.0 whatever the server sent, and do not
    count as non-finite. Raises :class:`~agent_backend.errors.NonFiniteLogprobs`
    under ``fail``, and ``ValueError`` for an unknown policy or a mask of
    the wrong length.
    """
    if policy not in NON_FINITE_POLICIES:
        raise ValueError(
            f"unknown non-finite logprob policy {policy!r}; use one of mask, drop, fail"
        )
    n = len(logprobs)
    out_mask = [1] * n if mask is None else [int(m) for m in mask]
    if len(out_mask) != n:
        raise ValueError(f"{n} logprobs but a mask of {len(out_mask)}")
    bad = [p for p in non_finite_positions(logprobs) if out_mask[p]]
    out = [
        float(lp) if m and lp is not None else 0.0 for lp, m in zip(logprobs, out_mask, strict=True)
    ]
    if bad:
        for p in bad:
            out[p] = 0.0
            out_mask[p] = 0
    if counters is not None:
        counters._add(
            completions=1,
            tokens=n,
            non_finite_tokens=len(bad),
            masked_tokens=len(bad) if policy == "mask" else 0,
            dropped_rollouts=1 if bad and policy == "drop" else 0,
            failures=1 if bad and policy == "fail" else 0,
        )
    if bad and policy == "fail":
        raise NonFiniteLogprobs(
            f"{_describe(bad, logprobs)} (non-finite logprob policy 'fail')", positions=bad
        )
    drop = bool(bad) and policy == "drop"
    error = f"rollout dropped: {_describe(bad, logprobs)}" if drop else None
    return LogprobCheck(
        logprobs=out, mask=out_mask, count=len(bad), positions=tuple(bad), drop=drop, error=error
    )
