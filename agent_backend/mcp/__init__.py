"""MCP: the registry's tools served over the Model Context Protocol (stdio or streamable HTTP)."""

from agent_backend.mcp.server import build_server, call_result, serve_stdio

__all__ = ["build_server", "call_result", "serve_stdio"]
