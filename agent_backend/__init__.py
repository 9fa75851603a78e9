"""agent_backend: the tool-execution layer for AI agents and RL rollouts.

The public API is what ``__all__`` lists; everything else is internal.
"""

from importlib import metadata as _metadata

from agent_backend.client import Client, SyncClient
from agent_backend.dispatch import Dispatcher, Session, ToolResult
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
from agent_backend.pool_file import DEFAULT_POOL, load_pool
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
    parse_tool_calls,
    tool_from_function,
)

try:  # the installed distribution's version: one place, pyproject.toml
    __version__ = _metadata.version("agent-backend")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

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
    "load_pool",
    "parse_tool_calls",
    "prepare_arguments",
    "resolve_local_refs",
    "resolve_schema",
    "tool_from_function",
]
