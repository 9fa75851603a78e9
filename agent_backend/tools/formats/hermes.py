"""Hermes/Qwen2.5/Qwen3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A block holds one JSON object (or a list of them); some models wrap it in a
```json fence. The prose around the blocks is kept. Rendered as the Qwen2.5
and Qwen3 chat templates put a call in history.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    arguments_object,
    blocks,
    capped,
    clip_error,
    dump_json,
    error_call,
    json_call,
    load_json,
)

__all__ = ["CLOSE", "OPEN", "parse", "render"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

# A ```json fence some models wrap around the block's JSON.
_FENCE = re.compile(r"\A```[A-Za-z]*\s*(.*?)\s*```\Z", re.DOTALL)
# Only the head of an unreadable block is searched for a name, to name it in the error.
_NAME = re.compile(r'"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"')


def guess_name(text: str, start: int, stop: int) -> str:
    match = _NAME.search(text, start, min(stop, start + 512))
    return match.group(1) if match else ""


def _body(body: str, first_index: int) -> list[ToolCall]:
    """The calls of one closed block: one object, or a list of them."""
    text = body.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        value = load_json(text)
    except (ValueError, RecursionError) as exc:
        error = f"the {OPEN} block is not valid JSON: {clip_error(str(exc))}"
        return [error_call(first_index, "hermes", error)]
    items = value if isinstance(value, list) and value else [value]
    return [
        json_call(item, first_index + i, "hermes", what=f"a {OPEN} block")
        for i, item in enumerate(items)
    ]


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of ``<tool_call>`` blocks (see :func:`~agent_backend.tools.from_hermes`)."""
    prose: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    more = False
    for block in blocks(text, OPEN, CLOSE):
        prose.append(text[pos : block.start])
        pos = block.end
        if len(calls) >= MAX_CALLS:
            more = True
            break
        if block.ending == "closed":
            calls.extend(_body(text[block.body_start : block.body_end], len(calls)))
            continue
        if block.ending == "end":
            # Runs to the end of the message: a server whose stop sequence is
            # the closing tag cuts it off. A complete call inside still counts.
            tail = _body(text[block.body_start :], len(calls))
            if tail and all(call.error is None for call in tail):
                calls.extend(tail)
                continue
        where = "the next block" if block.ending == "next" else "the end of the message"
        calls.append(
            error_call(
                len(calls),
                "hermes",
                f"unclosed {OPEN} block (no {CLOSE} before {where})",
                name=guess_name(text, block.body_start, block.body_end),
            )
        )
    else:
        prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "hermes", more=more)


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As Qwen2.5/Qwen3 templates write an assistant turn: the content, then one block per call."""
    parts = [content] if content else []
    for call in calls:
        arguments = dump_json(dict(arguments_object(call, "hermes")))
        parts.append(f'{OPEN}\n{{"name": "{call.name}", "arguments": {arguments}}}\n{CLOSE}')
    return "\n".join(parts)
