"""The daemon on a real uvicorn, on a free port of 127.0.0.1, on a thread of the test process.

Tools: the built-ins from ``schemas/tools`` (exec, read_file, ...) and three
Python functions: ``echo`` (returns its input), ``tally`` (counts its runs
per key in :data:`TALLY`, so a test can tell how often a call really ran)
and ``pause`` (sleeps). Two tokens are accepted: :data:`TOKEN` and
:data:`OTHER_TOKEN`.

Test modules import the fixture they use (``from daemon_fixtures import daemon_fixture``);
it is named ``daemon`` in test signatures.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agent_backend.daemon import DaemonServer, DaemonSettings, run_in_thread
from agent_backend.tools import ToolRegistry

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-" + "a" * 24
OTHER_TOKEN = "other-token-" + "b" * 24
#: Runs of the ``tally`` tool, per key.
TALLY: collections.Counter[str] = collections.Counter()


def make_registry() -> ToolRegistry:
    registry = ToolRegistry.from_dir(ROOT / "schemas" / "tools")

    @registry.tool
    async def echo(value: str) -> str:
        """Return the input.

        Args:
            value: Any text.
        """
        return value

    @registry.tool
    async def tally(key: str, delay: float = 0.0) -> int:
        """Count this run under ``key``, wait ``delay`` seconds, return the count.

        Args:
            key: What to count under.
            delay: Seconds to wait after counting.
        """
        TALLY[key] += 1
        await anyio.sleep(delay)
        return TALLY[key]

    @registry.tool
    async def pause(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        await anyio.sleep(seconds)
        return "done"

    return registry


@dataclasses.dataclass
class Daemon:
    url: str
    token: str
    server: DaemonServer

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.token}"}

    def http(self, token: str | None = None, **options: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(token), **options)

    def async_http(self, token: str | None = None, **options: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers(token), **options)


@contextlib.contextmanager
def start_daemon(**settings: Any) -> Iterator[Daemon]:
    """A daemon with ``settings`` over the defaults (port 0, both test tokens, a 60 s TTL)."""
    options: dict[str, Any] = {
        "tokens": (TOKEN, OTHER_TOKEN),
        "port": 0,
        "grace": 2.0,
        "session_ttl": 60.0,
    }
    options.update(settings)
    registry = make_registry()
    with run_in_thread(registry, DaemonSettings(**options)) as running:
        yield Daemon(running.url, TOKEN, running.server)


@pytest.fixture(name="daemon", scope="module")
def daemon_fixture() -> Iterator[Daemon]:
    """One daemon with default limits, shared by a module's tests."""
    with start_daemon() as running:
        yield running
