"""Base classes for the project's closeable objects: ``async with obj`` / ``with obj``.

Entering returns the object (a subclass whose entry does work, such as
opening a session or starting a pool, overrides ``__aenter__``); leaving
calls ``aclose()`` (or ``close()``), which every subclass keeps idempotent.
No ``__del__`` anywhere: what is not closed explicitly or by scope is a bug
to find, not to paper over.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource", "SyncResource"]


class AsyncResource(abc.ABC):
    """Closed by ``await obj.aclose()`` or at the end of ``async with obj``."""

    __slots__ = ()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release everything the object holds; idempotent."""


class SyncResource(abc.ABC):
    """Closed by ``obj.close()`` or at the end of ``with obj``."""

    __slots__ = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the object holds; idempotent."""
