"""What an MCP client gets back for a tool call: one text for the model, the facts for code.

Every client shows the model a result's text content: pydantic-ai (it only
prefers ``structuredContent`` when there is one), the OpenAI Agents SDK
with either ``use_structured_content`` setting, langchain-mcp-adapters and
the Inspector. So the text carries everything the model needs (the
command's output, and for a failure ``Error: <why>`` first), exactly as
:meth:`~agent_backend.dispatch.ToolResult.to_model_message` renders it for
every other door (``/v1``, the native toolsets).

There is no ``structuredContent`` and no ``outputSchema``: a structured
copy would be what some clients show *instead of* the text (pydantic-ai
then showed the model only metadata, never what the command printed),
and a declared ``outputSchema`` makes SDK clients validate every result
(and fetch the tool list first when they have not seen it). The facts code
may branch on (``ok``, ``exit_status``, ``error_type``, ``truncated``,
``output_bytes``, ``duration``, ``host``) ride in the result's ``_meta``
under :data:`RESULT_META_KEY`, which clients keep away from the model.

This module must never do I/O, and never put into ``_meta`` what the model
needs to see.
"""

from __future__ import annotations

from typing import Any, Final

import mcp_types as types

from agent_backend.dispatch import ToolResult
from agent_backend.errors import MODEL_MESSAGE_LIMIT, AgentBackendError, PoolBusy, clip

__all__ = ["RESULT_META_KEY", "call_result", "error_result", "error_wire", "result_wire"]

#: The ``_meta`` key of a tool result's facts for code (``ok``, ``exit_status``, ...).
RESULT_META_KEY: Final = "agent-backend/result"


def result_wire(result: ToolResult) -> dict[str, Any]:
    """``result`` as an MCP ``CallToolResult`` in wire form (camelCase keys, no nulls)."""
    facts: dict[str, Any] = {
        "ok": result.ok,
        "exit_status": result.exit_status,
        "error_type": result.error_type,
        "truncated": result.truncated,
        "output_bytes": result.output_bytes,
        "duration": result.duration,
        "host": result.host,
    }
    return {
        "content": [{"type": "text", "text": result.to_model_message()}],
        "isError": not result.ok,
        "_meta": {RESULT_META_KEY: facts},
    }


def error_wire(exc: AgentBackendError) -> dict[str, Any]:
    """An infrastructure failure (a host down, a closed session) as an ``isError`` result."""
    text = clip(f"Error: {type(exc).__name__}: {exc}", MODEL_MESSAGE_LIMIT)
    facts: dict[str, Any] = {"ok": False, "exit_status": None, "error_type": type(exc).__name__}
    if isinstance(exc, PoolBusy):  # overload: the same call may succeed after this many seconds
        facts["retry_after"] = exc.retry_after
    return {
        "content": [{"type": "text", "text": text}],
        "isError": True,
        "_meta": {RESULT_META_KEY: facts},
    }


def call_result(result: ToolResult) -> types.CallToolResult:
    """A dispatch result as an MCP tool result: its text for the model, ``isError`` unless ok."""
    return types.CallToolResult.model_validate(result_wire(result))


def error_result(exc: AgentBackendError) -> types.CallToolResult:
    """:func:`error_wire` as a ``CallToolResult``."""
    return types.CallToolResult.model_validate(error_wire(exc))
