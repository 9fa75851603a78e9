"""MCP: the registry's tools served over the Model Context Protocol (stdio or streamable HTTP).

The stdio server is here (:func:`serve_stdio`); the daemon serves the same
:class:`McpHandlers` at ``/mcp`` (``agent_backend.daemon.mcp_http``).
"""

from agent_backend.mcp.handlers import (
    SERVED_VERSIONS,
    SERVER_NAME,
    JsonRpcError,
    McpHandlers,
    negotiate_version,
)
from agent_backend.mcp.results import (
    RESULT_META_KEY,
    call_result,
    error_result,
    error_wire,
    result_wire,
)
from agent_backend.mcp.server import build_server, serve_stdio

__all__ = [
    "RESULT_META_KEY",
    "SERVED_VERSIONS",
    "SERVER_NAME",
    "JsonRpcError",
    "McpHandlers",
    "build_server",
    "call_result",
    "error_result",
    "error_wire",
    "negotiate_version",
    "result_wire",
    "serve_stdio",
]
