"""``agent-backend mcp``: the tools over stdio, on the ``mcp`` package's low-level ``Server``.

One stdio server process is one MCP session, and one agent_backend
:class:`~agent_backend.dispatch.Session`: :func:`serve_stdio` opens it before
the first message and closes it (workspace removed, calls ended) when the
client closes stdin. The methods are :class:`~agent_backend.mcp.handlers.McpHandlers`',
the same the daemon's HTTP endpoint runs. Cancellation is the SDK's: a
``notifications/cancelled`` (which the SDK client also sends when its read
timeout fires) cancels the handler, and the backend kills the command's
process group. This module must never write to stdout outside the protocol.
"""

from __future__ import annotations

import logging
from typing import Any

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from agent_backend.dispatch import Dispatcher, Session
from agent_backend.mcp.handlers import INSTRUCTIONS, SERVER_NAME, McpHandlers

__all__ = ["build_server", "serve_stdio"]

logger = logging.getLogger("agent_backend.mcp")


def build_server(dispatcher: Dispatcher, *, session: Session | None = None) -> Server[Any]:
    """An MCP server whose tools are ``dispatcher``'s registry, run in ``session``.

    Without a session the file tools answer ``NoWorkspace``; :func:`serve_stdio` gives one.
    """
    from agent_backend import __version__

    handlers = McpHandlers(dispatcher)

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult.model_validate({"tools": handlers.list_tools()})

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        wire = await handlers.call_tool(params.name, params.arguments, session=session)
        return types.CallToolResult.model_validate(wire)

    return Server(
        SERVER_NAME,
        version=__version__,
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


async def serve_stdio(dispatcher: Dispatcher) -> None:
    """Serve ``dispatcher``'s tools over stdin/stdout until the client closes stdin.

    ``dispatcher`` must be open (``async with``): the connection's session is opened on it.
    """
    async with dispatcher.session() as session:
        logger.info("MCP stdio session %s in %s", session.id, session.workspace)
        server = build_server(dispatcher, session=session)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
