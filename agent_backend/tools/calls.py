"""Locate the tool calls in model output, in any of the four formats, as :class:`ToolCall`.

Formats: OpenAI chat ``tool_calls`` (and the legacy ``function_call``),
Anthropic ``tool_use`` content blocks, Hermes/Qwen ``<tool_call>`` tags in
text, and MCP ``tools/call`` params. :func:`parse_tool_calls` detects which.

This module only *locates* calls: arguments stay raw (the JSON text or the
mapping the model produced) for :meth:`Tool.prepare` to parse and check. It
must never drop a call it found but could not read, and never replace
unreadable arguments with ``{}`` (the tool would run with empty arguments):
such a call keeps its place with ``error`` set. Every scan is linear in the
input and the number of calls per message is capped, so a 10 MB reply cannot cost quadratic time.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import orjson

from agent_backend.errors import clip

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

CallFormat = Literal["openai", "anthropic", "hermes", "mcp"]

#: Most calls read from one message; the rest become one call with ``error`` set.
MAX_CALLS = 128

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"

_ERROR_LIMIT = 300
# A ```json fence some models wrap around the block's JSON.
_FENCE = re.compile(r"\A```[A-Za-z]*\s*(.*?)\s*```\Z", re.DOTALL)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call as the model made it; ``arguments`` are raw and unchecked.

    ``error`` is set when the call could be located but not read (an unclosed
    tag, JSON that does not parse, a missing name); such a call must be
    answered with an error, never run.
    """

    id: str
    name: str
    arguments: str | Mapping[str, Any]
    format: CallFormat
    error: str | None = None


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


def _overflow(fmt: CallFormat, index: int) -> ToolCall:
    return ToolCall(
        f"call_{index}", "", "", fmt, error=f"more than {MAX_CALLS} tool calls in one message"
    )


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
        calls.append(_overflow("openai", MAX_CALLS))
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
            calls.append(_overflow("anthropic", index))
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


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# orjson turns integers beyond 64 bits into floats, silently losing digits;
# text with such a digit run (even inside a string: harmless) takes the
# exact standard-library parser instead.
_LONG_DIGITS = re.compile(r"\d{19}")


def _load_json(text: str) -> Any:
    """Exactly one JSON value, integers exact; NaN and Infinity refused."""
    if _LONG_DIGITS.search(text) is None:
        return orjson.loads(text)
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None


def _hermes_body(body: str, first_index: int) -> list[ToolCall]:
    """The calls of one closed ``<tool_call>`` block: one object, or a list of them."""
    text = body.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        value = _load_json(text)
    except (ValueError, RecursionError) as exc:
        error = f"the {HERMES_OPEN} block is not valid JSON: {clip(str(exc), 200)}"
        return [ToolCall(f"call_{first_index}", "", "", "hermes", error=error)]
    items = value if isinstance(value, list) and value else [value]
    return [_hermes_item(item, first_index + i) for i, item in enumerate(items)]


def _hermes_item(item: object, index: int) -> ToolCall:
    call_id = f"call_{index}"
    if not isinstance(item, dict):
        kind = type(item).__name__
        return ToolCall(
            call_id,
            "",
            "",
            "hermes",
            error=f"a {HERMES_OPEN} block must hold a JSON object, not {kind}",
        )
    error: str | None
    name, error = _name_of(item.get("name"))
    if "arguments" in item and "parameters" in item:
        error = error or "the tool call has both 'arguments' and 'parameters'"
    # Llama-style calls say "parameters"; an omitted key is a call with no
    # arguments (the object itself parsed, so nothing was lost).
    arguments = item.get("arguments", item.get("parameters", {}))
    if error is None and isinstance(arguments, (dict, str)):
        return ToolCall(call_id, name, arguments, "hermes")
    if error is None:
        error = f"arguments must be an object, not {type(arguments).__name__}"
    return ToolCall(call_id, name, "", "hermes", error=error)


def from_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """``(remaining_text, calls)`` of Hermes/Qwen-style ``<tool_call>{...}</tool_call>`` blocks.

    The prose around the blocks is kept (blocks cut out, ends stripped). A
    block whose JSON does not parse, or that is never closed (the next
    ``<tool_call>`` comes first), becomes a call with ``error`` set. A last
    block cut off by the end of the message (servers that stop on
    ``</tool_call>`` drop it) counts when what it holds is a complete call.
    One forward scan: linear in ``len(text)``.
    """
    prose: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    overflowed = False
    close = 0  # position of the next closing tag at or after ``pos``, -1: none left
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            prose.append(text[pos:])
            break
        prose.append(text[pos:start])
        if len(calls) >= MAX_CALLS:
            overflowed = True
            break
        body_start = start + len(HERMES_OPEN)
        if 0 <= close < body_start:
            # Searched again only when passed, so unclosed blocks cost no rescans.
            close = text.find(HERMES_CLOSE, body_start)
        reopen = text.find(HERMES_OPEN, body_start, close if close >= 0 else len(text))
        if close < 0 and reopen < 0:
            # Runs to the end of the message: a server whose stop sequence is
            # the closing tag cuts it off. A complete call inside still counts.
            tail = _hermes_body(text[body_start:], len(calls))
            if tail and all(call.error is None for call in tail):
                calls.extend(tail)
                pos = len(text)
                continue
        if close < 0 or reopen >= 0:
            stop = reopen if reopen >= 0 else len(text)
            where = "the next block" if reopen >= 0 else "the end of the message"
            calls.append(
                ToolCall(
                    f"call_{len(calls)}",
                    _guess_name(text, body_start, stop),
                    "",
                    "hermes",
                    error=f"unclosed {HERMES_OPEN} block (no {HERMES_CLOSE} before {where})",
                )
            )
            pos = stop
            continue
        calls.extend(_hermes_body(text[body_start:close], len(calls)))
        pos = close + len(HERMES_CLOSE)
    if overflowed or len(calls) > MAX_CALLS:
        del calls[MAX_CALLS:]
        calls.append(_overflow("hermes", MAX_CALLS))
    return "".join(prose).strip(), calls


# Only the head of an unreadable block is searched for a name, to name it in the error.
_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


def _guess_name(text: str, start: int, stop: int) -> str:
    match = _NAME.search(text, start, min(stop, start + 512))
    return match.group(1) if match else ""


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


def parse_tool_calls(obj: object) -> list[ToolCall]:
    """The calls in ``obj``, whichever of the four formats it is in.

    A ``str`` is Hermes text (use :func:`from_hermes` to keep the prose); a
    message dict is recognized by ``tool_calls``/``function_call`` (OpenAI),
    ``tool_use`` blocks (Anthropic), ``method: tools/call`` or
    ``name``+``arguments`` (MCP), or Hermes tags in string ``content``. Raises
    ``ValueError`` for anything else: a wrong object is a programming error.
    """
    obj = _as_mapping(obj)
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
