"""``run_in_thread`` waits for the pools' own start (bounded by their settings, not by a fixed
timer), and a caller's ``start_timeout`` cancels a start still under way, leaving no thread or
pool behind."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import pytest

from agent_backend.daemon import DaemonSettings, background, run_in_thread
from agent_backend.dispatch import Backend, Host
from agent_backend.pool_file import PoolSet
from agent_backend.tools import ToolRegistry

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-token-" + "b" * 24


class SlowStart(Backend):
    """A pool whose start waits for the test to release it (or forever)."""

    kind = "slow"

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.started = threading.Event()
        self.closed = threading.Event()

    async def start(self) -> None:
        self.started.set()
        # The event is set from the test's thread; an abandoned wait ends when the test sets it.
        await anyio.to_thread.run_sync(self.release.wait, abandon_on_cancel=True)

    async def aclose(self) -> None:
        self.closed.set()

    @property
    def hosts(self) -> Sequence[Host]:
        return ()

    def statistics(self) -> Any:
        return None


def daemon_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "agent-backend daemon"]


def test_the_daemon_serves_once_its_pools_start_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    pool = SlowStart(release)
    monkeypatch.setattr(background, "load_pools", lambda source: PoolSet({"slow": pool}, "slow"))

    def release_once_started() -> None:
        pool.started.wait()
        release.set()

    releaser = threading.Thread(target=release_once_started)
    releaser.start()
    with run_in_thread(ToolRegistry(), DaemonSettings(tokens=(TOKEN,), port=0)) as daemon:
        assert daemon.url.startswith("http://127.0.0.1:")
    releaser.join()
    assert pool.closed.is_set()
    assert daemon_threads() == []


def test_a_start_timeout_cancels_the_start_and_closes_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    pool = SlowStart(release)  # released only after the assertions
    monkeypatch.setattr(background, "load_pools", lambda source: PoolSet({"slow": pool}, "slow"))
    settings = DaemonSettings(tokens=(TOKEN,), port=0)
    try:
        with (
            pytest.raises(TimeoutError, match=r"did not start within 0\.2 s"),
            run_in_thread(ToolRegistry(), settings, start_timeout=0.2),
        ):
            pytest.fail("the daemon cannot have started")
        assert pool.started.is_set()
        assert pool.closed.is_set()
        assert daemon_threads() == []
    finally:
        release.set()
