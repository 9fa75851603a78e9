"""Locate the tool calls in model output, in any format, as :class:`ToolCall`.

Formats: OpenAI chat ``tool_calls`` (and the legacy ``function_call``),
Anthropic ``tool_use`` content blocks, MCP ``tools/call`` params, and text:
Hermes/Qwen ``<tool_call>`` tags by default, or any family of
:mod:`agent_backend.tools.formats` named with ``format=``.
:func:`parse_tool_calls` detects which structured shape it was given.

This module only *locates* calls: arguments stay raw (the JSON text or the
mapping the model produced) for :meth:`Tool.prepare` to parse and check. It
must never drop a call it found but could not read, and never replace
unreadable arguments with ``{}`` (the tool would run with empty arguments):
such a call keeps its place with ``error`` set. Every scan is linear in the
input and the number of calls per message is capped, so a 10 MB reply cannot cost quadratic time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent_backend.errors import clip
from agent_backend.tools.formats import from_text
from agent_backend.tools.formats._base import (
    MAX_CALLS,
    CallFormat,
    TextFormat,
    ToolCall,
    overflow,
)
from agent_backend.tools.formats.hermes import parse as _parse_hermes

__all__ = [
    "MAX_CALLS",
    "CallFormat",
    "ToolCall",
    "from_anthropic",
    "from_hermes",
    "from_mcp",
    "from_openai",
    "parse_tool_calls",
]


def _call_id(raw: object, index: int) -> str:
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return f"call_{index}"


def _as_mapping(obj: object) -> Any:
    """SDK objects (pydantic models of the openai/anthropic clients) as plain dicts."""
    dump = getattr(obj, "model_dump", None)
    if callable(dump) and not isinstance(obj, Mapping):
        return dump()
    return obj


def _name_of(raw: object) -> tuple[str, str | None]:
    if isinstance(raw, str) and raw:
        return raw, None
    return "", "the tool call has no name"


# -- OpenAI ---------------------------------------------------------------------------------------


def _openai_call(raw: object, index: int) -> ToolCall:
    raw = _as_mapping(raw)
    if not isinstance(raw, Mapping):
        return ToolCall(f"call_{index}", "", "", "openai", error="a tool call must be an object")
    call_id = _call_id(raw.get("id"), index)
    kind = raw.get("type", "function")
    function = raw.get("function")
    if kind != "function" or not isinstance(function, Mapping):
        return ToolCall(
            call_id, "", "", "openai", error=f"unsupported tool call type {clip(str(kind), 40)!r}"
        )
    return _openai_function(function, call_id)


def _openai_function(function: Mapping[str, Any], call_id: str) -> ToolCall:
    name, error = _name_of(function.get("name"))
    arguments = function.get("arguments")
    if error is None and isinstance(arguments, (str, Mapping)):
        return ToolCall(call_id, name, arguments, "openai")
    if error is None:
        error = (
            "the tool call has no arguments"
            if arguments is None
            else f"arguments must be a JSON string, not {type(arguments).__name__}"
        )
    return ToolCall(call_id, name, "", "openai", error=error)


def from_openai(message_or_tool_calls: Mapping[str, Any] | Sequence[Any]) -> list[ToolCall]:
    """Calls of an OpenAI assistant message, or of its ``tool_calls`` list.

    Reads ``tool_calls`` (``function.arguments`` is a JSON string, kept as
    text) and the legacy ``function_call``. Missing ids become ``call_<n>``.
    """
    obj = _as_mapping(message_or_tool_calls)
    if isinstance(obj, Mapping):
        if obj.get("tool_calls"):
            raw_calls: Sequence[Any] = obj["tool_calls"]
        elif isinstance(obj.get("function_call"), Mapping):
            return [_openai_function(obj["function_call"], "call_0")]
        elif "function" in obj:
            raw_calls = [obj]
        else:
            return []
    else:
        raw_calls = obj
    if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, (str, bytes)):
        return [ToolCall("call_0", "", "", "openai", error="tool_calls must be a list")]
    calls = [_openai_call(raw, i) for i, raw in enumerate(raw_calls[:MAX_CALLS])]
    if len(raw_calls) > MAX_CALLS:
        calls.append(overflow("openai", MAX_CALLS))
    return calls


# -- Anthropic ------------------------------------------------------------------------------------


def from_anthropic(content_blocks: Mapping[str, Any] | Iterable[Any]) -> list[ToolCall]:
    """Calls in Anthropic content blocks (or a message holding them): every ``tool_use`` block."""
    obj = _as_mapping(content_blocks)
    if isinstance(obj, Mapping):
        content = obj.get("content")
        blocks: Iterable[Any] = [obj] if obj.get("type") == "tool_use" else content or []
        if isinstance(blocks, str):
            return []
    else:
        blocks = obj
    calls: list[ToolCall] = []
    for block in blocks:
        block = _as_mapping(block)
        if not isinstance(block, Mapping) or block.get("type") != "tool_use":
            continue
        index = len(calls)
        if index == MAX_CALLS:
            calls.append(overflow("anthropic", index))
            break
        call_id = _call_id(block.get("id"), index)
        name, error = _name_of(block.get("name"))
        arguments = block.get("input")
        if error is None and not isinstance(arguments, (Mapping, str)):
            error = f"input must be an object, not {type(arguments).__name__}"
        if error is not None:
            calls.append(ToolCall(call_id, name, "", "anthropic", error=error))
        else:
            assert isinstance(arguments, (Mapping, str))
            calls.append(ToolCall(call_id, name, arguments, "anthropic"))
    return calls


# -- Hermes ---------------------------------------------------------------------------------------


def from_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``(remaining_text, calls)`` of Hermes/Qwen-style ``<tool_call>{...}</tool_call>`` blocks.

    The prose around the blocks is kept (blocks cut out, ends stripped). A
    block whose JSON does not parse, or that is never closed (the next
    ``<tool_call>`` comes first), becomes a call with ``error`` set. A last
    block cut off by the end of the message (servers that stop on
    ``</tool_call>`` drop it) counts when what it holds is a complete call.
    One forward scan: linear in ``len(text)``. The same as
    ``from_text(text, format="hermes")``.
    """
    return _parse_hermes(text)


# -- MCP ------------------------------------------------------------------------------------------


def from_mcp(params: Mapping[str, Any]) -> list[ToolCall]:
    """The call in MCP ``tools/call`` params ``{"name", "arguments"}`` (or the whole request).

    The JSON-RPC request id, when given, becomes the call id. ``arguments``
    is optional in MCP; absent, the call has no arguments.
    """
    obj = _as_mapping(params)
    call_id = "call_0"
    if isinstance(obj, Mapping) and obj.get("method") == "tools/call":
        call_id = _call_id(obj.get("id"), 0)
        obj = obj.get("params")
    if not isinstance(obj, Mapping):
        return [ToolCall(call_id, "", "", "mcp", error="tools/call params must be an object")]
    name, error = _name_of(obj.get("name"))
    arguments = obj.get("arguments", {})
    if error is None and not isinstance(arguments, Mapping):
        error = f"arguments must be an object, not {type(arguments).__name__}"
    if error is not None:
        return [ToolCall(call_id, name, "", "mcp", error=error)]
    return [ToolCall(call_id, name, arguments, "mcp")]


# -- Detection ------------------------------------------------------------------------------------


def parse_tool_calls(
    obj: object, format: TextFormat | None = None, *, tools: object = None
) -> list[ToolCall]:
    """The calls in ``obj``, whichever shape it is in.

    Without ``format``: a ``str`` is Hermes text (use :func:`from_hermes` to
    keep the prose); a message dict is recognized by
    ``tool_calls``/``function_call`` (OpenAI), ``tool_use`` blocks
    (Anthropic), ``method: tools/call`` or ``name``+``arguments`` (MCP), or
    Hermes tags in string ``content``. With ``format`` (a text family of
    :mod:`agent_backend.tools.formats`), ``obj`` is model output text (or a
    message whose ``content`` is), read in that format, with ``tools``
    typing bare-text values (see :func:`~agent_backend.tools.from_text`).
    Raises ``ValueError`` for anything else: a wrong object is a programming error.
    """
    obj = _as_mapping(obj)
    if format is not None:
        if isinstance(obj, Mapping) and isinstance(obj.get("content"), str):
            obj = obj["content"]
        elif isinstance(obj, Mapping) and obj.get("content") is None and "role" in obj:
            return []
        if not isinstance(obj, str):
            raise ValueError(f"format={format!r} reads text, not {clip(repr(obj), 120)}")
        return from_text(obj, format=format, tools=tools)[1]
    if isinstance(obj, str):
        return from_hermes(obj)[1]
    if isinstance(obj, Mapping):
        if obj.get("tool_calls") or any(
            isinstance(obj.get(key), Mapping) for key in ("function_call", "function")
        ):
            return from_openai(obj)
        if obj.get("type") == "tool_use":
            return from_anthropic(obj)
        if "name" in obj and isinstance(obj.get("arguments"), str):
            # A bare legacy OpenAI ``function_call`` object: arguments are JSON text.
            return [_openai_function(obj, "call_0")]
        if obj.get("method") == "tools/call" or ("name" in obj and "arguments" in obj):
            return from_mcp(obj)
        content = obj.get("content")
        if isinstance(content, str):
            return from_hermes(content)[1]
        if isinstance(content, list):
            return from_anthropic(content)
        if content is None and "role" in obj:
            return []
    elif isinstance(obj, Sequence) and not isinstance(obj, (bytes, bytearray)):
        items = [_as_mapping(item) for item in obj]
        if not items:
            return []
        first = items[0]
        if isinstance(first, Mapping) and "function" in first:
            return from_openai(items)
        if all(isinstance(item, Mapping) and "type" in item for item in items):
            return from_anthropic(items)
    raise ValueError(f"not a recognized tool-call shape: {clip(repr(obj), 120)}")
