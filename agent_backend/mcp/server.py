"""An MCP server (the ``mcp`` package's low-level ``Server``) in front of a :class:`Dispatcher`.

``tools/list`` answers with the registry's tools in MCP shape; ``tools/call``
runs the call through the dispatcher, so arguments are repaired and checked
exactly as for any other caller. Every failure, the model's (bad arguments,
unknown tool, a non-zero exit) or the infrastructure's (a host down), comes
back as a tool result with ``isError`` set and a message the model can read,
never as a protocol error that would end an agent's turn.

:func:`serve_stdio` is ``agent-backend mcp``; the daemon mounts the same
server on its streamable HTTP transport (``agent_backend.daemon.app``).
This module must never write to stdout outside the protocol.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from agent_backend.dispatch import Dispatcher, ToolResult
from agent_backend.errors import AgentBackendError
from agent_backend.tools import ToolCall

__all__ = ["build_server", "call_result", "serve_stdio"]

logger = logging.getLogger("agent_backend.mcp")

SERVER_NAME = "agent-backend"


def call_result(result: ToolResult) -> types.CallToolResult:
    """A dispatch result as an MCP tool result: its text for the model, ``isError`` unless ok."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=result.to_model_message())],
        structured_content={
            "ok": result.ok,
            "exit_status": result.exit_status,
            "error_type": result.error_type,
            "truncated": result.truncated,
            "duration": result.duration,
        },
        is_error=not result.ok,
    )


def _error_result(exc: AgentBackendError) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"Error: {type(exc).__name__}: {exc}")],
        structured_content={"ok": False, "error_type": type(exc).__name__},
        is_error=True,
    )


def build_server(dispatcher: Dispatcher) -> Server[Any]:
    """An MCP server whose tools are ``dispatcher``'s registry, run by ``dispatcher``."""
    from agent_backend import __version__

    ids = itertools.count(1)

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        tools = [types.Tool.model_validate(tool) for tool in dispatcher.registry.to_mcp()]
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        call = ToolCall(f"mcp_{next(ids)}", params.name, params.arguments or {}, "mcp")
        try:
            result = await dispatcher.call(call)
        except AgentBackendError as exc:
            logger.warning("MCP call %r failed: %s: %s", params.name, type(exc).__name__, exc)
            return _error_result(exc)
        return call_result(result)

    return Server(
        SERVER_NAME,
        version=__version__,
        instructions="Tools run by agent-backend: arguments are repaired against each tool's "
        "JSON Schema; failures come back as results with isError set.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(dispatcher: Dispatcher) -> None:
    """Serve ``dispatcher``'s tools over stdin/stdout until the client closes stdin."""
    server = build_server(dispatcher)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())
