"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, several joined by ``;``.

Llama 3.1/3.2/3.3 answer a tool call with bare JSON as the whole reply, or
after the ``<|python_tag|>`` token; ``"arguments"`` is accepted for
``"parameters"``, and a JSON list of such objects as several calls. Bare JSON
counts as calls only when the reply starts with an object whose first key is
``name``, ``parameters`` or ``arguments`` (a reply that merely contains JSON
is prose); after ``<|python_tag|>`` everything is read as calls.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    arguments_object,
    capped,
    clip_error,
    decode_json_prefix,
    dump_json,
    error_call,
    json_call,
)

__all__ = ["PYTHON_TAG", "parse", "render"]

PYTHON_TAG = "<|python_tag|>"
# The head of a bare reply that opens a call object (looked for in its first 4096 characters).
_CALL_HEAD = re.compile(r'\s*[\[]?\s*\{\s*"(?:name|parameters|arguments)"\s*:')
_SPACE = re.compile(r"[ \t\r\n]*")


def _skip_space(text: str, pos: int, stop: int) -> int:
    return min(_SPACE.match(text, pos).end(), stop)  # type: ignore[union-attr]


def _calls_at(text: str, pos: int, calls: list[ToolCall]) -> tuple[int, bool]:
    """Read ``;``-separated call objects from ``pos``; where they stop, and whether capped."""
    stop = len(text)
    while True:
        pos = _skip_space(text, pos, stop)
        if pos >= stop or text[pos] not in "{[":
            return pos, False
        if len(calls) >= MAX_CALLS:
            return stop, True
        try:
            value, end = decode_json_prefix(text, pos, stop)
        except ValueError as exc:
            # Where this value ends cannot be known, so the rest is one unreadable call.
            error = f"the tool call is not valid JSON: {clip_error(str(exc))}"
            calls.append(error_call(len(calls), "llama3", error, name=_guess(text, pos)))
            return stop, False
        items = value if isinstance(value, list) and value else [value]
        for item in items:
            calls.append(json_call(item, len(calls), "llama3", what="a Llama tool call"))
        pos = end
        pos = _skip_space(text, pos, stop)
        if pos < stop and text[pos] == ";":
            pos += 1


_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


def _guess(text: str, pos: int) -> str:
    match = _NAME.search(text, pos, pos + 512)
    return match.group(1) if match else ""


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a Llama 3 reply: text before ``<|python_tag|>`` or after the JSON is prose."""
    calls: list[ToolCall] = []
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        before = text[:tag]
        start = tag + len(PYTHON_TAG)
    elif _CALL_HEAD.match(text, 0, 4096):
        before, start = "", 0
    else:
        return text.strip(), []
    end, more = _calls_at(text, start, calls)
    if not calls and tag < 0:
        return text.strip(), []
    after = text[end:]
    prose = (before + after).strip() if calls or tag >= 0 else text.strip()
    return prose, capped(calls, "llama3", more=more)


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As the Llama 3.1/3.2 templates write a call (``{"name": ..., "parameters": ...}``).

    Several calls are joined with ``"; "`` (the templates take one per turn);
    with ``content``, the calls follow it after ``<|python_tag|>``.
    """
    rendered = "; ".join(
        f'{{"name": "{call.name}", "parameters": {dump_json(dict(arguments_object(call, "llama3")))}}}'
        for call in calls
    )
    return f"{content}{PYTHON_TAG}{rendered}" if content else rendered
