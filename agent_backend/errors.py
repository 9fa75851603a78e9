"""Every exception agent_backend raises, in one tree.

Two audiences, kept apart:

* **model-facing** errors describe something the model did wrong (bad
  arguments, an unknown tool). They are meant to be turned into a short
  message the model can act on (``to_model_message()``), never to crash a run.
* **developer-facing** errors describe a misconfiguration or an infrastructure
  failure. They are raised to the code that called agent_backend.

::

    AgentBackendError
    ├── ModelFacingError
    │   ├── ToolArgumentError        arguments unparseable or invalid after repair
    │   ├── UnknownToolError         no tool of that name
    │   └── PathOutsideWorkspace     a file tool's path escapes the session workspace
    ├── SchemaError                  a tool schema is malformed (file, pointer)
    │   └── SchemaRefError           unresolvable or ref-only cyclic $ref
    ├── ConfigError                  a bad pool/config file (file, key, expected)
    ├── PoolError                    a pool used wrongly
    │   ├── LeaseError               release with a stale or foreign owner token
    │   ├── PoolClosed               use after aclose()/stop()
    │   └── PoolBusy                 a session holds its most calls at once; retry (429 on the daemon)
    ├── BackendError                 the place a tool runs failed (backend, host, pool)
    │   ├── BackendUnavailable       cannot reach / start the backend
    │   │   └── SandboxUnavailable   the walls a pool asks for cannot be had here (missing)
    │   ├── WorkerLost               the worker died mid-call
    │   ├── ToolTimeout              also a TimeoutError
    │   ├── ResourceUnavailable      no worker has the resources a call needs
    │   └── PayloadLost              a result kept by reference was released or lost
    ├── ToolFailed                   a Python tool raised (its type, message, HTTP status)
    ├── DaemonError                  the daemon refused a request (status: its HTTP status)
    │   ├── Unauthorized             401: no bearer token, or a wrong one
    │   ├── NotFound                 404: no such route or session
    │   ├── MethodNotAllowed         405
    │   ├── IdempotencyConflict      409: an Idempotency-Key reused with another request
    │   ├── RequestTooLarge          413: the body or one call's arguments are over the limit
    │   ├── InvalidRequest           422: the body is not JSON or does not match the route
    │   ├── RateLimited              429: too many requests in flight for this token
    │   ├── TooManySessions          429: too many open sessions for this token (retry_after)
    │   └── ServiceUnavailable       503: the daemon is shutting down or not ready
    └── RolloutError                 the rollout layer failed (not one tool call)
        ├── PolicyError              the policy server failed or answered unusably (status)
        ├── NonFiniteLogprobs        NaN/inf logprobs under the "fail" policy
        └── LedgerError              a resume ledger or checkpoint is unreadable or misused

Every error pickles with its fields (they cross process and Ray boundaries):
``AgentBackendError.__reduce__`` rebuilds the instance from its message and
its ``__dict__`` instead of re-calling ``__init__``, so subclasses with
keyword-only fields need no pickling code of their own.

This module must never import a third-party library: third-party exceptions
are mapped to these classes at the boundary where they occur.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AgentBackendError",
    "ArgumentIssue",
    "BackendError",
    "BackendUnavailable",
    "ConfigError",
    "DaemonError",
    "IdempotencyConflict",
    "InvalidRequest",
    "LeaseError",
    "LedgerError",
    "MethodNotAllowed",
    "ModelFacingError",
    "NonFiniteLogprobs",
    "NotFound",
    "PathOutsideWorkspace",
    "PayloadLost",
    "PolicyError",
    "PoolBusy",
    "PoolClosed",
    "PoolError",
    "RateLimited",
    "RequestTooLarge",
    "ResourceUnavailable",
    "RolloutError",
    "SandboxUnavailable",
    "SchemaError",
    "SchemaRefError",
    "ServiceUnavailable",
    "TooManySessions",
    "ToolArgumentError",
    "ToolFailed",
    "ToolTimeout",
    "Unauthorized",
    "UnknownToolError",
    "WorkerLost",
]

#: Upper bound on any message handed to a model (feedback that repeats the
#: whole input per nested error explodes the context).
MODEL_MESSAGE_LIMIT = 2048


def _restore(cls: type[AgentBackendError], message: str, state: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    Exception.__init__(obj, message)
    obj.__dict__.update(state)
    return obj


def clip(text: str, limit: int) -> str:
    """Shorten ``text`` to at most ``limit`` characters, keeping head and tail."""
    if len(text) <= limit:
        return text
    if limit < 8:
        return text[:limit]
    keep = limit - 5
    head = keep - keep // 3
    return f"{text[:head]} ... {text[len(text) - (keep - head) :]}"


class AgentBackendError(Exception):
    """Root of every error agent_backend raises."""

    message: str

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.message, dict(self.__dict__)))

    def __str__(self) -> str:
        return self.message


class ModelFacingError(AgentBackendError):
    """Something the model did wrong; its text goes back to the model."""

    def to_model_message(self, limit: int = MODEL_MESSAGE_LIMIT) -> str:
        return clip(self.message, limit)


@dataclasses.dataclass(frozen=True, slots=True)
class ArgumentIssue:
    """One problem with one argument.

    ``pointer`` is a JSON pointer into the arguments ("" is the whole object),
    ``expected`` what the schema wants, ``got`` a short rendering of the value.
    """

    pointer: str
    message: str
    expected: str = ""
    got: str = ""

    def render(self, limit: int = 300) -> str:
        where = self.pointer or "(arguments)"
        return clip(f"{where}: {self.message}", limit)


class ToolArgumentError(ModelFacingError):
    """The arguments of a tool call could not be parsed or do not validate."""

    tool: str | None
    issues: tuple[ArgumentIssue, ...]

    def __init__(
        self,
        message: str,
        *,
        issues: Sequence[ArgumentIssue] = (),
        tool: str | None = None,
    ) -> None:
        super().__init__(message)
        self.issues = tuple(issues)
        self.tool = tool

    def to_model_message(self, limit: int = MODEL_MESSAGE_LIMIT) -> str:
        head = (
            f"Invalid arguments for tool '{self.tool}': {self.message}"
            if self.tool
            else f"Invalid arguments: {self.message}"
        )
        lines = [head]
        used = len(head)
        footer = "Fix these and call the tool again."
        budget = limit - len(footer) - 40
        shown = 0
        for issue in self.issues:
            if not issue.pointer and issue.message == self.message:
                shown += 1  # already the headline
                continue
            line = "- " + issue.render()
            if used + len(line) + 1 > budget:
                break
            lines.append(line)
            used += len(line) + 1
            shown += 1
        if shown < len(self.issues):
            lines.append(f"- ... and {len(self.issues) - shown} more")
        lines.append(footer)
        return clip("\n".join(lines), limit)


class UnknownToolError(ModelFacingError):
    """The model named a tool that does not exist."""

    name: str
    available: tuple[str, ...]

    def __init__(self, name: str, *, available: Sequence[str] = ()) -> None:
        self.name = name
        self.available = tuple(available)
        super().__init__(self._render(MODEL_MESSAGE_LIMIT))

    def _render(self, limit: int) -> str:
        head = f"Unknown tool '{clip(self.name, 80)}'. Available tools: "
        names: list[str] = []
        used = len(head)
        for n in self.available:
            if used + len(n) + 2 > limit - 40:
                break
            names.append(n)
            used += len(n) + 2
        rest = len(self.available) - len(names)
        tail = f" (and {rest} more)" if rest else ""
        return head + (", ".join(names) if names else "none") + tail + "."

    def to_model_message(self, limit: int = MODEL_MESSAGE_LIMIT) -> str:
        return self._render(limit)


class PathOutsideWorkspace(ModelFacingError):
    """A file tool was given a path that leaves the session workspace (``..``, absolute, symlink)."""

    path: str

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"path {clip(path, 200)!r} is outside the workspace; use a relative path inside it"
        )


class SchemaError(AgentBackendError):
    """A tool schema is malformed. ``source`` names the file (or tool), ``pointer`` the place."""

    source: str | None
    pointer: str

    def __init__(self, message: str, *, source: str | None = None, pointer: str = "") -> None:
        where = f"{source or '<schema>'}{'#' + pointer if pointer else ''}"
        super().__init__(f"{where}: {message}")
        self.source = source
        self.pointer = pointer


class SchemaRefError(SchemaError):
    """A ``$ref`` cannot be resolved locally, or ``$ref``s form a cycle with no instance step."""

    ref: str
    cycle: tuple[str, ...]

    def __init__(
        self,
        message: str,
        *,
        ref: str,
        cycle: Sequence[str] = (),
        source: str | None = None,
        pointer: str = "",
    ) -> None:
        super().__init__(message, source=source, pointer=pointer)
        self.ref = ref
        self.cycle = tuple(cycle)


class ConfigError(AgentBackendError):
    """A configuration file is wrong: which file, which key, what was expected."""

    file: str | None
    key: str
    expected: str

    def __init__(
        self, message: str, *, file: str | None = None, key: str = "", expected: str = ""
    ) -> None:
        super().__init__(message)
        self.file = file
        self.key = key
        self.expected = expected


class PoolError(AgentBackendError):
    """A pool was used wrongly (a programming error, not a host failure)."""


class LeaseError(PoolError):
    """A lease was released with a token that does not own it (stale, foreign or already released)."""


class PoolClosed(PoolError):
    """The pool (or session) was used after ``aclose()``/``stop()`` began."""


class PoolBusy(PoolError):
    """A session (or another pooled resource) holds as many calls as it may at once.

    Overload, not misuse: nothing ran, and the same call may succeed once some
    of those in flight have ended, after about ``retry_after`` seconds. The
    daemon answers it with 429 and ``Retry-After``; over MCP it is an
    ``isError`` result saying so. ``limit`` is the most it holds at once.
    """

    limit: int
    retry_after: float

    def __init__(self, message: str, *, limit: int = 0, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after


class BackendError(AgentBackendError):
    """The place a tool runs failed (infrastructure, not the model's fault)."""

    backend: str | None
    host: str | None
    pool: str | None
    """The name of the dispatcher's pool it happened in (``Dispatcher(pools=...)``); None: unnamed."""

    def __init__(
        self,
        message: str,
        *,
        backend: str | None = None,
        host: str | None = None,
        pool: str | None = None,
    ) -> None:
        super().__init__(message)
        self.backend = backend
        self.host = host
        self.pool = pool


class BackendUnavailable(BackendError):
    """The backend cannot be reached or started."""


class SandboxUnavailable(BackendUnavailable):
    """A pool asks for an isolation tier this host cannot enforce; it refuses to start.

    ``missing`` names each thing lacking, with how to get it. There is no fallback to weaker
    walls: running unconfined is a choice made in the pool file, never a consequence.
    """

    missing: tuple[str, ...]

    def __init__(
        self,
        message: str,
        *,
        missing: tuple[str, ...] | list[str] = (),
        backend: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, host=host)
        self.missing = tuple(missing)


class WorkerLost(BackendError):
    """The worker (process, connection, actor) running a call died mid-call."""

    worker: str | None
    cause: str | None

    def __init__(
        self,
        message: str,
        *,
        worker: str | None = None,
        cause: str | None = None,
        backend: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, host=host)
        self.worker = worker
        self.cause = cause


class ToolTimeout(BackendError, TimeoutError):
    """A call did not finish within its timeout (its process was killed)."""

    timeout: float | None

    def __init__(
        self,
        message: str,
        *,
        timeout: float | None = None,
        backend: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, host=host)
        self.timeout = timeout


class ResourceUnavailable(BackendError):
    """A call (or a worker) needs resources that no worker of the backend has.

    Raised at dispatch, before anything runs, instead of waiting forever for
    a worker that cannot exist. ``needed`` and ``available`` map resource
    names (``CPU``, ``GPU``, custom ones) to amounts.
    """

    needed: dict[str, float]
    available: dict[str, float]

    def __init__(
        self,
        message: str,
        *,
        needed: dict[str, float] | None = None,
        available: dict[str, float] | None = None,
        backend: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, host=host)
        self.needed = dict(needed or {})
        self.available = dict(available or {})


class PayloadLost(BackendError):
    """A result kept by reference is gone: released, or lost with its owner or its node.

    ``payload`` names the object (its id), ``cause`` says what happened.
    """

    payload: str | None
    cause: str | None

    def __init__(
        self,
        message: str,
        *,
        payload: str | None = None,
        cause: str | None = None,
        backend: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(message, backend=backend, host=host)
        self.payload = payload
        self.cause = cause


class ToolFailed(AgentBackendError):
    """A Python tool raised an exception, carried as plain data that always pickles.

    Third-party exceptions often cannot cross a process boundary (aiohttp's
    ``ClientResponseError`` holds unpicklable headers; others hold locks or
    sockets), so the worker turns them into this: ``error_type`` is the
    original class's qualified name, ``status`` an HTTP status found on the
    exception or its causes (so a 503 from a tool server reads as
    infrastructure, not as bad data), ``traceback`` the clipped traceback.
    """

    tool: str | None
    error_type: str
    status: int | None
    traceback: str

    def __init__(
        self,
        message: str,
        *,
        tool: str | None = None,
        error_type: str = "",
        status: int | None = None,
        traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.tool = tool
        self.error_type = error_type
        self.status = status
        self.traceback = traceback


class RolloutError(AgentBackendError):
    """The rollout layer failed as a whole (not one tool call: those are results)."""


class PolicyError(RolloutError):
    """The policy server failed, or answered with something a trainer cannot use.

    ``status`` is the HTTP status when there was one; ``url`` the endpoint;
    ``retryable`` whether trying again may help (5xx, connection errors).
    A response without the token ids or logprobs that were asked for is a
    ``PolicyError`` (never a silently zeroed mask).
    """

    status: int | None
    url: str | None
    retryable: bool

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        url: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.retryable = retryable


class NonFiniteLogprobs(RolloutError):
    """A policy returned NaN or infinite logprobs and the configured policy is ``fail``.

    ``positions`` are the token indexes (within the completion) that were not finite.
    """

    positions: tuple[int, ...]

    def __init__(self, message: str, *, positions: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.positions = tuple(positions)


class LedgerError(RolloutError):
    """A resume ledger or checkpoint cannot be read, or was used out of order.

    ``path`` is the file concerned, when there is one.
    """

    path: str | None

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class DaemonError(AgentBackendError):
    """The daemon refused a request; ``status`` is the HTTP status it answered with.

    The client raises these (rebuilt from the daemon's error body), and the
    daemon's middlewares answer with them before a route runs.
    """

    default_status = 400
    status: int

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status if status is not None else self.default_status


class Unauthorized(DaemonError):
    """No bearer token, or not the daemon's (401)."""

    default_status = 401


class NotFound(DaemonError):
    """No such route, or no such session for this token (404)."""

    default_status = 404


class MethodNotAllowed(DaemonError):
    """The route does not take this method (405)."""

    default_status = 405


class IdempotencyConflict(DaemonError):
    """An ``Idempotency-Key`` was reused for a different request (409)."""

    default_status = 409
    key: str

    def __init__(self, message: str, *, key: str = "", status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.key = key


class RequestTooLarge(DaemonError):
    """The request body, or one call's arguments, is larger than the daemon accepts (413)."""

    default_status = 413
    limit: int
    what: str

    def __init__(
        self, message: str, *, limit: int = 0, what: str = "body", status: int | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.limit = limit
        self.what = what


class InvalidRequest(DaemonError):
    """The body is not JSON, or does not match the route's schema (422).

    ``issues`` are ``{"loc": [...], "msg": "..."}`` entries, one per problem.
    """

    default_status = 422
    issues: tuple[dict[str, Any], ...]

    def __init__(
        self,
        message: str,
        *,
        issues: Sequence[dict[str, Any]] = (),
        status: int | None = None,
    ) -> None:
        super().__init__(message, status=status)
        self.issues = tuple(issues)


class RateLimited(DaemonError):
    """Too many requests in flight for this token (429); try again after ``retry_after`` s."""

    default_status = 429
    retry_after: float
    limit: int

    def __init__(
        self,
        message: str,
        *,
        retry_after: float = 1.0,
        limit: int = 0,
        status: int | None = None,
    ) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after
        self.limit = limit


class TooManySessions(DaemonError):
    """This token has as many sessions open as the daemon allows (429).

    Close one, or wait: a session idle past the daemon's ``session_ttl`` is
    reaped. ``retry_after`` is the ``Retry-After`` the daemon sent with it.
    """

    default_status = 429
    limit: int
    retry_after: float

    def __init__(
        self,
        message: str,
        *,
        limit: int = 0,
        retry_after: float = 1.0,
        status: int | None = None,
    ) -> None:
        super().__init__(message, status=status)
        self.limit = limit
        self.retry_after = retry_after


class ServiceUnavailable(DaemonError):
    """The daemon is shutting down, or its pool is not ready (503)."""

    default_status = 503
