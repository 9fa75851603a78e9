"""How soon ``agent-backend serve`` answers ``/v1/health/live`` after it is spawned.

Run: ``.venv/bin/python bench/startup_bench.py`` (``--quick`` for fewer rounds).

Side by side, in alternating rounds: ``agent-backend serve --port 0`` on the
embedded default pool (walled where the host can build the walls, as
``make run`` does) and, as the baseline, a one-route FastAPI app under
uvicorn (the two packages the daemon serves with, and nothing else). The
figure is the median time from spawn to the first 200 from the health route.

Figure to reach, printed as PASS/FAIL: the daemon answers within 5 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "startup-bench-token-0123456789"
TARGET_S = 5.0

_BASELINE = """
import socket, sys
import uvicorn
from fastapi import FastAPI
app = FastAPI()
@app.get("/v1/health/live")
def live() -> dict[str, str]:
    return {"status": "live"}
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(128)
print(f"baseline on http://127.0.0.1:{sock.getsockname()[1]} ", flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


def _time_to_live(argv: list[str], cwd: Path) -> float:
    spawned = time.monotonic()
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env={**os.environ, "AGENT_BACKEND_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # both print their URL first
        url = line.split(" on ", 1)[1].split()[0]
        deadline = spawned + 120
        with httpx.Client(base_url=url, timeout=5) as http:
            while time.monotonic() < deadline:
                try:
                    if http.get("/v1/health/live").status_code == 200:
                        return time.monotonic() - spawned
                except httpx.TransportError:
                    pass
                time.sleep(0.005)
        raise RuntimeError(f"{argv[0]}: no /v1/health/live within 120 s")
    finally:
        child.terminate()
        child.wait(timeout=60)


def main(quick: bool) -> int:
    rounds = 3 if quick else 7
    daemon = [str(Path(sys.executable).with_name("agent-backend")), "serve", "--port", "0"]
    baseline = [sys.executable, "-c", _BASELINE]
    took: dict[str, list[float]] = {"daemon": [], "baseline": []}
    with tempfile.TemporaryDirectory() as elsewhere:  # outside the checkout, as a user runs it
        for index in range(rounds):
            order = [("daemon", daemon), ("baseline", baseline)]
            for name, argv in order if index % 2 == 0 else reversed(order):
                took[name].append(_time_to_live(argv, Path(elsewhere)))
    median = {name: statistics.median(values) for name, values in took.items()}
    print(f"spawn -> /v1/health/live, median of {rounds} alternating rounds")
    print(f"  agent-backend serve   {median['daemon'] * 1e3:8.0f} ms")
    print(f"  FastAPI+uvicorn       {median['baseline'] * 1e3:8.0f} ms   (baseline)")
    print(f"  ratio daemon/baseline {median['daemon'] / median['baseline']:8.2f}x")
    ok = median["daemon"] < TARGET_S
    print(f"{'PASS' if ok else 'FAIL'}: the daemon answers within {TARGET_S:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    sys.exit(main(parser.parse_args().quick))
