"""Dispatch: run prepared tool calls on pools' hosts and workers, in sessions, with bounded output."""

from agent_backend.dispatch.backend import (
    Backend,
    Command,
    CommandResult,
    DirEntry,
    FileData,
    Host,
    HostedResult,
    Output,
    absolute_path,
)
from agent_backend.dispatch.builtin import BUILTIN_DEFINITIONS, builtin_tools
from agent_backend.dispatch.dispatcher import Dispatcher, DispatcherStatistics
from agent_backend.dispatch.output import OutputBuffer, head_tail
from agent_backend.dispatch.result import ERROR_TYPES, ToolResult
from agent_backend.dispatch.routes import DEFAULT_POOL_NAME, PoolShape, Route, route
from agent_backend.dispatch.running import CallLike, as_tool_call
from agent_backend.dispatch.session import Session
from agent_backend.dispatch.snapshot import Snapshot
from agent_backend.dispatch.spec import META_KEY, ExecutionSpec

__all__ = [
    "BUILTIN_DEFINITIONS",
    "DEFAULT_POOL_NAME",
    "ERROR_TYPES",
    "META_KEY",
    "Backend",
    "CallLike",
    "Command",
    "CommandResult",
    "DirEntry",
    "Dispatcher",
    "DispatcherStatistics",
    "ExecutionSpec",
    "FileData",
    "Host",
    "HostedResult",
    "Output",
    "OutputBuffer",
    "PoolShape",
    "Route",
    "Session",
    "Snapshot",
    "ToolResult",
    "absolute_path",
    "as_tool_call",
    "builtin_tools",
    "head_tail",
    "route",
]
