"""Graceful shutdown of a real `agent-backend serve` process: SIGTERM/SIGINT with calls in flight.

In-flight calls get the grace period; the rest are cancelled and their
processes killed; the process exits 0 and leaves nothing running.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.proc_helpers import (
    kill_marked,
    pid_alive,
    processes_with,
    sleeping,
    unique_sleep,
)

TOKEN = "shutdown-token-" + "s" * 20
GRACE = 2.0


def _command() -> list[str]:
    script = Path(sys.executable).with_name("agent-backend")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "agent_backend.cli"]


def _serve(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "AGENT_BACKEND_TOKEN": TOKEN, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    process = subprocess.Popen(
        [*_command(), "serve", "--port", "0", "--grace", str(GRACE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    first = process.stdout.readline()
    match = re.search(r"on (http://127\.0\.0\.1:\d+) ", first)
    if match is None:
        process.kill()
        _, err = process.communicate(timeout=10)
        pytest.fail(f"the daemon did not start: {first!r} {err[-2000:]}")
    # Keep draining stdout so that the daemon never blocks on a full pipe.
    threading.Thread(target=process.stdout.read, daemon=True).start()
    return process, match.group(1)


def _finish(process: subprocess.Popen[str]) -> str:
    """Kill the daemon if it still runs; its stderr; every pipe closed."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)
    assert process.stderr is not None
    assert process.stdout is not None
    stderr = process.stderr.read()
    process.stderr.close()
    process.stdout.close()
    return stderr


def _post(url: str, body: dict[str, object], answers: dict[str, object], name: str) -> None:
    try:
        answers[name] = httpx.post(
            f"{url}/v1/call",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )
    except httpx.HTTPError as exc:
        answers[name] = exc


def _wait_for_sleeps(*markers: str, timeout: float = 20.0) -> list[int]:
    """The host pids of ``sleep MARKER`` for each marker, once all of them run (the calls run
    in sandboxes: the test finds their processes in the host's /proc by their durations)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [sleeping(marker) for marker in markers]
        if all(found):
            return [pids[0] for pids in found]
        time.sleep(0.02)
    raise AssertionError(f"the calls' sleeps {markers} did not all start within {timeout:g} s")


def test_sigterm_lets_short_calls_finish_and_kills_the_rest(tmp_path: Path) -> None:
    process, url = _serve(tmp_path)
    # Sleep durations no other process has: the short call's ends within the grace period;
    # the long call's background sleep (600 s) can only be gone because it was killed.
    short_marker = f"0.8{secrets.randbelow(10**6):06d}"
    marker = unique_sleep()
    short = {"name": "exec", "arguments": {"command": f"sleep {short_marker}; echo finished"}}
    long = {"name": "exec", "arguments": {"command": f"sleep {marker} & wait"}}
    answers: dict[str, object] = {}
    threads = [
        threading.Thread(target=_post, args=(url, short, answers, "short")),
        threading.Thread(target=_post, args=(url, long, answers, "long")),
    ]
    try:
        for thread in threads:
            thread.start()
        pids = _wait_for_sleeps(short_marker, marker)
        # The long call's shell too: it and its background sleep both run now.
        pids += [pid for pid in processes_with(marker) if pid not in pids]
        assert len(pids) == 3, pids
        assert all(pid_alive(pid) for pid in pids[1:])
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # no new work once shutdown began
            late = httpx.post(
                f"{url}/v1/call",
                json={"name": "exec", "arguments": {"command": "true"}},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=5,
            )
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        code = process.wait(timeout=GRACE + 20)
        took = time.monotonic() - started
    finally:
        stderr = _finish(process)
        for thread in threads:
            thread.join(timeout=30)
        left = processes_with(marker)
        kill_marked(marker)
    assert code == 0, stderr[-3000:]
    assert took < GRACE + 8, f"shutdown took {took:.1f} s"
    short_answer = answers["short"]
    assert isinstance(short_answer, httpx.Response), short_answer
    assert short_answer.status_code == 200
    assert short_answer.json()["output"] == "finished\n"
    long_answer = answers["long"]
    if isinstance(long_answer, httpx.Response):  # or the connection was cut: both say "not done"
        assert long_answer.status_code == 503, long_answer.text
        assert long_answer.json()["error"]["type"] == "ServiceUnavailable"
    assert not any(pid_alive(pid) for pid in pids), "a call's process outlived the daemon"
    assert left == [], "a process the call started in the background is still running"


def test_sigint_with_nothing_in_flight_exits_0(tmp_path: Path) -> None:
    process, url = _serve(tmp_path)
    try:
        response = httpx.get(f"{url}/v1/health/ready", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=20)
    finally:
        stderr = _finish(process)
    assert code == 0, stderr[-3000:]
