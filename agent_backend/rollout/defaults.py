"""The rollout layer's defaults, each said once: the classes and ``agent-backend rollout`` read them here.

Constants only, so that the command line can show them in ``--help`` without
importing the pool, the episode loop or the policy clients.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = [
    "CONCURRENCY",
    "EPISODE_TIMEOUT",
    "MAX_RETRIES",
    "MAX_TURNS",
    "NON_FINITE",
    "REQUEST_TIMEOUT",
    "REWARD_TIMEOUT",
    "TEMPERATURE",
    "TOP_LOGPROBS",
    "N",
]

N: Final = 8
"""Samples per prompt (a GRPO group)."""
CONCURRENCY: Final = 64
"""Episodes running at once."""
MAX_TURNS: Final = 16
"""Policy turns per episode."""
EPISODE_TIMEOUT: Final = 600.0
"""Seconds one episode may take."""
REWARD_TIMEOUT: Final = 300.0
"""Seconds the reward function may take."""
TEMPERATURE: Final = 1.0
"""Sampling temperature."""
TOP_LOGPROBS: Final = 1
"""Alternatives per token asked for."""
REQUEST_TIMEOUT: Final = 300.0
"""Seconds one request to the policy server may take."""
MAX_RETRIES: Final = 4
"""Retries of a policy request on 5xx, timeouts and connection errors."""
NON_FINITE: Final[Literal["fail"]] = "fail"
"""What a NaN/inf logprob does: fail the rollout (rather than mask the token or drop it)."""
