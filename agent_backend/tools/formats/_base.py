"""What every tool-call format shares: the :class:`ToolCall` record, the cap, and exact JSON.

Every family's parser (one file each in this package) returns ``(prose, calls)``
and keeps the same promises: a call it found is never dropped (one it cannot
read keeps its place with ``error`` set), unreadable arguments never become
``{}``, at most :data:`MAX_CALLS` calls come back (the rest become one error
call), and a scan is linear in the input: markers are found with ``str.find``
moving forward only, and JSON is decoded only inside a span already known to
end before the next marker. This module does no I/O.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import orjson

from agent_backend.errors import clip

__all__ = [
    "MAX_CALLS",
    "Block",
    "CallFormat",
    "TextFormat",
    "ToolCall",
    "ToolSchemas",
    "blocks",
    "capped",
    "decode_json_prefix",
    "dump_json",
    "error_call",
    "load_json",
    "overflow",
]

#: The text formats open models write their tool calls in (one parser each in this package).
TextFormat = Literal[
    "hermes", "llama3", "mistral", "deepseek", "glm45", "kimi_k2", "qwen3_coder", "harmony"
]
#: Every shape a :class:`ToolCall` can come from: the structured APIs and the text formats.
CallFormat = Literal[
    "openai",
    "anthropic",
    "mcp",
    "hermes",
    "llama3",
    "mistral",
    "deepseek",
    "glm45",
    "kimi_k2",
    "qwen3_coder",
    "harmony",
]
#: Tool parameter schemas by tool name (``{name: parameters}``), for the formats whose
#: argument values are bare text (glm45, qwen3_coder) and need a schema to tell strings
#: from numbers.
ToolSchemas = Mapping[str, Mapping[str, Any]]

#: Most calls read from one message; the rest become one call with ``error`` set.
MAX_CALLS = 128

_ERROR_LIMIT = 200


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


def error_call(
    index: int, fmt: CallFormat, error: str, *, name: str = "", call_id: str = ""
) -> ToolCall:
    """A call that was found but cannot be read: no arguments, ``error`` set."""
    return ToolCall(call_id or f"call_{index}", name, "", fmt, error=error)


def overflow(fmt: CallFormat, index: int) -> ToolCall:
    return error_call(index, fmt, f"more than {MAX_CALLS} tool calls in one message")


def capped(calls: list[ToolCall], fmt: CallFormat, *, more: bool = False) -> list[ToolCall]:
    """``calls`` cut to :data:`MAX_CALLS`, plus one error call when there were more."""
    if more or len(calls) > MAX_CALLS:
        del calls[MAX_CALLS:]
        calls.append(overflow(fmt, MAX_CALLS))
    return calls


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# orjson turns integers beyond 64 bits into floats, silently losing digits:
# a value with a float in it, from text with such a digit run (even inside a
# string: harmless), is read again by the exact standard-library parser.
# (Looking for floats first: searching every text for digit runs costs ten
# times the parse.)
_LONG_DIGITS = re.compile(r"[0-9]{19}")
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def _has_float(value: object) -> bool:
    kind = type(value)
    if kind is float:
        return True
    if kind is not dict and kind is not list:
        return False
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        for inner in item.values() if type(item) is dict else item:
            kind = type(inner)
            if kind is float:
                return True
            if kind is dict or kind is list:
                stack.append(inner)
    return False


def load_json(text: str) -> Any:
    """Exactly one JSON value, integers exact; NaN and Infinity refused (``ValueError``)."""
    value = orjson.loads(text)
    if not _has_float(value) or _LONG_DIGITS.search(text) is None:
        return value
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None


def decode_json_prefix(text: str, start: int, stop: int) -> tuple[Any, int]:
    """The JSON value that begins at ``text[start]`` and ends before ``stop``, and its end.

    For formats whose JSON has no closing marker (Llama's ``;``-separated
    objects, Mistral's ``[ARGS]{...}``): only ``text[start:stop]`` is read, so
    a caller that bounds ``stop`` by the next marker keeps the scan linear.
    Raises ``ValueError`` with where the JSON broke.
    """
    # Read in place when the span runs to the end; a bounded span is its own (short) copy.
    span, offset = (text, start) if stop >= len(text) else (text[start:stop], 0)
    try:
        value, end = _DECODER.raw_decode(span, offset)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at character {exc.pos - offset + 1}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value, end if offset else start + end


def dump_json(value: object) -> str:
    """JSON as Hugging Face chat templates' ``tojson`` writes it (``", "``/``": "``, unicode kept)."""
    return json.dumps(value, ensure_ascii=False)


def clip_error(text: str) -> str:
    return clip(text, _ERROR_LIMIT)


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """One ``open ... close`` span of a text: its body, and how it ended."""

    start: int  # where ``open`` begins
    body_start: int
    body_end: int
    end: int  # just past ``close`` (or where the body stopped)
    ending: Literal["closed", "next", "end"]  # closed; cut by the next ``open``; cut by the end


def blocks(
    text: str, open_: str, close: str, start: int = 0, stop: int | None = None
) -> Iterator[Block]:
    """Every ``open ... close`` block of ``text[start:stop]``, in one forward scan.

    A block never closed before the next ``open`` ends there (``"next"``);
    one never closed at all runs to ``stop`` (``"end"``). The closing tag's
    position is searched again only when passed, so unclosed blocks cost no
    rescans: linear in ``stop - start``.
    """
    stop = len(text) if stop is None else stop
    pos = start
    close_at = start  # next closing tag at or after ``pos`` (-1: none left)
    while True:
        begin = text.find(open_, pos, stop)
        if begin < 0:
            return
        body_start = begin + len(open_)
        if 0 <= close_at < body_start:
            close_at = text.find(close, body_start, stop)
        reopen = text.find(open_, body_start, close_at if close_at >= 0 else stop)
        if reopen >= 0:
            yield Block(begin, body_start, reopen, reopen, "next")
            pos = reopen
        elif close_at < 0:
            yield Block(begin, body_start, stop, stop, "end")
            return
        else:
            yield Block(begin, body_start, close_at, close_at + len(close), "closed")
            pos = close_at + len(close)


def json_call(
    item: object, index: int, fmt: CallFormat, *, what: str, call_id: str = ""
) -> ToolCall:
    """A call from a decoded ``{"name": ..., "arguments"|"parameters": ...}`` object."""
    call_id = call_id or f"call_{index}"
    if not isinstance(item, dict):
        return error_call(
            index,
            fmt,
            f"{what} must hold a JSON object, not {type(item).__name__}",
            call_id=call_id,
        )
    raw_name = item.get("name")
    name = raw_name if isinstance(raw_name, str) else ""
    error: str | None = None if name else "the tool call has no name"
    if "arguments" in item and "parameters" in item:
        error = error or "the tool call has both 'arguments' and 'parameters'"
    # An omitted key is a call with no arguments (the object itself parsed, so nothing was lost).
    arguments = item.get("arguments", item.get("parameters", {}))
    if error is None and isinstance(arguments, (dict, str)):
        return ToolCall(call_id, name, arguments, fmt)
    if error is None:
        error = f"arguments must be an object, not {type(arguments).__name__}"
    return ToolCall(call_id, name, "", fmt, error=error)


def json_arguments(
    text: str, index: int, fmt: CallFormat, name: str, *, call_id: str = "", what: str
) -> ToolCall:
    """A call whose arguments are the JSON object ``text`` (kept parsed, checked to be one)."""
    call_id = call_id or f"call_{index}"
    if not name:
        return error_call(index, fmt, "the tool call has no name", call_id=call_id)
    try:
        value = load_json(text.strip())
    except (ValueError, RecursionError) as exc:
        error = f"the arguments of {what} are not valid JSON: {clip_error(str(exc))}"
        return error_call(index, fmt, error, name=name, call_id=call_id)
    if not isinstance(value, (dict, str)):
        error = f"the arguments of {what} must be a JSON object, not {type(value).__name__}"
        return error_call(index, fmt, error, name=name, call_id=call_id)
    return ToolCall(call_id, name, value, fmt)


def arguments_object(call: ToolCall, fmt: str) -> Mapping[str, Any]:
    """A call's arguments as a mapping, to render; ``ValueError`` for a call that cannot be."""
    if call.error is not None:
        raise ValueError(
            f"cannot render the tool call {call.name!r}: it has an error ({call.error})"
        )
    if not call.name:
        raise ValueError("cannot render a tool call without a name")
    arguments: Any = call.arguments
    if isinstance(arguments, str):
        try:
            arguments = load_json(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the arguments of {call.name!r} are not JSON: {exc}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(
            f"{fmt} renders arguments that are a JSON object, not {type(arguments).__name__}"
        )
    return arguments


def arguments_text(call: ToolCall, fmt: str) -> str:
    """A call's arguments as the JSON text a template inserts verbatim."""
    if isinstance(call.arguments, str) and call.error is None and call.name:
        arguments_object(call, fmt)  # checked to be an object
        return call.arguments
    return dump_json(dict(arguments_object(call, fmt)))
