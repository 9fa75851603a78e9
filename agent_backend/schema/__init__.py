"""The tool-call layer's pure core: resolve local ``$ref``s, parse, repair and validate arguments.

Nothing in this package does I/O: no files, no sockets, no subprocesses. An
external ``$ref`` is reported, never fetched.
"""

from agent_backend.schema.dialect import Dialect, detect_dialect
from agent_backend.schema.keywords import check_json_shape
from agent_backend.schema.parse import Limits, parse_arguments
from agent_backend.schema.prepare import CompiledSchema, compile_schema, prepare_arguments
from agent_backend.schema.refs import ExternalRef, Resolution, resolve_local_refs, resolve_schema
from agent_backend.schema.strict import strict_schema

__all__ = [
    "CompiledSchema",
    "Dialect",
    "ExternalRef",
    "Limits",
    "Resolution",
    "check_json_shape",
    "compile_schema",
    "detect_dialect",
    "parse_arguments",
    "prepare_arguments",
    "resolve_local_refs",
    "resolve_schema",
    "strict_schema",
]
