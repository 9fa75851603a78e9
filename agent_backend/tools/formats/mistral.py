"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list, or ``[TOOL_CALLS]name[ARGS]{...}``.

The first form (Mistral 7B v0.3, Mixtral, Nemo: tokenizers before v11) is
``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": ...}, ...]``. The
second (v11 and later: Mistral Small 3.x, Magistral, Devstral) repeats
``[TOOL_CALLS]name[ARGS]{json}`` once per call, with ``[CALL_ID]id`` before
``[ARGS]`` in some versions. Each call's JSON is read only up to the next
``[TOOL_CALLS]``, so a broken call cannot swallow the next one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    arguments_object,
    arguments_text,
    capped,
    clip_error,
    decode_json_prefix,
    dump_json,
    error_call,
    json_call,
)

__all__ = ["ARGS", "CALL_ID", "TOOL_CALLS", "parse", "render"]

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_SPACE = re.compile(r"[ \t\r\n]*")


def _skip_space(text: str, pos: int, stop: int) -> int:
    return min(_SPACE.match(text, pos).end(), stop)  # type: ignore[union-attr]


_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _list_form(text: str, pos: int, stop: int, calls: list[ToolCall]) -> int:
    """``[{...}, ...]`` (or one object) at ``pos``: its calls; where it ended."""
    try:
        value, end = decode_json_prefix(text, pos, stop)
    except ValueError as exc:
        calls.append(
            error_call(
                len(calls), "mistral", f"the tool calls are not valid JSON: {clip_error(str(exc))}"
            )
        )
        return stop
    items: list[Any] = value if isinstance(value, list) and value else [value]
    for item in items:
        raw_id = item.get("id") if isinstance(item, dict) else None
        call_id = raw_id if isinstance(raw_id, str) and raw_id else ""
        calls.append(json_call(item, len(calls), "mistral", what="[TOOL_CALLS]", call_id=call_id))
    return end


def _args_form(text: str, pos: int, stop: int, calls: list[ToolCall]) -> int:
    """``name[CALL_ID]id[ARGS]{json}`` at ``pos``: one call; where it ended."""
    index = len(calls)
    args = text.find(ARGS, pos, stop)
    if args < 0:
        head = text[pos:stop].strip()
        name = head if _NAME.fullmatch(head[:65]) else ""
        error = f"the tool call has no {ARGS} (cut off, or not a tool call)"
        calls.append(error_call(index, "mistral", error, name=name))
        return stop
    head = text[pos:args]
    name, _, call_id = head.partition(CALL_ID)
    name, call_id = name.strip(), call_id.strip()
    if not name:
        calls.append(error_call(index, "mistral", "the tool call has no name", call_id=call_id))
        return stop
    start = args + len(ARGS)
    start = _skip_space(text, start, stop)
    try:
        value, end = decode_json_prefix(text, start, stop)
    except ValueError as exc:
        error = f"the arguments of {name!r} are not valid JSON: {clip_error(str(exc))}"
        calls.append(error_call(index, "mistral", error, name=name, call_id=call_id))
        return stop
    if not isinstance(value, (dict, str)):
        error = f"the arguments of {name!r} must be a JSON object, not {type(value).__name__}"
        calls.append(error_call(index, "mistral", error, name=name, call_id=call_id))
        return end
    calls.append(ToolCall(call_id or f"call_{index}", name, value, "mistral"))
    return end


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a Mistral reply; text outside the calls is prose."""
    prose: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    more = False
    marker = text.find(TOOL_CALLS)
    while marker >= 0:
        prose.append(text[pos:marker])
        if len(calls) >= MAX_CALLS:
            more = True
            pos = len(text)
            break
        start = marker + len(TOOL_CALLS)
        following = text.find(TOOL_CALLS, start)
        stop = following if following >= 0 else len(text)
        start = _skip_space(text, start, stop)
        if start < stop and text[start] in "[{" and not text.startswith((ARGS, CALL_ID), start):
            pos = _list_form(text, start, stop, calls)
        elif start >= stop:
            calls.append(error_call(len(calls), "mistral", f"{TOOL_CALLS} with no call after it"))
            pos = stop
        else:
            pos = _args_form(text, start, stop, calls)
        marker = following
    prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "mistral", more=more)


def render(calls: Sequence[ToolCall], content: str = "", *, style: str = "args") -> str:
    """As Mistral's templates write an assistant turn's calls after its content.

    ``style="args"`` (default; v11+ templates): ``[TOOL_CALLS]name[ARGS]{json}`` per call.
    ``style="list"`` (v0.3 templates): ``[TOOL_CALLS] [{"name": ..., "arguments": ..., "id": ...}]``.
    """
    if style == "args":
        return content + "".join(
            f"{TOOL_CALLS}{call.name}{ARGS}{arguments_text(call, 'mistral')}" for call in calls
        )
    if style == "list":
        items = ", ".join(
            f'{{"name": "{call.name}", "arguments": {dump_json(dict(arguments_object(call, "mistral")))}, '
            f'"id": "{call.id}"}}'
            for call in calls
        )
        return f"{content}{TOOL_CALLS} [{items}]"
    raise ValueError(f"unknown mistral style {style!r}: 'args' or 'list'")
