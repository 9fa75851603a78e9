"""A real multi-node Ray cluster on 127.0.0.1, started with ``ray start`` as a user would.

:class:`RayStartCluster` runs ``ray start --head --block`` and then ``ray start
--address=... --block`` for each worker node, every one a process group of
its own (its GCS or raylet, its agents, its workers), all in a short private
temp folder (``RAY_TMPDIR``: sessions, sockets, the ``ray_current_cluster``
file ``address="auto"`` reads) and with Ray's token authentication on, the
token in a file of that folder (``RAY_AUTH_MODE=token``,
``RAY_AUTH_TOKEN_PATH``). Drivers run as child processes with
:attr:`RayStartCluster.env`, so that the test process's own Ray (the
session's) is never touched.

Every port is chosen (:func:`~support.ports.unused_port`) and every address is
127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from swapping
loopback for the machine's address). This module must never run ``ray
stop`` (it stops every Ray of the machine) and never signal a process
outside the process groups it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.ports import unused_port
from support.sshd import process_tree

__all__ = ["HOST", "RayStartCluster", "ray_start_missing_reason"]

HOST = "127.0.0.2"
#: The custom resource each worker node advertises: actors that reserve it run off the head.
WORKER_RESOURCE = "worker_node"
_STARTED = "Ray runtime started"


def _ray_executable() -> str | None:
    candidate = Path(sys.executable).with_name("ray")
    return str(candidate) if candidate.exists() else shutil.which("ray")


def ray_start_missing_reason() -> str | None:
    """None when ``ray start`` can be run, else why not."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"Ray is not installed ({exc})"
    if _ray_executable() is None:
        return "the `ray` command is not installed next to this Python"
    return None


class RayStartCluster:
    """A head and ``workers`` worker nodes, each a ``ray start --block`` process group.

    ``start()`` waits (bounded) until every node says it runs; ``stop()``
    kills every process of every group it started (and their descendants)
    and removes the folder. Safe to call ``stop()`` after a failed start.
    """

    def __init__(self, *, workers: int = 1, head_cpus: int = 1, worker_cpus: int = 2) -> None:
        # Short: Ray's Unix socket paths live under it and must stay under 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="rcj", dir="/tmp"))
        self.token_file = self.root / "auth_token"
        self.token_file.write_text(secrets.token_hex(32))
        self.token_file.chmod(0o600)
        self.port = unused_port()
        self.client_port = unused_port()
        self.workers = workers
        self.head_cpus = head_cpus
        self.worker_cpus = worker_cpus
        self._groups: list[subprocess.Popen[bytes]] = []
        self._logs: list[Path] = []

    @property
    def gcs_address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def client_address(self) -> str:
        return f"ray://{HOST}:{self.client_port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment of this cluster's processes and of the drivers that join it."""
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("RAY_", "PYTEST_")) and key != "CUDA_VISIBLE_DEVICES"
        }
        env.update(
            RAY_TMPDIR=str(self.root),
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token_file),
            RAY_USAGE_STATS_ENABLED="0",
            # A loaded machine registers a raylet, and starts the head's per-client Ray Client
            # server, in more than Ray's default 30 s.
            RAY_raylet_start_wait_time_s="120",
            RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S="120",
        )
        return env

    def _ports(self) -> list[str]:
        return [
            f"--node-manager-port={unused_port()}",
            f"--object-manager-port={unused_port()}",
            f"--dashboard-agent-listen-port={unused_port()}",
            f"--dashboard-agent-grpc-port={unused_port()}",
            f"--metrics-export-port={unused_port()}",
            f"--runtime-env-agent-port={unused_port()}",
            # Workers draw their ports from the kernel (never the default range, shared with
            # every other Ray of the machine).
            "--min-worker-port=0",
            "--max-worker-port=0",
        ]

    def _launch(self, name: str, args: list[str]) -> None:
        ray = _ray_executable()
        assert ray is not None
        log = self.root / f"{name}.log"
        self._logs.append(log)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [ray, "start", "--block", "--disable-usage-stats", *args, *self._ports()],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a process group of its own: stop() kills it whole
            )
        self._groups.append(process)

    def _wait_started(self, within: float) -> None:
        deadline = time.monotonic() + within
        while True:
            pending = []
            for process, log in zip(self._groups, self._logs, strict=True):
                text = log.read_text(errors="replace") if log.exists() else ""
                if _STARTED in text:
                    continue
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{log.name}: ray start exited ({process.returncode}):\n{text[-3000:]}"
                    )
                pending.append(log.name)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(pending)}: not started within {within:g}s")
            time.sleep(0.1)

    def start(self, *, within: float = 60.0) -> None:
        common = [
            "--node-ip-address",
            HOST,
            "--object-store-memory",
            str(80 * 1024 * 1024),
            "--include-log-monitor=false",
        ]
        self._launch(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--ray-client-server-port={self.client_port}",
                f"--num-cpus={self.head_cpus}",
                "--include-dashboard=false",
                *common,
            ],
        )
        self._wait_started(within)
        for index in range(self.workers):
            self._launch(
                f"worker-{index}",
                [
                    f"--address={self.gcs_address}",
                    f"--num-cpus={self.worker_cpus}",
                    f"--resources={json.dumps({WORKER_RESOURCE: self.worker_cpus})}",
                    *common,
                ],
            )
        self._wait_started(within)

    def logs(self) -> str:
        """The tail of every node's ``ray start`` output (for a failure message)."""
        parts = []
        # The head's Ray Client proxy and the per-driver client servers it starts, whose
        # failures a driver sees only as "see ray_client_server_PORT.err".
        client_logs = sorted(self.root.glob("ray/session_latest/logs/ray_client_server*"))
        for log in [*self._logs, *client_logs]:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill every process this cluster started (each node's group and what it spawned)."""
        pids: list[int] = []
        for process in self._groups:
            if process.poll() is None:
                pids.extend(process_tree(process.pid))
        for process in self._groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for pid in pids:  # a descendant that left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self._groups:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self._groups.clear()
        shutil.rmtree(self.root, ignore_errors=True)
