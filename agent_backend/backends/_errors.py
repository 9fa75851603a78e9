"""Translate a backend's third-party exceptions into ``agent_backend.errors`` at the boundary.

``with map_exceptions({OSError: WorkerLost}, message="running ls", backend="ssh", host=h):``
turns an ``OSError`` raised inside into a ``WorkerLost`` carrying the message,
the backend and host, and a short description of the original; the original
stays reachable as ``__cause__`` (which pickling drops, so the typed error
crosses process boundaries while the unpicklable original does not).

This module must never swallow an exception, map cancellation or any other
``BaseException`` that is not an ``Exception``, or re-wrap an error that is
already an :class:`~agent_backend.errors.AgentBackendError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from agent_backend.errors import AgentBackendError, BackendError, WorkerLost, clip

__all__ = ["describe", "map_exceptions"]

ExceptionTypes = type[Exception] | tuple[type[Exception], ...]


def describe(exc: BaseException, limit: int = 300) -> str:
    """``TypeName: message``, clipped; enough to tell what happened without the original."""
    text = str(exc).strip()
    name = type(exc).__name__
    return clip(f"{name}: {text}" if text else name, limit)


class map_exceptions:
    """Re-raise the first matching exception (in ``mapping`` order) as its typed counterpart.

    Exceptions in ``ignore`` pass through untouched (the caller handles them itself).
    A class rather than a ``contextlib.contextmanager``: it sits on the per-call hot
    path, where a generator-based context manager costs several times more.
    """

    __slots__ = ("backend", "host", "ignore", "mapping", "message")

    def __init__(
        self,
        mapping: Mapping[ExceptionTypes, type[BackendError]],
        *,
        message: str,
        backend: str | None = None,
        host: str | None = None,
        ignore: tuple[type[Exception], ...] = (),
    ) -> None:
        self.mapping = mapping
        self.message = message
        self.backend = backend
        self.host = host
        self.ignore = ignore

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, Exception):
            return  # success, or cancellation and other BaseExceptions: untouched
        if isinstance(exc, (AgentBackendError, *self.ignore)):
            return
        for source, target in self.mapping.items():
            if isinstance(exc, source):
                error = target(
                    f"{self.message}: {describe(exc)}", backend=self.backend, host=self.host
                )
                if isinstance(error, WorkerLost):
                    error.cause = describe(exc)
                raise error from exc
