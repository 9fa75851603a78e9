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

import anyio
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


class _UntilEndOfInput:
    """The client's messages, noting the end of stdin (the client's "I am done")."""

    def __init__(self, stream: Any, ended: anyio.Event) -> None:
        self._stream = stream
        self._ended = ended

    async def receive(self) -> Any:
        try:
            return await self._stream.receive()
        except anyio.EndOfStream:
            self._ended.set()
            raise

    def __aiter__(self) -> _UntilEndOfInput:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _UntilEndOfInput:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return bool(await self._stream.__aexit__(*exc_info))

    def __getattr__(self, name: str) -> Any:  # aclose, last_context
        return getattr(self._stream, name)


class _WhileInputOpen:
    """The server's messages, dropped once the client closed stdin.

    On end of input the SDK answers the requests still in flight with
    "Connection closed"; a client that closed stdin has stopped reading, and
    the mcp 1.x client fails (BrokenResourceError) on a message it no longer
    expects. Nobody waits for those answers.
    """

    def __init__(self, stream: Any, ended: anyio.Event) -> None:
        self._stream = stream
        self._ended = ended

    async def send(self, item: Any, /) -> None:
        if self._ended.is_set():
            logger.debug("stdin closed: not sending %r", item)
            return
        await self._stream.send(item)

    async def __aenter__(self) -> _WhileInputOpen:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return bool(await self._stream.__aexit__(*exc_info))

    def __getattr__(self, name: str) -> Any:  # aclose
        return getattr(self._stream, name)


async def serve_stdio(dispatcher: Dispatcher) -> None:
    """Serve ``dispatcher``'s tools over stdin/stdout until the client closes stdin.

    ``dispatcher`` must be open (``async with``): the connection's session is opened on it.
    """
    async with dispatcher.session() as session:
        logger.info("MCP stdio session %s in %s", session.id, session.workspace)
        server = build_server(dispatcher, session=session)
        ended = anyio.Event()
        async with stdio_server() as (read_stream, write_stream):
            await server.run(
                _UntilEndOfInput(read_stream, ended),
                _WhileInputOpen(write_stream, ended),
                server.create_initialization_options(),
            )
