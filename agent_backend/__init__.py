"""agent_backend: the tool-execution layer for AI agents and RL rollouts.

The public API is what ``__all__`` lists; everything else is internal.
"""

from agent_backend.errors import (
    AgentBackendError,
    ArgumentIssue,
    BackendError,
    BackendUnavailable,
    ConfigError,
    ModelFacingError,
    SchemaError,
    SchemaRefError,
    ToolArgumentError,
    ToolTimeout,
    UnknownToolError,
    WorkerLost,
)
from agent_backend.schema import (
    CompiledSchema,
    Limits,
    compile_schema,
    prepare_arguments,
    resolve_local_refs,
    resolve_schema,
)

__version__ = "0.1.0"

__all__ = [
    "AgentBackendError",
    "ArgumentIssue",
    "BackendError",
    "BackendUnavailable",
    "CompiledSchema",
    "ConfigError",
    "Limits",
    "ModelFacingError",
    "SchemaError",
    "SchemaRefError",
    "ToolArgumentError",
    "ToolTimeout",
    "UnknownToolError",
    "WorkerLost",
    "__version__",
    "compile_schema",
    "prepare_arguments",
    "resolve_local_refs",
    "resolve_schema",
]
