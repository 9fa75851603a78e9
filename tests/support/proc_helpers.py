"""Helpers for tests with real processes: is a pid still running, how much memory do we use."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from agent_backend.backends.local import backend as local_backend
from agent_backend.backends.local import files as local_files
from agent_backend.backends.local import process as local_process


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie counts as dead (it runs nothing, holds no pipe):
    this machine's init does not reap orphans, so killed grandchildren stay zombies."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    state = raw[raw.rfind(b")") + 2 :].split()[0]
    return state not in (b"Z", b"X")


def rss_bytes() -> int:
    """This process's resident set size now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def entries(path: str | os.PathLike[str]) -> list[str]:
    return sorted(os.listdir(path))


def _wait_dead_sync(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def wait_dead(pid: int, within: float = 3.0) -> bool:
    """True once ``pid`` no longer runs; False if it still does after ``within`` seconds."""
    return await anyio.to_thread.run_sync(_wait_dead_sync, pid, within)


def slow_local_disk(monkeypatch: pytest.MonkeyPatch, host: object, seconds: float) -> None:
    """Make every blocking file operation of the local backend take ``seconds`` longer.

    Run on the event loop, each would freeze it for that long; run in worker
    threads (as they must be), many proceed at once and the loop keeps going.
    """

    def slowed(function: Any) -> Any:
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return function(*args, **kwargs)

        return slow

    for name in ("remove_tree", "sweep_dead_owners"):
        monkeypatch.setattr(local_backend, name, slowed(getattr(local_backend, name)))
    for name in ("read_file", "write_file", "list_dir"):
        monkeypatch.setattr(local_files, name, slowed(getattr(local_files, name)))
    monkeypatch.setattr(host, "_mkdtemp", slowed(host._mkdtemp))  # type: ignore[attr-defined]


def spawn_on(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the local backend spawn on ``path``: ``"asyncio"`` (where no pidfd can be had) or pidfds.

    The pidfd path is the fast one: missing, it fails the run under ``CI=true`` and skips elsewhere.
    """
    if path.endswith("asyncio"):
        monkeypatch.setattr(local_process, "_PIDFD", False)
        return
    if not local_process.pidfd_supported():
        if os.environ.get("CI") == "true":
            pytest.fail(
                "this Linux has no pidfd_open (kernel 5.3+): the fast spawn path is untested"
            )
        pytest.skip("no pidfd_open here (kernel 5.3+)")


@dataclasses.dataclass
class LoopStall:
    worst: float = 0.0
    """The longest the event loop was late for a 10 ms sleep, in seconds."""


@contextlib.asynccontextmanager
async def watch_loop() -> AsyncIterator[LoopStall]:
    """How late the event loop gets while the ``async with`` body runs (a 10 ms heartbeat)."""
    stall = LoopStall()

    async def heartbeat() -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            stall.worst = max(stall.worst, time.monotonic() - before - 0.01)

    async with anyio.create_task_group() as group:
        group.start_soon(heartbeat)
        try:
            yield stall
        finally:
            group.cancel_scope.cancel()


# -- a sandboxed command's processes, seen from the host -------------------------------------------
#
# Under ``isolation = "namespaces"`` a command cannot write outside its workspace, and ``$$`` is
# its pid inside its own PID namespace: a test finds its processes in the host's ``/proc``
# instead, by a sleep duration that no other process has.


def unique_sleep(seconds: int = 600) -> str:
    """A sleep duration no other process uses (``600.042137``): long enough never to end by
    itself within a test's bounded waits, and its digits find the processes that run it."""
    return f"{seconds}.{secrets.randbelow(10**6):06d}"


def _cmdline_and_state(pid: str) -> tuple[bytes, str] | None:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # gone meanwhile
        return None
    return cmdline, raw[raw.rfind(b")") + 2 :].split()[0].decode()


def processes_with(marker: str) -> list[int]:
    """Host pids of the live (not zombie) processes with ``marker`` in their command line:
    the command's shell (``sh -c '... sleep 600.042137 ...'``) and its ``sleep``."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        seen = _cmdline_and_state(entry)
        if seen is not None and needle in seen[0] and seen[1] not in ("Z", "X"):
            found.append(int(entry))
    return found


def sleeping(marker: str) -> list[int]:
    """Host pids of the live processes that run exactly ``sleep MARKER`` (not a client whose
    command line merely quotes the command)."""
    found = []
    for pid in processes_with(marker):
        seen = _cmdline_and_state(str(pid))
        if seen is None:
            continue
        argv = seen[0].rstrip(b"\0").split(b"\0")
        if len(argv) == 2 and os.path.basename(argv[0]) == b"sleep" and argv[1] == marker.encode():
            found.append(pid)
    return found


def process_group(pid: int) -> int | None:
    """The host process group of ``pid``; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(raw[raw.rfind(b")") + 2 :].split()[2])


def group_alive(pgid: int) -> bool:
    """Whether any process of host process group ``pgid`` still runs (zombies do not count)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


# Each look below reads every process's command line: in a worker thread, never on the event
# loop that the client or the pool under test runs on (on a busy machine, scans on the loop
# starve it).


async def wait_sleeping(marker: str, within: float = 15.0) -> int:
    """The host pid of the command's ``sleep MARKER``, once it runs (bounded wait)."""
    with anyio.fail_after(within):
        while not (found := await anyio.to_thread.run_sync(sleeping, marker)):  # noqa: ASYNC110
            await anyio.sleep(0.02)  # a state in /proc: no event to wait on
    return found[0]


async def none_left(marker: str, within: float = 15.0) -> list[int]:
    """Wait (bounded) until no process has ``marker`` in its command line; the survivors, if
    some still run after ``within`` seconds."""
    deadline = time.monotonic() + within
    while (left := await anyio.to_thread.run_sync(processes_with, marker)) and (  # noqa: ASYNC110
        time.monotonic() < deadline
    ):
        await anyio.sleep(0.02)
    return left


def kill_marked(marker: str) -> None:
    """Test hygiene after a failed assertion: SIGKILL the processes of this test's command."""
    for pid in processes_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
