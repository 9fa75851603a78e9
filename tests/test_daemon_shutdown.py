"""Graceful shutdown of a real `agent-backend serve` process: SIGTERM/SIGINT with calls in flight.

In-flight calls get the grace period; the rest are cancelled and their
processes killed; the process exits 0 and leaves nothing running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.proc_helpers import pid_alive

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


def _wait_for(path: Path, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.02)
    raise AssertionError(f"{path} was not written")


def _running_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


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


def test_sigterm_lets_short_calls_finish_and_kills_the_rest(tmp_path: Path) -> None:
    process, url = _serve(tmp_path)
    marker = f"{61 + os.getpid() % 1000 / 1000:.3f}"  # a sleep duration no one else uses
    short = {
        "name": "exec",
        "arguments": {"command": f"echo $$ > {tmp_path}/short.pid; sleep 0.8; echo finished"},
    }
    long = {
        "name": "exec",
        "arguments": {
            "command": f"sleep {marker} & echo $! > {tmp_path}/child.pid; echo $$ > {tmp_path}/long.pid; wait"
        },
    }
    answers: dict[str, object] = {}
    threads = [
        threading.Thread(target=_post, args=(url, short, answers, "short")),
        threading.Thread(target=_post, args=(url, long, answers, "long")),
    ]
    try:
        for thread in threads:
            thread.start()
        pids = [_wait_for(tmp_path / name) for name in ("short.pid", "long.pid", "child.pid")]
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
    assert _running_with(marker) == [], (
        "a process the call started in the background is still running"
    )


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
