"""The MCP client matrix: every real client x (stdio, HTTP) x every cell, each its own test.

Clients: the MCP SDK 2.x (``mcp.Client``), the MCP SDK 1.x (``ClientSession``, in
``.venv-mcp1``), the MCP Inspector CLI, pydantic-ai's ``MCPToolset``, the OpenAI Agents SDK
(``use_structured_content`` off and on) and LangChain (langchain-mcp-adapters, in
``.venv-mcp1`` since it requires ``mcp<2``). Transports: ``agent-backend mcp`` over stdio, and
the daemon's ``/mcp`` over streamable HTTP with the token in an Authorization header. Cells
and what each must show are in ``tests/support/mcp_client_cells.py``.

The clients in ``.venv-mcp1`` and the Inspector are set up by scripts/ensure-mcp-clients.sh
(``make pytest`` runs it). A missing client skips its tests with the reason, except under
``CI=true``, where it fails them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import anyio
import pytest
from support import mcp_client_cells as cells
from support.daemon_fixtures import Daemon, daemon_fixture  # noqa: F401
from support.mcp_client_cells import CELLS, ROOT, Outcome, Scenario, Server
from support.mcp_client_inspector import Inspector
from support.mcp_client_inspector import missing_reason as inspector_missing

pytestmark = pytest.mark.anyio

V1_PYTHON = ROOT / ".venv-mcp1" / "bin" / "python"
V1_WORKER = Path(__file__).parent / "support" / "mcp_client_v1.py"
#: Seconds the .venv-mcp1 worker may take for one scenario.
V1_TIMEOUT = 90.0

Driver = Callable[[Server, Scenario], Awaitable[Outcome]]

CLIENTS = (
    "mcp2",
    "mcp1",
    "inspector",
    "pydantic_ai",
    "openai_agents",
    "openai_agents_structured",
    "langchain",
)


def _require(reason: str | None) -> None:
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)


def _require_module(name: str, extra: str) -> None:
    if importlib.util.find_spec(name) is None:
        _require(f"{name} is not installed in this venv (pip install -e '.[{extra}]')")


# -- the clients in .venv-mcp1, behind one worker process -------------------------------------------


class V1Worker:
    """``tests/support/mcp_client_v1.py`` running in ``.venv-mcp1``: one JSON line in, one out."""

    def __init__(self, log: Path) -> None:
        self.log_path = log
        self.process: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: TextIO | None = None
        self.sent = 0

    def _start(self) -> subprocess.Popen[str]:
        self.log = self.log_path.open("a")
        process = subprocess.Popen(
            [str(V1_PYTHON), "-u", str(V1_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
        )
        lines = self.lines = queue.Queue()
        stdout = process.stdout
        assert stdout is not None

        def read() -> None:
            for line in stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        return process

    def request(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        assert self.process.stdin is not None
        self.sent += 1
        self.process.stdin.write(json.dumps({**payload, "id": self.sent}) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + V1_TIMEOUT
        reply: dict[str, Any] = {}
        # A reply to an earlier request (one whose test timed out) is skipped.
        while reply.get("id") != self.sent:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError(
                    f"the .venv-mcp1 client did not answer within {V1_TIMEOUT:g} s\n{self.log_tail()}"
                ) from None
            reply = json.loads(line)
        if "crash" in reply:
            raise AssertionError(f"the .venv-mcp1 driver broke:\n{reply['crash']}")
        return dict(reply["outcome"])

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        if self.log is not None:
            self.log.close()
            self.log = None


def _v1_missing() -> str | None:
    if not V1_PYTHON.exists():
        return ".venv-mcp1 is missing (make pytest, or bash scripts/ensure-mcp-clients.sh)"
    return None


@pytest.fixture(scope="session")
def v1_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[V1Worker]:
    worker = V1Worker(tmp_path_factory.mktemp("mcp1") / "worker.log")
    yield worker
    worker.stop()


def _v1_driver(client: str, request: pytest.FixtureRequest) -> Driver:
    _require(_v1_missing())
    worker: V1Worker = request.getfixturevalue("v1_worker")

    async def run(server: Server, scenario: Scenario) -> Outcome:
        payload = {"client": client, "server": server.to_json(), "scenario": scenario.to_json()}
        reply = await anyio.to_thread.run_sync(worker.request, payload)
        return Outcome.from_json(reply)

    return run


def _driver(
    client: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[Driver, Inspector | None]:
    from support import mcp_client_inproc as inproc

    if client == "mcp2":
        return inproc.run_mcp2, None
    if client in ("mcp1", "langchain"):
        return _v1_driver(client, request), None
    if client == "inspector":
        _require(inspector_missing())
        inspector = Inspector(tmp_path / "inspector-home")
        return inspector.run, inspector
    if client == "pydantic_ai":
        _require_module("pydantic_ai", "pydantic-ai")
        _require_module("fastmcp", "pydantic-ai")
        return inproc.run_pydantic_ai, None
    if client.startswith("openai_agents"):
        _require_module("agents", "openai-agents")
        return inproc.run_openai_agents(structured=client.endswith("_structured")), None
    raise ValueError(client)


def _server(transport: str, request: pytest.FixtureRequest) -> Server:
    if transport == "stdio":
        return cells.stdio_server()
    daemon: Daemon = request.getfixturevalue("daemon")
    return Server("http", url=f"{daemon.url}/mcp", token=daemon.token)


MATRIX = [
    pytest.param(client, transport, cell, id=f"{client}-{transport}-{cell}")
    for client in CLIENTS
    for transport in ("stdio", "http")
    for cell in CELLS
]


@pytest.mark.parametrize(("client", "transport", "cell"), MATRIX)
async def test_cell(
    client: str, transport: str, cell: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    run, inspector = _driver(client, request, tmp_path)
    server = _server(transport, request)
    scenario = cells.build(cell, tmp_path)
    try:
        async with anyio.create_task_group() as group:
            if scenario.marker is not None:
                group.start_soon(cells.watch_started, scenario)
            outcome = await run(server, scenario)
            group.cancel_scope.cancel()
        cells.CHECKS[cell](scenario, outcome)
        if scenario.marker is not None:
            exclude = frozenset(inspector.pids if inspector else ())
            await cells.wait_gone(scenario, exclude=exclude)
    finally:
        cells.kill_leftovers(scenario, exclude=frozenset(inspector.pids if inspector else ()))


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_pydantic_ai_test_model(transport: str, request: pytest.FixtureRequest) -> None:
    """pydantic-ai's ``TestModel`` fills each tool's arguments from its schema alone and must
    get a successful run. (read_file is left out: the calls run concurrently, so the file it
    reads may not be written yet.)"""
    _require_module("pydantic_ai", "pydantic-ai")
    from support.mcp_client_inproc import run_pydantic_ai_test_model

    tools = ["exec", "write_file", "list_dir"]
    outcome = await run_pydantic_ai_test_model(_server(transport, request), tools=tools)
    assert outcome.raised is None, outcome.describe()
    assert set(outcome.tools) >= cells.BUILTINS, outcome.describe()
    assert len(outcome.steps) == len(tools), outcome.describe()
    assert not any(step.is_error for step in outcome.steps), outcome.describe()
