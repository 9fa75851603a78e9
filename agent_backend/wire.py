"""The daemon's wire format, shared by the daemon and :class:`agent_backend.Client`.

Request and response bodies are pydantic models (their JSON Schema is in the
daemon's ``/openapi.json`` and in ``schemas/wire/``). A failure that is not a
tool result travels as an :class:`ErrorBody`: a stable ``type`` (a class name
from :func:`error_registry`), a ``message`` and the error's ``fields``. The
client rebuilds the same exception class from that name, looked up in the
project's own registry; it never imports anything a server names.

The daemon's own refusals (401, 409, 413, 429, ...) are errors of the one
tree (:class:`~agent_backend.errors.DaemonError` and its subclasses, in
:mod:`agent_backend.errors`); they are re-exported here, where they were first.

This module must never do I/O and never import a web framework: the client
imports it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

import pydantic

from agent_backend import errors
from agent_backend.errors import (
    AgentBackendError,
    ArgumentIssue,
    DaemonError,
    IdempotencyConflict,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    RateLimited,
    RequestTooLarge,
    ServiceUnavailable,
    TooManySessions,
    Unauthorized,
    clip,
)
from agent_backend.result import ToolResult

__all__ = [
    "API_PREFIX",
    "IDEMPOTENCY_HEADER",
    "BatchRequest",
    "BatchResponse",
    "CallRequest",
    "DaemonError",
    "ErrorBody",
    "ErrorDetail",
    "ForkRequest",
    "ForkResponse",
    "IdempotencyConflict",
    "InvalidRequest",
    "Liveness",
    "MethodNotAllowed",
    "NotFound",
    "PoolReadiness",
    "RateLimited",
    "Readiness",
    "RequestTooLarge",
    "ServiceUnavailable",
    "SessionInfo",
    "SessionRequest",
    "TooManySessions",
    "ToolResult",
    "ToolsResponse",
    "Unauthorized",
    "WireCall",
    "error_from_wire",
    "error_registry",
    "error_to_wire",
]

#: Every JSON route lives under this prefix; a breaking change gets a new one.
API_PREFIX: Final = "/v1"
IDEMPOTENCY_HEADER: Final = "Idempotency-Key"

# Bounds on what an error body may carry (a server can be wrong; a client must stay bounded).
_MESSAGE_LIMIT = 4096
_FIELD_LIMIT = 2048


# -- the registry the client maps names back through --------------------------------------------------


def error_registry() -> dict[str, type[AgentBackendError]]:
    """Every error class a wire ``type`` may name: the project's own, by class name."""
    found: dict[str, type[AgentBackendError]] = {}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, AgentBackendError):
            found[name] = cls
    return found


_REGISTRY: dict[str, type[AgentBackendError]] | None = None


def _registry() -> dict[str, type[AgentBackendError]]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = error_registry()
    return _REGISTRY


def _field_names(cls: type[AgentBackendError]) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        for name, annotation in getattr(klass, "__annotations__", {}).items():
            if "ClassVar" not in str(annotation):
                names.add(name)
    names.discard("message")
    return names


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # NaN is not JSON: servers answer 500
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_encode(v) for v in value]
    return clip(repr(value), _FIELD_LIMIT)


def error_to_wire(exc: AgentBackendError) -> ErrorDetail:
    """``exc`` as an error body: its class name, message and fields."""
    fields = {
        name: _encode(value)
        for name, value in vars(exc).items()
        if name != "message" and not name.startswith("_")
    }
    return ErrorDetail(
        type=type(exc).__name__, message=clip(str(exc), _MESSAGE_LIMIT), fields=fields
    )


def _decode(name: str, value: Any) -> Any:
    if name == "issues" and isinstance(value, list):
        issues: list[Any] = []
        for item in value:
            if isinstance(item, Mapping) and {"pointer", "message"} <= item.keys():
                known = {f.name for f in dataclasses.fields(ArgumentIssue)}
                issues.append(ArgumentIssue(**{k: str(v) for k, v in item.items() if k in known}))
            else:
                issues.append(item)
        return tuple(issues)
    if isinstance(value, list):
        return tuple(value)  # every sequence field of the tree is a tuple
    return value


def error_from_wire(body: object, *, status: int) -> AgentBackendError:
    """The exception an error body describes, of a class from :func:`error_registry` only.

    An unknown ``type`` (a newer daemon) becomes the nearest thing the client
    knows: a :class:`DaemonError` for a 4xx, an :class:`AgentBackendError`
    otherwise, with the server's type name in the message.
    """
    detail: ErrorDetail | None = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        try:
            detail = ErrorDetail.model_validate(body["error"])
        except pydantic.ValidationError:
            detail = None
    if detail is None:
        return DaemonError(f"HTTP {status} without an error body", status=status)
    message = clip(detail.message, _MESSAGE_LIMIT)
    cls = _registry().get(detail.type)
    if cls is None:
        if 400 <= status < 500:
            return DaemonError(f"{clip(detail.type, 80)}: {message}", status=status)
        return AgentBackendError(f"{clip(detail.type, 80)}: {message}")
    allowed = _field_names(cls)
    state = {k: _decode(k, v) for k, v in detail.fields.items() if k in allowed}
    # Rebuilt as unpickling does (AgentBackendError.__reduce__): no __init__, every field kept.
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.message = message
    exc.__dict__.update(state)
    if isinstance(exc, DaemonError) and not isinstance(state.get("status"), int):
        exc.status = status
    return exc


# -- bodies -------------------------------------------------------------------------------------------

_Name = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=256)]
_Id = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=256)]
_Timeout = Annotated[float, pydantic.Field(gt=0, le=86400, allow_inf_nan=False)]
_SessionId = Annotated[str, pydantic.StringConstraints(min_length=1, max_length=128)]


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class WireCall(_Model):
    """One tool call, as a model made it."""

    name: _Name
    """The tool's name (or its exported alias)."""
    arguments: dict[str, Any] | str = pydantic.Field(default_factory=dict)
    """The arguments: a JSON object, or the JSON text the model produced (repaired like any call)."""
    id: _Id | None = None
    """The model's call id; default ``call_<index>``."""
    error: Annotated[str, pydantic.StringConstraints(max_length=4096)] | None = None
    """Set when the call was located in the model's output but could not be read; it is
    answered with this error and never runs."""


class CallRequest(WireCall):
    """``POST /v1/call``: run one call."""

    timeout: _Timeout | None = None
    """Seconds the tool may run; default: the tool's own, or the daemon's."""
    session: _SessionId | None = None
    """Run in this session (from ``POST /v1/sessions``)."""


class BatchRequest(_Model):
    """``POST /v1/batch``: run independent calls concurrently; results in call order."""

    calls: list[WireCall]
    """The calls; at most the daemon's ``max_batch``. Each holds one of the token's
    ``max_concurrent_per_token`` slots while the batch runs."""
    timeout: _Timeout | None = None
    """Seconds each tool may run; default: each tool's own, or the daemon's."""
    session: _SessionId | None = None
    """Run every call in this session."""


class BatchResponse(_Model):
    results: list[ToolResult]
    """One result per call, in call order."""


class SessionRequest(_Model):
    """``POST /v1/sessions``: open a session (no options yet)."""


class SessionInfo(_Model):
    id: str
    """Name the session in calls (``"session": id``) and close it with ``DELETE /v1/sessions/{id}``."""
    host: str
    """The host its calls run on."""
    workspace: str
    """Its private working directory on that host."""


class ForkRequest(_Model):
    n: int = pydantic.Field(ge=1, le=64)
    """How many sessions to make, each starting as a copy of the session's workspace."""


class ForkResponse(_Model):
    sessions: list[SessionInfo]
    """The new sessions, each independent of the others and of the one forked; close each."""


class ToolsResponse(_Model):
    format: Literal["openai", "anthropic", "mcp"]
    tools: list[dict[str, Any]]
    """The tool list in the shape that provider's API expects."""


class Liveness(_Model):
    status: Literal["ok"] = "ok"


class PoolReadiness(_Model):
    """One pool of the daemon: what of it can take a call now."""

    backend: str
    """The pool's kind (``local``, ``ssh``, ``ray``)."""
    up: int
    """Hosts that are up (for a Ray pool: live actors)."""
    total: int
    """All its hosts (for a Ray pool: its replicas)."""
    guarantees: list[str] = pydantic.Field(default_factory=list)
    """The walls in force around its commands, one ``name: guarantee`` line each (isolation,
    filesystem, processes, network, uid, limits); empty: the pool declares none."""


class Readiness(_Model):
    """Ready: not draining, and every pool has something up (each pool is listed in ``pools``)."""

    status: Literal["ready", "not ready"]
    backend: str
    """The default pool's kind (``local``, ``ssh``, ``ray``)."""
    hosts_up: int
    """The default pool's hosts (or actors) that are up."""
    hosts: int
    draining: bool
    """True once shutdown began: no new work is accepted."""
    reason: str | None = None
    pools: dict[str, PoolReadiness] = pydantic.Field(default_factory=dict)
    """Every pool by name, the default one included."""


class ErrorDetail(_Model):
    type: Annotated[str, pydantic.StringConstraints(max_length=128)]
    """A stable class name; the client raises that class from its own registry."""
    message: str
    fields: dict[str, Any] = pydantic.Field(default_factory=dict)
    """The error's fields (``status``, ``retry_after``, ``issues``, ``host``, ...)."""


class ErrorBody(_Model):
    """Every non-2xx answer of a JSON route."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, title="ErrorBody")

    error: ErrorDetail
