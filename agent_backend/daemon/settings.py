"""The daemon's settings: where it listens, who may call it, and how much it accepts.

The one place their defaults live. Each setting can also come from an
``AGENT_BACKEND_<NAME>`` environment variable (``AGENT_BACKEND_PORT=9000``),
or from a file of such lines (:meth:`DaemonSettings.load`, ``agent-backend
serve --env-file``); what is given in code (or on the command line) wins over
the environment, which wins over the file. ``agent-backend serve``'s options
default to unset and take their defaults from here. The settings a
:class:`~agent_backend.dispatch.Dispatcher` takes (``session_ttl``, the
timeouts, ``output_limit``) reach it through :meth:`DaemonSettings.dispatcher_options`
where ``serve`` (or ``run_in_thread``) builds it.

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
    max_concurrent_per_token: Annotated[int, pydantic.Field(ge=1)] = 512
    """Tool calls one token may have in flight, on every route together: a request holds one
    slot, a batch one per call (``/v1/batch``, a JSON-RPC batch on ``/mcp``). More get 429 with
    Retry-After, at once; a batch of more calls than this gets 422. The default fits 256
    concurrent rollout workers, or two full batches; the pool queues what it cannot run at once
    (the local pool's ``max_concurrent_calls``)."""
    retry_after: _Positive = 1.0
    """Seconds a 429 asks the client to wait (Retry-After)."""
    max_batch: Annotated[int, pydantic.Field(ge=1)] = 256
    """Most calls in one batch (``/v1/batch``), or messages in one JSON-RPC batch (``/mcp``);
    more get 422."""
    max_sessions_per_token: Annotated[int, pydantic.Field(ge=1)] = 512
    """Sessions one token may have open at once (``/v1/sessions``, forks, MCP sessions; a
    token's stateless MCP session is not counted); more get 429 with Retry-After. The default
    fits 256 concurrent episodes with a session each, twice over, and stays under the default
    local pool's ``max_sandboxes`` (1024), so a token meets its own cap before the machine's."""
    session_ttl: _Positive = 600.0
    """Seconds a session may sit idle (no call in flight) before the reaper closes it and
    removes its workspace; a client that leaks sessions gets its slots back after this."""
    default_timeout: _Positive = 60.0
    """Seconds a call may run unless its tool file or the request says otherwise."""
    max_timeout: _Positive = 600.0
    """The most a model may ask for with ``exec``'s ``timeout`` argument (at least
    ``default_timeout``)."""
    output_limit: Annotated[int, pydantic.Field(ge=64)] = 16384
    """Bytes of a call's output kept for the model (its head and tail), unless its tool file
    says otherwise."""
    keep_alive_timeout: _Positive = 5.0
    """Seconds an idle keep-alive connection stays open between requests."""
    idempotency_ttl: _Positive = 600.0
    """Seconds a finished call's response is kept for retries with the same Idempotency-Key."""
    idempotency_max_entries: Annotated[int, pydantic.Field(ge=1)] = 10_000
    """Most responses kept for retries (the oldest finished ones go first)."""
    idempotency_max_bytes: Annotated[int, pydantic.Field(ge=1024)] = 64 << 20
    """Most bytes of responses kept for retries."""
    grace: _Positive = 10.0
    """On SIGTERM/SIGINT, seconds in-flight requests get to finish before they are cancelled."""
    max_head_bytes: Annotated[int, pydantic.Field(ge=1024)] = 64 << 10
    """Largest request line plus headers, checked before the token; larger gets 431 and a close."""
    head_timeout: _Positive = 10.0
    """Seconds a request's line and headers have to arrive whole, from the connection (or the
    next request's first byte); later gets 408 and a close. Each byte does not extend it."""
    body_timeout: _Positive = 30.0
    """Seconds a request body may go without a byte arriving; longer gets 408 and a close."""
    max_connections: Annotated[int, pydantic.Field(ge=1)] | None = None
    """Most open connections; past it the oldest idle keep-alive one is closed, else the new
    one gets 503 with Retry-After. None: three quarters of the open-files limit (raised to its
    hard limit at start), leaving the rest to the pools."""
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

    def dispatcher_options(self) -> dict[str, Any]:
        """The keywords of :class:`~agent_backend.dispatch.Dispatcher` these settings give:
        ``Dispatcher(registry, **pools.dispatcher_options(), **settings.dispatcher_options())``
        (what ``agent-backend serve`` and ``run_in_thread`` build)."""
        return {
            "default_timeout": self.default_timeout,
            "max_timeout": self.max_timeout,
            "output_limit": self.output_limit,
            "session_ttl": self.session_ttl,
        }

    @pydantic.model_validator(mode="after")
    def _timeouts_ordered(self) -> DaemonSettings:
        if self.max_timeout < self.default_timeout:
            raise ValueError(
                f"max_timeout ({self.max_timeout:g}) must be at least default_timeout "
                f"({self.default_timeout:g})"
            )
        return self

    @pydantic.field_validator("tokens")
    @classmethod
    def _at_least_one(cls, tokens: tuple[str, ...]) -> tuple[str, ...]:
        if not tokens:
            raise ValueError("the daemon needs at least one token")
        return tokens
