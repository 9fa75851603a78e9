"""agent_backend: the tool-execution layer for AI agents and RL rollouts.

The public API is what ``__all__`` lists; everything else is internal. The
names are imported when first used (PEP 562), so that code needing one part
pays for that part only: ``agent_backend.Client`` loads the client and the
wire format, not dispatch, the tools, the schema layer or jsonschema.
"""

import importlib as _importlib
import typing as _typing

from agent_backend.errors import (
    AgentBackendError,
    ArgumentIssue,
    BackendError,
    BackendUnavailable,
    ConfigError,
    LeaseError,
    ModelFacingError,
    PathOutsideWorkspace,
    PoolClosed,
    PoolError,
    SchemaError,
    SchemaRefError,
    ToolArgumentError,
    ToolTimeout,
    UnknownToolError,
    WorkerLost,
)

if _typing.TYPE_CHECKING:
    from agent_backend.client import Client, SyncClient
    from agent_backend.dispatch import Dispatcher, Session, Snapshot
    from agent_backend.pool_file import DEFAULT_POOL, load_pool
    from agent_backend.result import ToolResult
    from agent_backend.schema import (
        CompiledSchema,
        Limits,
        compile_schema,
        prepare_arguments,
        resolve_local_refs,
        resolve_schema,
    )
    from agent_backend.tools import (
        PreparedCall,
        Tool,
        ToolCall,
        ToolRegistry,
        detect_call_format,
        from_text,
        parse_tool_calls,
        render_tool_calls,
        tool_from_function,
    )

    __version__: str

__all__ = [
    "DEFAULT_POOL",
    "AgentBackendError",
    "ArgumentIssue",
    "BackendError",
    "BackendUnavailable",
    "Client",
    "CompiledSchema",
    "ConfigError",
    "Dispatcher",
    "LeaseError",
    "Limits",
    "ModelFacingError",
    "PathOutsideWorkspace",
    "PoolClosed",
    "PoolError",
    "PreparedCall",
    "SchemaError",
    "SchemaRefError",
    "Session",
    "Snapshot",
    "SyncClient",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "ToolTimeout",
    "UnknownToolError",
    "WorkerLost",
    "__version__",
    "compile_schema",
    "detect_call_format",
    "from_text",
    "load_pool",
    "parse_tool_calls",
    "prepare_arguments",
    "render_tool_calls",
    "resolve_local_refs",
    "resolve_schema",
    "tool_from_function",
]

#: The module each lazily imported name comes from.
_HOME = {
    "Client": "client",
    "SyncClient": "client",
    "Dispatcher": "dispatch",
    "Session": "dispatch",
    "Snapshot": "dispatch",
    "ToolResult": "result",
    "DEFAULT_POOL": "pool_file",
    "load_pool": "pool_file",
    "CompiledSchema": "schema",
    "Limits": "schema",
    "compile_schema": "schema",
    "prepare_arguments": "schema",
    "resolve_local_refs": "schema",
    "resolve_schema": "schema",
    "PreparedCall": "tools",
    "Tool": "tools",
    "ToolCall": "tools",
    "ToolRegistry": "tools",
    "parse_tool_calls": "tools",
    "from_text": "tools",
    "render_tool_calls": "tools",
    "detect_call_format": "tools",
    "tool_from_function": "tools",
}


def _version() -> str:
    """The installed distribution's version: one place, pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version("agent-backend")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> object:
    if name == "__version__":
        value: object = _version()
    else:
        home = _HOME.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
