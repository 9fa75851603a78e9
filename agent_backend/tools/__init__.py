"""Tools: what a model may call, how calls are found in its output, and how they are checked.

Sits on :mod:`agent_backend.schema` (pure argument checking) and under
``dispatch`` and the backends. Nothing here runs a tool anywhere but
in-process (:mod:`~agent_backend.tools.invoke`: the one way to run a tool's
Python function, sync or async, for every layer above); nothing here opens a
socket.
"""

from agent_backend.tools.calls import (
    CallFormat,
    ToolCall,
    from_anthropic,
    from_hermes,
    from_mcp,
    from_openai,
    parse_tool_calls,
)
from agent_backend.tools.export import (
    to_anthropic,
    to_mcp,
    to_openai,
    tool_from_definition,
    wire_name,
)
from agent_backend.tools.formats import (
    TextFormat,
    detect_call_format,
    from_text,
    render_tool_calls,
)
from agent_backend.tools.functions import parse_docstring, tool_from_function
from agent_backend.tools.invoke import call_function, is_async_callable, run_prepared
from agent_backend.tools.legacy import normalize_legacy_types
from agent_backend.tools.registry import PreparedCall, ToolRegistry, load_tool_file
from agent_backend.tools.tool import EXECUTION_BLOCK, POOL_KEY, Tool

__all__ = [
    "EXECUTION_BLOCK",
    "POOL_KEY",
    "CallFormat",
    "PreparedCall",
    "TextFormat",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "call_function",
    "detect_call_format",
    "from_anthropic",
    "from_hermes",
    "from_mcp",
    "from_openai",
    "from_text",
    "is_async_callable",
    "load_tool_file",
    "normalize_legacy_types",
    "parse_docstring",
    "parse_tool_calls",
    "render_tool_calls",
    "run_prepared",
    "to_anthropic",
    "to_mcp",
    "to_openai",
    "tool_from_definition",
    "tool_from_function",
    "wire_name",
]
