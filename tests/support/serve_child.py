"""``agent-backend serve`` in a child process, as a user starts it, for tests of the whole daemon."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from support.daemon_fixtures import TOKEN
from support.ports import unused_port

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Child:
    url: str
    port: int
    process: subprocess.Popen[str]
    log: Path

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _serve_command() -> list[str]:
    script = Path(sys.executable).with_name("agent-backend")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent_backend.cli"]


@contextlib.contextmanager
def serve_child(
    tmp_path: Path,
    *options: str,
    env: dict[str, str] | None = None,
    nofile: int | None = None,
    exits_cleanly: bool = False,
) -> Iterator[Child]:
    """``agent-backend serve --isolation none OPTIONS``, unwalled, until its banner's last line.

    ``env`` adds to the environment (``AGENT_BACKEND_<NAME>`` settings); ``nofile`` caps the
    child's descriptors before exec; ``exits_cleanly`` asserts that SIGTERM ends it with 0.
    """
    port = unused_port()
    child_env = {
        **os.environ,
        "AGENT_BACKEND_TOKEN": TOKEN,
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "AGENT_BACKEND_PORT": str(port),
        **(env or {}),
        # The code under test, wherever the installed script points.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }

    def low_nofile() -> None:  # runs in the child, before exec
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log = tmp_path / "daemon.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [*_serve_command(), "serve", "--isolation", "none", *options],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=child_env,
            preexec_fn=low_nofile,
        )
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        while line and not line.startswith("stop:"):
            line = process.stdout.readline()
        assert line, log.read_text()
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield Child(f"http://127.0.0.1:{port}", port, process, log)
    finally:
        process.terminate()
        try:
            code = process.wait(timeout=30)
            if exits_cleanly:
                assert code == 0, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            process.stdout.close()


def closed_by_peer(sock: socket.socket, *, within: float) -> bool:
    """Whether the peer closes ``sock`` within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def read_one_response(sock: socket.socket) -> bytes:
    """One whole response with a ``Content-Length`` from ``sock`` (its head and body may come
    in separate reads), and nothing after it."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body
