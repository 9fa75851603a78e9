"""GLM-4.5/4.6/4.7 tool calls: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``.

The name comes first (then a newline, or directly the first ``<arg_key>``);
each argument is a key/value pair of bare text. Values are converted as
:mod:`._values` says: with the tool's schema, string parameters stay text and
the others are read as JSON; without one, JSON text is JSON. A pair that is
not closed, or a key given twice, makes the call an error call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
# Whitespace, and the literal "\n" some GLM outputs carry instead of newlines (SGLang reads both).
_SPACE = re.compile(r"(?:\s|\\n)*")


def _call(body: str, index: int, tools: ToolSchemas | None, cache: TypeCache) -> ToolCall:
    first = body.find(KEY_OPEN)
    name = (body if first < 0 else body[:first]).strip().removesuffix("\\n").strip()
    if not name or "<" in name or "\n" in name:
        error = "the tool call has no name" if not name else "the tool call's name is malformed"
        return error_call(index, "glm45", error)
    types = tool_types(tools, name, cache)
    arguments: dict[str, Any] = {}
    pos, size = (first if first >= 0 else len(body)), len(body)
    while True:
        pos = _SPACE.match(body, pos).end()  # type: ignore[union-attr]
        if pos >= size:
            break
        if not body.startswith(KEY_OPEN, pos):
            error = f"unexpected text where {KEY_OPEN} was expected"
            return error_call(index, "glm45", error, name=name)
        key_end = body.find(KEY_CLOSE, pos)
        value_open = body.find(VALUE_OPEN, pos)
        if key_end < 0 or value_open < 0 or value_open < key_end:
            return error_call(
                index, "glm45", f"an {KEY_OPEN} without its {KEY_CLOSE} and {VALUE_OPEN}", name=name
            )
        key = body[pos + len(KEY_OPEN) : key_end].strip()
        if _SPACE.fullmatch(body, key_end + len(KEY_CLOSE), value_open) is None:
            return error_call(
                index, "glm45", f"text between {KEY_CLOSE} and {VALUE_OPEN}", name=name
            )
        value_start = value_open + len(VALUE_OPEN)
        value_end = body.find(VALUE_CLOSE, value_start)
        if value_end < 0:
            return error_call(index, "glm45", f"an {VALUE_OPEN} without {VALUE_CLOSE}", name=name)
        if not key:
            return error_call(index, "glm45", "an argument with an empty key", name=name)
        if key in arguments:
            return error_call(index, "glm45", f"the argument {key!r} is given twice", name=name)
        arguments[key] = convert(body[value_start:value_end], types.get(key), untyped="json")
        pos = value_end + len(VALUE_CLOSE)
    return ToolCall(f"call_{index}", name, arguments, "glm45")


def parse(text: str, tools: ToolSchemas | None = None) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a GLM-4.5 reply; ``tools`` (name to parameters schema) type the values."""
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
        call = _call(text[block.body_start : block.body_end], len(calls), tools, cache)
        if block.ending != "closed":
            where = "the next call" if block.ending == "next" else "the end of the message"
            call = error_call(
                len(calls), "glm45", f"unclosed {OPEN} (no {CLOSE} before {where})", name=call.name
            )
        calls.append(call)
    else:
        prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "glm45", more=more)


def _value(value: object) -> str:
    return value if isinstance(value, str) else dump_json(value)


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As the GLM-4.5 template writes an assistant turn's calls after its content."""
    parts = [content]
    for call in calls:
        pairs = "".join(
            f"{KEY_OPEN}{key}{KEY_CLOSE}\n{VALUE_OPEN}{_value(value)}{VALUE_CLOSE}\n"
            for key, value in arguments_object(call, "glm45").items()
        )
        parts.append(f"\n{OPEN}{call.name}\n{pairs}{CLOSE}")
    return "".join(parts)
