"""Helpers for the SSH backend tests: a backend for test sshd servers, remote process checks."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig
from agent_backend.dispatch.backend import Command
from support.sshd import SSHServer

_unique = itertools.count(1)


@functools.cache
def _walls_missing() -> str | None:
    """None when bubblewrap can build a sandbox here (the test sshd's host), else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    trial = ["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/", "/", "true"]
    done = subprocess.run(trial, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"bubblewrap cannot build a sandbox here: {done.stderr.strip()}"
    return None


def require_remote_walls() -> None:
    """Skip unless the test sshd's login user can build the namespaces tier's walls; under
    ``CI=true`` fail instead."""
    reason = _walls_missing()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)


def backend_for(*servers: SSHServer, **overrides: Any) -> SSHBackend:
    """An SSH backend over ``servers`` (same settings for each), host keys verified."""
    close_timeout = overrides.pop("close_timeout", 10.0)
    hosts = [SSHHostConfig(**server.client_options(**overrides)) for server in servers]
    return SSHBackend.from_config(SSHPoolConfig(hosts=tuple(hosts), close_timeout=close_timeout))


def unique_duration(base: int = 30) -> str:
    """A sleep duration no other process on this machine uses: ``pgrep -f`` finds only ours."""
    return f"{base}.{os.getpid() % 1000:03d}{next(_unique):04d}"


def sleep_command(duration: str, *, timeout: float = 20.0) -> Command:
    return Command(argv=("sleep", duration), timeout=timeout)


def processes_matching(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return [int(pid) for pid in out.stdout.split()]


async def wait_until(predicate: Callable[[], bool], *, within: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + within
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        await anyio.sleep(step)


async def no_process_left(pattern: str, *, within: float = 5.0) -> list[int]:
    """Poll until no process matches ``pattern``; the survivors if some remain."""
    left: list[int] = []

    def gone() -> bool:
        nonlocal left
        left = processes_matching(pattern)
        return not left

    await wait_until(gone, within=within, step=0.05)
    return left


def kill_leftovers(pattern: str) -> None:
    """Test hygiene after a failed assertion: end our own stray sleeps (found by their unique argv)."""
    for pid in processes_matching(pattern):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def lock_is_held(path: str) -> bool:
    """Someone holds an exclusive ``flock`` on ``path`` (it exists and ``LOCK_NB`` fails).
    A free lock is let go at once, so the probe never holds it for anyone else to see."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock the probe got
    return False


def processes_with_token(prefix: str) -> list[int]:
    """Processes whose environment has an ``AGENT_BACKEND_CALL`` entry starting with ``prefix``
    (``<instance>.`` for all of an owner's, ``<instance>.owner`` for its lock holder)."""
    wanted = f"AGENT_BACKEND_CALL={prefix}".encode()
    found: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                entries = environ.read().split(b"\0")
        except OSError:
            continue
        if any(entry.startswith(wanted) for entry in entries):
            found.append(int(name))
    return found
