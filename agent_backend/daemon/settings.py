"""The daemon's settings: where it listens, who may call it, and how much it accepts.

Pure data (a frozen pydantic model); reading the token from the environment or
a file is :mod:`agent_backend.daemon.auth`'s job, not this module's.
"""

from __future__ import annotations

from typing import Annotated

import pydantic

__all__ = ["DaemonSettings"]

_Positive = Annotated[float, pydantic.Field(gt=0, allow_inf_nan=False)]


class DaemonSettings(pydantic.BaseModel):
    """How one daemon behaves. Every limit has a safe default."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    tokens: tuple[Annotated[str, pydantic.StringConstraints(min_length=16)], ...]
    """Bearer tokens that may call the daemon (usually one). Every route but liveness needs one."""
    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback needs a token given explicitly (not generated)."""
    port: Annotated[int, pydantic.Field(ge=0, le=65535)] = 8765
    """TCP port; 0 picks a free one."""
    max_body_bytes: Annotated[int, pydantic.Field(ge=1024)] = 1 << 20
    """Largest request body accepted; larger gets 413."""
    max_argument_bytes: Annotated[int, pydantic.Field(ge=64)] = 256 << 10
    """Largest arguments of one call (as JSON); larger gets 413."""
    max_concurrent_per_token: Annotated[int, pydantic.Field(ge=1)] = 128
    """Requests one token may have in flight; more get 429 with Retry-After."""
    retry_after: _Positive = 1.0
    """Seconds a 429 asks the client to wait."""
    max_batch: Annotated[int, pydantic.Field(ge=1)] = 256
    """Most calls in one batch."""
    max_sessions_per_token: Annotated[int, pydantic.Field(ge=1)] = 64
    """Sessions one token may have open at once."""
    idempotency_ttl: _Positive = 600.0
    """Seconds a finished call's response is kept for retries with the same Idempotency-Key."""
    idempotency_max_entries: Annotated[int, pydantic.Field(ge=1)] = 10_000
    """Most responses kept for retries (the oldest finished ones go first)."""
    idempotency_max_bytes: Annotated[int, pydantic.Field(ge=1024)] = 64 << 20
    """Most bytes of responses kept for retries."""
    grace: _Positive = 10.0
    """On SIGTERM/SIGINT, seconds in-flight requests get to finish before they are cancelled."""
    mcp: bool = True
    """Serve MCP's streamable HTTP transport at ``/mcp``."""

    @pydantic.field_validator("tokens")
    @classmethod
    def _at_least_one(cls, tokens: tuple[str, ...]) -> tuple[str, ...]:
        if not tokens:
            raise ValueError("the daemon needs at least one token")
        return tokens
