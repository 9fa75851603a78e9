"""The daemon's settings: where it listens, who may call it, and how much it accepts.

The one place their defaults live. Each setting can also come from an
``AGENT_BACKEND_<NAME>`` environment variable (``AGENT_BACKEND_PORT=9000``),
or from a file of such lines (:meth:`DaemonSettings.load`, ``agent-backend
serve --env-file``); what is given in code (or on the command line) wins over
the environment, which wins over the file. ``agent-backend serve``'s options
default to unset and take their defaults from here.

Frozen data; reading the token from its variable or its file is
:mod:`agent_backend.tokens`' job, not this module's.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Final

import pydantic
import pydantic_settings

from agent_backend.config import ConfigModel

__all__ = ["ENV_PREFIX", "DaemonSettings"]

#: What each setting's environment variable starts with (``AGENT_BACKEND_PORT``).
ENV_PREFIX: Final = "AGENT_BACKEND_"

_Positive = Annotated[float, pydantic.Field(gt=0, allow_inf_nan=False)]


class DaemonSettings(pydantic_settings.BaseSettings, ConfigModel):
    """How one daemon behaves. Every limit has a safe default."""

    # BaseSettings reads the environment and the file; ConfigModel refuses unknown names and
    # freezes. env_file None: no .env is read from the working directory unless one is passed.
    model_config = pydantic_settings.SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=None)

    tokens: tuple[Annotated[str, pydantic.StringConstraints(min_length=16)], ...]
    """Bearer tokens that may call the daemon (usually one). Every route but liveness needs one.
    ``agent-backend serve`` passes the one from ``$AGENT_BACKEND_TOKEN`` or the token file."""
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

    @classmethod
    def load(
        cls, *, env_file: str | os.PathLike[str] | None = None, **values: Any
    ) -> DaemonSettings:
        """``values`` over ``$AGENT_BACKEND_<NAME>`` over ``env_file``'s lines over the defaults.

        ``env_file`` holds ``AGENT_BACKEND_<NAME>=value`` lines; any other name
        in it is refused, as an unknown keyword is.
        """
        # pydantic-settings' own argument, not a field: type checkers know only the fields.
        sources: dict[str, Any] = {"_env_file": env_file}
        return cls(**sources, **values)

    @pydantic.field_validator("tokens")
    @classmethod
    def _at_least_one(cls, tokens: tuple[str, ...]) -> tuple[str, ...]:
        if not tokens:
            raise ValueError("the daemon needs at least one token")
        return tokens
