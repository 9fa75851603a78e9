"""Driver for the MCP Inspector (``@modelcontextprotocol/inspector``), installed from npm into
``.mcp-clients/inspector`` by scripts/ensure-mcp-clients.sh and run as its binaries (no npx).

* ``mcp-inspector --cli``: one invocation is one MCP session and one method: ``tools/list``,
  or ``tools/call`` with ``--tool-arg key=value`` (which turns ``5`` into a number, as a user
  typing it gets). stdio: the server command after ``--``; HTTP: ``--transport http
  --server-url URL --header "Authorization: Bearer ..."``.
* ``mcpdo`` (same package): "connect once, run many commands against a named connection",
  for the calls that must share one MCP session, on a private daemon of its own
  (``mcpdo private``) that is stopped at the end.

The client "gives up" on a call the way a user of the CLI does, with Ctrl-C (SIGINT), once
the command has started: the CLI has no per-call timeout option. Both run with ``HOME`` in a
temporary directory, so nothing is read from or written to the user's ``~/.mcp-inspector``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio

from support.mcp_client_cells import ROOT, Call, Outcome, Scenario, Server, Step

INSPECTOR_DIR = ROOT / ".mcp-clients" / "inspector"
BIN = INSPECTOR_DIR / "node_modules" / ".bin"
INSPECTOR = BIN / "mcp-inspector"
MCPDO = BIN / "mcpdo"
#: Seconds any one Inspector invocation may take.
INVOCATION_TIMEOUT = 60.0


def missing_reason() -> str | None:
    if not INSPECTOR.exists() or not MCPDO.exists():
        return f"the MCP Inspector is not installed in {INSPECTOR_DIR.relative_to(ROOT)} (make pytest, or bash scripts/ensure-mcp-clients.sh)"
    return None


def version() -> str:
    package = (
        INSPECTOR_DIR / "node_modules" / "@modelcontextprotocol" / "inspector" / "package.json"
    )
    return str(json.loads(package.read_text())["version"])


class Inspector:
    """Runs Inspector invocations with an isolated home; remembers their pids."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "MCP_INSPECTOR_SECRET_STORE": "memory",
            "NO_COLOR": "1",
        }
        self.home = home
        self.pids: set[int] = set()

    def _target(self, server: Server) -> list[str]:
        if server.transport == "stdio":
            return ["--", *server.command]
        assert server.url is not None
        header = f"Authorization: Bearer {server.token}"
        return ["--transport", "http", "--server-url", server.url, "--header", header]

    async def cli(
        self, server: Server, method: list[str], *, interrupt_when: Path | None = None
    ) -> dict[str, Any]:
        """``mcp-inspector --cli`` with ``method``; its JSON result, or ``{"raised": ...}``."""
        argv = [str(INSPECTOR), "--cli", "--format", "json", "-q", *method, *self._target(server)]
        cwd = server.cwd or str(ROOT)
        async with await anyio.open_process(argv, env=self.env, cwd=cwd) as process:
            self.pids.add(process.pid)
            assert process.stdout is not None
            assert process.stderr is not None
            out, err = bytearray(), bytearray()
            interrupted = False

            async def drain(stream: Any, into: bytearray) -> None:
                async for chunk in stream:
                    into.extend(chunk)

            with anyio.fail_after(INVOCATION_TIMEOUT):
                async with anyio.create_task_group() as group:
                    group.start_soon(drain, process.stdout, out)
                    group.start_soon(drain, process.stderr, err)
                    if interrupt_when is not None:
                        # The user presses Ctrl-C once the command runs.
                        while not interrupt_when.exists() and process.returncode is None:  # noqa: ASYNC110, ASYNC240
                            await anyio.sleep(0.05)
                        if process.returncode is None:
                            process.send_signal(signal.SIGINT)
                            interrupted = True
                    await process.wait()
        parsed = _parse(out.decode(), err.decode(), process.returncode)
        if interrupted and "raised" in parsed:
            parsed["raised"] = f"interrupted (SIGINT) while the command ran; {parsed['raised']}"
        return parsed

    async def run(self, server: Server, scenario: Scenario) -> Outcome:
        if scenario.one_session:
            return await self.run_mcpdo(server, scenario)
        outcome = Outcome(tools={}, steps=[])
        if not scenario.calls:
            listed = await self.cli(server, ["--method", "tools/list"])
            if "raised" in listed:
                outcome.raised = listed["raised"]
            else:
                outcome.tools = {tool["name"]: tool["inputSchema"] for tool in listed["tools"]}
            return outcome
        for call in scenario.calls:
            method = ["--method", "tools/call", "--tool-name", call.name, "--tool-arg"]
            method += call_argv(call)
            interrupt = scenario.started if scenario.client_timeout is not None else None
            result = await self.cli(server, method, interrupt_when=interrupt)
            if "raised" in result:
                outcome.raised = result["raised"]
                break
            outcome.steps.append(_step(result))
        return outcome

    async def mcpdo(self, *args: str, env: dict[str, str]) -> dict[str, Any]:
        argv = [str(MCPDO), "--format", "json", *args]
        with anyio.fail_after(INVOCATION_TIMEOUT):
            done = await anyio.run_process(argv, env=env, cwd=str(self.home), check=False)
        return _parse(done.stdout.decode(), done.stderr.decode(), done.returncode)

    async def run_mcpdo(self, server: Server, scenario: Scenario) -> Outcome:
        """The calls on one ``mcpdo`` connection (one MCP session), on a private daemon."""
        with anyio.fail_after(INVOCATION_TIMEOUT):
            exports = await anyio.run_process(
                [str(MCPDO), "private"], env=self.env, cwd=str(self.home)
            )
        env = dict(self.env)
        for line in exports.stdout.decode().splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value.strip("'")
        config = self.home / "mcp.json"
        entry: dict[str, Any]
        if server.transport == "stdio":
            entry = {
                "command": server.command[0],
                "args": list(server.command[1:]),
                "cwd": server.cwd,
            }
        else:
            entry = {"type": "streamable-http", "url": server.url, "headers": server.headers}
        config.write_text(json.dumps({"mcpServers": {"agent-backend": entry}}))
        outcome = Outcome(tools={}, steps=[])
        try:
            connected = await self.mcpdo(
                "--config", str(config), "connect", "agent-backend", env=env
            )
            if "raised" in connected:
                outcome.raised = connected["raised"]
                return outcome
            for call in scenario.calls:
                result = await self.mcpdo(
                    "@agent-backend", "tools/call", call.name, json.dumps(call.arguments), env=env
                )
                if "raised" in result:
                    outcome.raised = result["raised"]
                    break
                outcome.steps.append(_step(result))
        finally:
            await self.mcpdo("disconnect", "agent-backend", env=env)
            with anyio.fail_after(INVOCATION_TIMEOUT):
                await anyio.run_process([str(MCPDO), "daemon", "stop"], env=env, check=False)
        return outcome


def _parse(stdout: str, stderr: str, returncode: int | None) -> dict[str, Any]:
    """The JSON a ``--format json`` invocation printed: a result, or why there is none.

    ``tools/call`` exits 5 when the result has ``isError`` and still prints the result.
    """
    text = stdout.strip()
    if text:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            if "result" in data and isinstance(data["result"], dict):
                return dict(data["result"])
            if "error" not in data:
                return data
    return {"raised": f"exit status {returncode}: {stderr.strip()[-2000:] or text[-2000:]}"}


def _step(result: dict[str, Any]) -> Step:
    text = "".join(
        block.get("text", "") for block in result.get("content", []) if block.get("type") == "text"
    )
    return Step(text, bool(result.get("isError")), result.get("structuredContent"))


def call_argv(call: Call) -> list[str]:
    """The ``--tool-arg`` pairs a user types for ``call``."""
    return [f"{key}={value}" for key, value in call.arguments.items()]
