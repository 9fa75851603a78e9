"""The MCP methods agent-backend answers, independent of the transport that carries them.

:class:`McpHandlers` is what both doors run: the stdio server
(:mod:`agent_backend.mcp.server`, on the ``mcp`` package's ``Server``) and
the daemon's streamable HTTP endpoint (``agent_backend.daemon.mcp_http``).
``tools/list`` answers with the registry's tools in MCP shape; ``tools/call``
runs the call through the dispatcher, in the caller's
:class:`~agent_backend.dispatch.Session` (so the file tools have a
workspace), and every failure, the model's or the infrastructure's, comes
back as an ``isError`` result (:mod:`agent_backend.mcp.results`), never as
a protocol error that would end an agent's turn.

:meth:`McpHandlers.handle` is the JSON-RPC method table of the
initialize-handshake era (protocol 2024-11-05 to 2025-11-25) for a
transport that has no SDK server underneath: params are validated with
``mcp_types``' per-version models, a bad message is a :class:`JsonRpcError`.
This module must never write to stdout, and never raise for a tool's failure.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import mcp_types as types
import pydantic
from mcp_types import methods as mcp_methods
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION

from agent_backend.dispatch import Dispatcher, Session, ToolResult
from agent_backend.errors import AgentBackendError, PoolBusy, clip
from agent_backend.mcp.results import error_wire, result_wire
from agent_backend.tools import ToolCall

__all__ = [
    "INSTRUCTIONS",
    "SERVED_VERSIONS",
    "SERVER_NAME",
    "CallRunner",
    "JsonRpcError",
    "McpHandlers",
    "negotiate_version",
]

logger = logging.getLogger("agent_backend.mcp")

SERVER_NAME: Final = "agent-backend"
INSTRUCTIONS: Final = (
    "Tools run by agent-backend: arguments are repaired against each tool's JSON Schema; "
    "failures come back as results with isError set and say what went wrong. The file tools "
    "work in this connection's own workspace."
)
#: The protocol versions served over HTTP: the initialize-handshake era (it has sessions).
SERVED_VERSIONS: Final[tuple[str, ...]] = HANDSHAKE_PROTOCOL_VERSIONS

#: Runs one ``tools/call`` in a session: its result, or the infrastructure error it raised.
#: The default is the dispatcher's own call; the daemon passes its call path's (limits, metrics).
CallRunner = Callable[[ToolCall, "Session | None"], Awaitable[ToolResult]]


class JsonRpcError(Exception):
    """A JSON-RPC error answer: ``code``, a message the client shows, optional ``data``."""

    def __init__(
        self, code: int, message: str, data: Any = None, *, extra: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.extra = dict(extra or {})
        """Members beside ``code``/``message``/``data`` (clients ignore what they do not know)."""

    def to_wire(self) -> dict[str, Any]:
        error: dict[str, Any] = {**self.extra, "code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def negotiate_version(requested: object) -> str:
    """The version to answer an ``initialize`` with: the client's if served, else the latest."""
    if isinstance(requested, str) and requested in SERVED_VERSIONS:
        return requested
    return LATEST_HANDSHAKE_VERSION


def _invalid_params(method: str, exc: pydantic.ValidationError) -> JsonRpcError:
    issues = exc.errors(include_url=False, include_input=False)
    first = issues[0] if issues else {"loc": (), "msg": "invalid"}
    where = ".".join(str(part) for part in first["loc"]) or "params"
    return JsonRpcError(
        types.INVALID_PARAMS,
        clip(f"invalid params for {method}: {where}: {first['msg']}", 500),
        [{"loc": list(e["loc"]), "msg": clip(e["msg"], 200)} for e in issues[:10]],
    )


class McpHandlers:
    """``tools/list`` and ``tools/call`` (and, for a bare transport, the rest) for one dispatcher."""

    def __init__(self, dispatcher: Dispatcher, *, run: CallRunner | None = None) -> None:
        from agent_backend import __version__

        self.dispatcher = dispatcher
        self.run = run if run is not None else self._dispatch
        self.server_info: dict[str, Any] = {"name": SERVER_NAME, "version": __version__}
        self._ids = itertools.count(1)
        self._tools: list[dict[str, Any]] | None = None
        self._tools_seen = -1

    def __repr__(self) -> str:
        return f"<McpHandlers tools={len(self.dispatcher.registry)}>"

    # -- what both transports run -------------------------------------------------------------

    def list_tools(self) -> list[dict[str, Any]]:
        """The registry's tools in MCP shape (rebuilt when the registry changed)."""
        registry = self.dispatcher.registry
        if self._tools is None or self._tools_seen != len(registry):
            self._tools = registry.to_mcp()
            self._tools_seen = len(registry)
        return self._tools

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None,
        *,
        session: Session | None,
        call_id: str | None = None,
    ) -> dict[str, Any]:
        """Run one call in ``session``; its MCP result in wire form, ``isError`` for any failure."""
        call = ToolCall(call_id or f"mcp_{next(self._ids)}", name, dict(arguments or {}), "mcp")
        try:
            result = await self.run(call, session)
        except AgentBackendError as exc:
            # Overload is the caller's to retry (the result says so), not the operator's to read
            # once per call: logged at DEBUG (the daemon counts it in its metrics).
            level = logging.DEBUG if isinstance(exc, PoolBusy) else logging.WARNING
            logger.log(level, "MCP call %r failed: %s: %s", name, type(exc).__name__, exc)
            return error_wire(exc)
        return result_wire(result)

    async def _dispatch(self, call: ToolCall, session: Session | None) -> ToolResult:
        return await self.dispatcher.call(call, session=session)

    # -- the method table of a bare transport ---------------------------------------------------

    def initialize(self, params: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """``(negotiated version, InitializeResult)`` for an ``initialize`` request's params."""
        requested = (params or {}).get("protocolVersion")
        version = negotiate_version(requested)
        try:
            mcp_methods.validate_client_request("initialize", version, params)
        except pydantic.ValidationError as exc:
            raise _invalid_params("initialize", exc) from None
        return version, {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": self.server_info,
            "instructions": INSTRUCTIONS,
        }

    async def handle(
        self,
        method: str,
        params: Mapping[str, Any] | None,
        *,
        version: str,
        session: Session | None,
        call_id: str | None = None,
    ) -> dict[str, Any]:
        """The result of one request (not ``initialize``) at protocol ``version``.

        Raises:
            JsonRpcError: unknown method (-32601) or params that do not match (-32602).
        """
        if method == "tools/call":
            try:
                parsed = mcp_methods.parse_client_request(method, version, params)
            except pydantic.ValidationError as exc:
                raise _invalid_params(method, exc) from None
            assert isinstance(parsed, types.CallToolRequest)
            return await self.call_tool(
                parsed.params.name, parsed.params.arguments, session=session, call_id=call_id
            )
        if method == "tools/list":
            self._validate(method, version, params)
            return {"tools": self.list_tools()}
        if method == "ping":
            self._validate(method, version, params)
            return {}
        if method == "initialize":
            raise JsonRpcError(
                types.INVALID_REQUEST, "this session is already initialized; start a new one"
            )
        raise JsonRpcError(
            types.METHOD_NOT_FOUND,
            f"method {clip(method, 100)!r} is not offered: this server has tools only "
            "(tools/list, tools/call) and ping",
        )

    def _validate(self, method: str, version: str, params: Mapping[str, Any] | None) -> None:
        try:
            mcp_methods.validate_client_request(method, version, params)
        except pydantic.ValidationError as exc:
            raise _invalid_params(method, exc) from None
