"""MCP with the mcp package's own client: `agent-backend mcp` over stdio, and the daemon's /mcp."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp
import mcp_types as types
import pytest
from mcp.client.streamable_http import streamable_http_client
from support.daemon_fixtures import Daemon, daemon_fixture  # noqa: F401

from agent_backend.dispatch import ToolResult
from agent_backend.errors import PoolClosed
from agent_backend.mcp import RESULT_META_KEY, call_result, error_wire, result_wire

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]


def _text(result: Any) -> str:
    return "".join(block.text for block in result.content if block.type == "text")


async def _exercise(client: mcp.Client, expected_tools: set[str]) -> None:
    listed = await client.list_tools()
    names = {tool.name for tool in listed.tools}
    assert names >= expected_tools
    exec_tool = next(tool for tool in listed.tools if tool.name == "exec")
    assert exec_tool.input_schema["properties"]["command"]["type"] == "string"

    ok = await client.call_tool("exec", {"command": "echo from-mcp"})
    assert not ok.is_error
    assert _text(ok) == "from-mcp\n"

    failed = await client.call_tool("exec", {"command": "echo partial; exit 7"})
    assert failed.is_error
    assert "exited with status 7" in _text(failed)
    assert "partial" in _text(failed)
    assert failed.structured_content is None
    assert failed.meta is not None
    assert failed.meta[RESULT_META_KEY]["error_type"] == "NonZeroExit"

    bad = await client.call_tool("exec", {"command": 5, "argv": "not a list"})
    assert bad.is_error
    assert "Invalid arguments" in _text(bad)

    unknown = await client.call_tool("no_such_tool", {})
    assert unknown.is_error
    assert "Unknown tool" in _text(unknown)


async def _file_tools(client: mcp.Client) -> str:
    """The file tools work in the connection's workspace; returns its path."""
    written = await client.call_tool("write_file", {"path": "sub/notes.txt", "content": "kept"})
    assert not written.is_error, _text(written)
    assert _text(await client.call_tool("read_file", {"path": "sub/notes.txt"})) == "kept"
    assert "notes.txt" in _text(await client.call_tool("list_dir", {"path": "sub"}))
    outside = await client.call_tool("read_file", {"path": "/etc/passwd"})
    assert outside.is_error
    workspace = _text(await client.call_tool("exec", {"command": "pwd"})).strip()
    assert _text(await client.call_tool("exec", {"command": "cat sub/notes.txt"})) == "kept"
    return workspace


def _stdio_server() -> mcp.StdioServerParameters:
    return mcp.StdioServerParameters(
        command=sys.executable,
        args=["-m", "agent_backend.cli", "mcp", "--tools-dir", str(ROOT / "schemas" / "tools")],
        cwd=str(ROOT),
    )


async def test_stdio() -> None:
    async with mcp.Client(_stdio_server()) as client:
        await _exercise(client, {"exec", "read_file", "write_file", "list_dir"})


async def test_stdio_is_one_session_with_a_workspace() -> None:
    async with mcp.Client(_stdio_server()) as one, mcp.Client(_stdio_server()) as two:
        workspace = await _file_tools(one)
        other = await two.call_tool("read_file", {"path": "sub/notes.txt"})
        assert other.is_error  # each server process has its own workspace
    # The client closed stdin: the server removed the workspace on its way out.
    assert not await anyio.Path(workspace).exists()


async def test_streamable_http_file_tools(daemon: Daemon) -> None:
    async with httpx2.AsyncClient(headers=daemon.headers(), timeout=30) as http:
        transport = streamable_http_client(f"{daemon.url}/mcp", http_client=http)
        async with mcp.Client(transport) as client:
            await _file_tools(client)


async def test_streamable_http_on_the_daemon(daemon: Daemon) -> None:
    async with httpx2.AsyncClient(headers=daemon.headers(), timeout=30) as http:
        transport = streamable_http_client(f"{daemon.url}/mcp", http_client=http)
        async with mcp.Client(transport) as client:
            await _exercise(client, {"exec", "echo", "tally"})
            echoed = await client.call_tool("echo", {"value": "over http"})
            assert _text(echoed) == "over http"


async def test_streamable_http_needs_the_token(daemon: Daemon) -> None:
    async with httpx2.AsyncClient(timeout=30) as http:
        response = await http.post(
            f"{daemon.url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Accept": "application/json, text/event-stream"},
        )
    assert response.status_code == 401


def test_results_map_to_mcp_results() -> None:
    ok = call_result(ToolResult(call_id="c", tool="t", ok=True, output=""))
    assert not ok.is_error
    assert ok.content[0].text == "(no output)"
    failed = call_result(
        ToolResult.failure(
            call_id="c",
            tool="t",
            error="it broke",
            error_type="NonZeroExit",
            output="partial\n",
            exit_status=3,
        )
    )
    assert failed.is_error
    # The model reads the text: why, then what it printed. No structured copy to prefer over it.
    assert failed.content[0].text == "Error: it broke\npartial\n"
    assert failed.structured_content is None
    assert failed.meta is not None
    facts = failed.meta[RESULT_META_KEY]
    assert facts["ok"] is False
    assert facts["exit_status"] == 3
    assert facts["error_type"] == "NonZeroExit"


def test_wire_results_are_valid_mcp_results() -> None:
    result = ToolResult(call_id="c", tool="t", ok=True, output="hi", duration=0.5, host="local")
    wire = result_wire(result)
    assert types.CallToolResult.model_validate(wire) == call_result(result)
    assert set(wire) == {"content", "isError", "_meta"}
    error = error_wire(PoolClosed("the session was closed"))
    parsed = types.CallToolResult.model_validate(error)
    assert parsed.is_error
    assert parsed.content[0].text == "Error: PoolClosed: the session was closed"


async def test_a_tool_list_every_client_takes(daemon: Daemon) -> None:
    async with httpx2.AsyncClient(headers=daemon.headers(), timeout=30) as http:
        transport = streamable_http_client(f"{daemon.url}/mcp", http_client=http)
        async with mcp.Client(transport) as client:
            tools = (await client.list_tools()).tools
    for tool in tools:
        assert tool.output_schema is None  # nothing for clients to validate results against
        assert tool.input_schema["type"] == "object"
