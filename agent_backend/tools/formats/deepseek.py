"""DeepSeek V3/R1 and V3.1 tool calls, in a ``tool_calls_begin`` ... ``tool_calls_end`` section.

DeepSeek's markers are written ``<｜tool▁calls▁begin｜>`` with a fullwidth bar
(U+FF5C) and "▁" (U+2581) for spaces; below they are named without them. Each
call is ``tool_call_begin ... tool_call_end``; inside, V3 and R1 write
``function`` ``tool_sep`` ``name``, a newline and the arguments in a ```json
fence, V3.1 writes ``name`` ``tool_sep`` ``{json}``. Both are read; text
outside the section is prose. A section the model never closed still
yields its closed calls.
"""  # noqa: RUF002

from __future__ import annotations

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

__all__ = ["CALLS_BEGIN", "CALLS_END", "CALL_BEGIN", "CALL_END", "SEP", "parse", "render"]

# "\uff5c" is the fullwidth bar, "\u2581" the space-like block DeepSeek's tokens use.
CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"


def _unfence(text: str) -> str | None:
    """The inside of a ```json fence (its language tag optional), or None."""
    text = text.strip()
    if not text.startswith("```") or not text.endswith("```") or len(text) < 6:
        return None
    first_line = text.find("\n")
    language = text[3:first_line].strip() if first_line >= 0 else ""
    if first_line < 0 or (language and not language.isalpha()):
        return None
    return text[first_line + 1 : -3]


def _call(body: str, index: int) -> ToolCall:
    head, sep, tail = body.partition(SEP)
    if not sep:
        return error_call(index, "deepseek", f"the tool call has no {SEP} (cut off, or malformed)")
    head = head.strip()
    if head == "function" and not tail.lstrip().startswith("{"):
        # V3/R1: the type, then the name on its own line and the arguments in a fence.
        name, newline, rest = tail.partition("\n")
        name = name.strip()
        if not newline:
            return error_call(index, "deepseek", "the tool call has no arguments", name=name)
        fenced = _unfence(rest)
        if fenced is None:
            return error_call(
                index, "deepseek", "the arguments are not in a ```json fence", name=name
            )
        return json_arguments(fenced, index, "deepseek", name, what=repr(name))
    return json_arguments(tail, index, "deepseek", head, what=repr(head))


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of a DeepSeek reply."""
    prose: list[str] = []
    calls: list[ToolCall] = []
    more = False
    pos = 0
    while not more:
        section = text.find(CALLS_BEGIN, pos)
        if section < 0:
            break
        prose.append(text[pos:section])
        body_start = section + len(CALLS_BEGIN)
        section_end = text.find(CALLS_END, body_start)
        stop = section_end if section_end >= 0 else len(text)
        for block in blocks(text, CALL_BEGIN, CALL_END, body_start, stop):
            if len(calls) >= MAX_CALLS:
                more = True
                break
            if block.ending == "closed":
                calls.append(_call(text[block.body_start : block.body_end], len(calls)))
                continue
            call = _call(text[block.body_start : block.body_end], len(calls))
            if block.ending == "end" and call.error is None and section_end >= 0:
                calls.append(call)  # closed by the section's end
                continue
            where = "the next call" if block.ending == "next" else "the end of the calls"
            calls.append(
                error_call(
                    len(calls),
                    "deepseek",
                    f"unclosed tool call (no {CALL_END} before {where})",
                    name=call.name,
                )
            )
        pos = stop + len(CALLS_END) if section_end >= 0 else len(text)
    prose.append(text[pos:])
    return "".join(prose).strip(), capped(calls, "deepseek", more=more)


def render(calls: Sequence[ToolCall], content: str = "", *, style: str = "v3") -> str:
    """As DeepSeek's templates write an assistant turn's calls after its content.

    ``style="v3"`` (V3, R1; default): ``function``, ``tool_sep``, the name and
    a ```json fence, calls separated by a newline. ``style="v3.1"``: the
    name, ``tool_sep`` and the JSON.
    """
    if style == "v3":
        rendered = "\n".join(
            f"{CALL_BEGIN}function{SEP}{call.name}\n```json\n{arguments_text(call, 'deepseek')}\n```{CALL_END}"
            for call in calls
        )
    elif style == "v3.1":
        rendered = "".join(
            f"{CALL_BEGIN}{call.name}{SEP}{arguments_text(call, 'deepseek')}{CALL_END}"
            for call in calls
        )
    else:
        raise ValueError(f"unknown deepseek style {style!r}: 'v3' or 'v3.1'")
    return f"{content}{CALLS_BEGIN}{rendered}{CALLS_END}"
