"""Kimi K2 tool calls: ``<|tool_calls_section_begin|>...<|tool_calls_section_end|>``.

Each call is ``<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{json}<|tool_call_end|>``;
the header (``functions.name:index``) is Kimi's own call id, and the name is
what lies between ``functions.`` and the last ``:``. Text outside the section
is prose; a section the model never closed still yields its closed calls.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    arguments_text,
    blocks,
    capped,
    error_call,
    json_arguments,
)

__all__ = [
    "ARGUMENT_BEGIN",
    "CALL_BEGIN",
    "CALL_END",
    "SECTION_BEGIN",
    "SECTION_END",
    "parse",
    "render",
]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_END = "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"

_KIMI_ID = re.compile(r"functions\.[^\s:<]+:\d+")


def _call(body: str, index: int) -> ToolCall:
    header, sep, arguments = body.partition(ARGUMENT_BEGIN)
    header = header.strip()
    base, colon, number = header.rpartition(":")
    if not colon or not number.isdigit():
        base = header
    name = "" if base.isdigit() else base.removeprefix("functions.")  # a bare counter: no name
    call_id = header if (colon and number.isdigit()) or header.isdigit() else ""
    if not sep:
        error = f"the tool call has no {ARGUMENT_BEGIN} (cut off, or malformed)"
        return error_call(
            index, "kimi_k2", error, name=name if "<" not in name else "", call_id=call_id
        )
    if not name or "<" in name or any(c.isspace() for c in name):
        return error_call(index, "kimi_k2", "the tool call has no name", call_id=call_id)
    return json_arguments(arguments, index, "kimi_k2", name, call_id=call_id, what=repr(name))


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a Kimi K2 reply."""
    prose: list[str] = []
    calls: list[ToolCall] = []
    more = False
    pos = 0
    while not more:
        section = text.find(SECTION_BEGIN, pos)
        if section < 0:
            break
        prose.append(text[pos:section])
        body_start = section + len(SECTION_BEGIN)
        section_end = text.find(SECTION_END, body_start)
        stop = section_end if section_end >= 0 else len(text)
        for block in blocks(text, CALL_BEGIN, CALL_END, body_start, stop):
            if len(calls) >= MAX_CALLS:
                more = True
                break
            call = _call(text[block.body_start : block.body_end], len(calls))
            if block.ending == "closed" or (
                block.ending == "end" and section_end >= 0 and call.error is None
            ):
                calls.append(call)
                continue
            where = "the next call" if block.ending == "next" else "the end of the calls"
            error = f"unclosed tool call (no {CALL_END} before {where})"
            calls.append(
                error_call(
                    len(calls),
                    "kimi_k2",
                    error,
                    name=call.name,
                    call_id=call.id if call.id.startswith("functions.") else "",
                )
            )
        pos = stop + len(SECTION_END) if section_end >= 0 else len(text)
    prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "kimi_k2", more=more)


def _kimi_id(call: ToolCall, index: int) -> str:
    own = _KIMI_ID.fullmatch(call.id) and call.id.rpartition(":")[0] == f"functions.{call.name}"
    return call.id if own else f"functions.{call.name}:{index}"


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As the Kimi K2 template writes an assistant turn's calls after its content.

    A call whose id is already Kimi's (``functions.name:index``) keeps it;
    others get ``functions.<name>:<position>``.
    """
    rendered = "".join(
        f"{CALL_BEGIN}{_kimi_id(call, i)}{ARGUMENT_BEGIN}{arguments_text(call, 'kimi_k2')}{CALL_END}"
        for i, call in enumerate(calls)
    )
    return f"{content}{SECTION_BEGIN}{rendered}{SECTION_END}"
