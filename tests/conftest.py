"""Shared fixtures. Async tests use anyio on asyncio (asyncssh runs on asyncio only)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
