"""Qwen3-Coder tool calls: ``<tool_call><function=name><parameter=k>v</parameter></function></tool_call>``.

Each parameter's value is bare text between ``<parameter=key>`` and
``</parameter>``, with the one newline the template writes on each side
removed. Values are converted as :mod:`._values` says, using the tool's
schema when given (vLLM's rule): without a schema a value stays text, for
the schema layer to check. A call whose ``</tool_call>`` is missing still
counts when its ``</function>`` is there; a ``</parameter>`` the model left
out is read as closed by the next ``<parameter=`` or ``</function>``, as vLLM does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    ToolSchemas,
    arguments_object,
    blocks,
    capped,
    dump_json,
    error_call,
)
from agent_backend.tools.formats._values import TypeCache, convert, tool_types

__all__ = ["CLOSE", "OPEN", "parse", "render"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_SPACE = re.compile(r"\s*")


def _trim(value: str) -> str:
    """One newline off each end: the template's, not the value's."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _function(
    body: str, pos: int, index: int, tools: ToolSchemas | None, cache: TypeCache
) -> tuple[ToolCall, int]:
    """The ``<function=...>`` at ``body[pos]``: its call, and where it ended (-1: not closed)."""
    name_end = body.find(">", pos)
    end = body.find(FUNCTION_END, pos)
    if name_end < 0 or (0 <= end < name_end):
        return error_call(index, "qwen3_coder", f"a {FUNCTION} without its closing '>'"), -1
    name = body[pos + len(FUNCTION) : name_end].strip()
    if end < 0:
        error = f"the call to {name!r} has no {FUNCTION_END}"
        return error_call(index, "qwen3_coder", error, name=name if "<" not in name else ""), -1
    if not name or "<" in name:
        return error_call(index, "qwen3_coder", "the tool call has no name"), end
    types = tool_types(tools, name, cache)
    arguments: dict[str, Any] = {}
    at = name_end + 1
    while True:
        at = _SPACE.match(body, at, end).end()  # type: ignore[union-attr]
        if at >= end:
            break
        if not body.startswith(PARAMETER, at):
            error = f"unexpected text in the call to {name!r} where {PARAMETER} was expected"
            return error_call(index, "qwen3_coder", error, name=name), end
        key_end = body.find(">", at, end)
        if key_end < 0:
            return error_call(
                index, "qwen3_coder", f"a {PARAMETER} without its '>'", name=name
            ), end
        key = body[at + len(PARAMETER) : key_end].strip()
        value_start = key_end + 1
        closed = body.find(PARAMETER_END, value_start, end)
        following = body.find(PARAMETER, value_start, closed if closed >= 0 else end)
        if following >= 0:
            value_end, at = following, following  # the model left </parameter> out
        elif closed >= 0:
            value_end, at = closed, closed + len(PARAMETER_END)
        else:
            value_end, at = end, end
        if not key:
            return error_call(index, "qwen3_coder", "a parameter with no name", name=name), end
        if key in arguments:
            return error_call(
                index, "qwen3_coder", f"the parameter {key!r} is given twice", name=name
            ), end
        arguments[key] = convert(
            _trim(body[value_start:value_end]), types.get(key), untyped="string"
        )
    return ToolCall(f"call_{index}", name, arguments, "qwen3_coder"), end + len(FUNCTION_END)


def _block(
    body: str, first_index: int, tools: ToolSchemas | None, cache: TypeCache, closed: bool
) -> list[ToolCall]:
    """The calls of one ``<tool_call>`` block (normally one ``<function=``)."""
    calls: list[ToolCall] = []
    pos = 0
    complete = (
        False  # the last call's </function> arrived, and nothing but a cut-off close after it
    )
    while True:
        pos = _SPACE.match(body, pos).end()  # type: ignore[union-attr]
        if pos >= len(body) or (not closed and calls and CLOSE.startswith(body[pos:])):
            complete = bool(calls) and calls[-1].error is None
            break
        index = first_index + len(calls)
        if not body.startswith(FUNCTION, pos):
            error = f"unexpected text in a {OPEN} block where {FUNCTION} was expected"
            calls.append(error_call(index, "qwen3_coder", error))
            break
        call, end = _function(body, pos, index, tools, cache)
        calls.append(call)
        if end < 0:
            break
        pos = end
    if not calls:
        calls.append(error_call(first_index, "qwen3_coder", f"an empty {OPEN} block"))
    if not closed and not complete:
        # Unclosed: only a call whose </function> arrived counts (a stop on </tool_call> cuts it).
        last = calls[-1]
        error = f"unclosed {OPEN} block (no {FUNCTION_END} and {CLOSE})"
        calls[-1] = error_call(first_index + len(calls) - 1, "qwen3_coder", error, name=last.name)
    return calls


def parse(text: str, tools: ToolSchemas | None = None) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a Qwen3-Coder reply; ``tools`` (name to parameters schema) type the values."""
    prose: list[str] = []
    calls: list[ToolCall] = []
    cache: TypeCache = {}
    pos = 0
    more = False
    for block in blocks(text, OPEN, CLOSE):
        prose.append(text[pos : block.start])
        pos = block.end
        if len(calls) >= MAX_CALLS:
            more = True
            break
        body = text[block.body_start : block.body_end]
        calls.extend(_block(body, len(calls), tools, cache, block.ending == "closed"))
    else:
        prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "qwen3_coder", more=more)


def _value(value: object) -> str:
    """As the template writes a value: ``tojson`` for objects and lists, ``| string`` otherwise."""
    if isinstance(value, (Mapping, list, tuple)):
        return dump_json(value)
    return str(value)


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As the Qwen3-Coder template writes an assistant turn: the content, then one block per call."""
    rendered = []
    for call in calls:
        parameters = "".join(
            f"{PARAMETER}{key}>\n{_value(value)}\n{PARAMETER_END}\n"
            for key, value in arguments_object(call, "qwen3_coder").items()
        )
        rendered.append(f"{OPEN}\n{FUNCTION}{call.name}>\n{parameters}{FUNCTION_END}\n{CLOSE}")
    calls_text = "\n".join(rendered)
    return f"{content.strip()}\n\n{calls_text}" if content.strip() else calls_text
