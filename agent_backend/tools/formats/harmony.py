"""gpt-oss (OpenAI harmony) replies: messages on channels, tool calls addressed ``to=functions.name``.

A reply is a run of messages ``<|start|>assistant<|channel|>CHANNEL ...<|message|>BODY``
ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the first message's
``<|start|>assistant`` is usually the prompt's, so it may be missing). A
message whose header names a recipient (``to=functions.get_weather``, in the
role part or after the channel) is a tool call whose body is its arguments;
``analysis`` is reasoning and dropped; the prose is the ``final`` channel.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from agent_backend.tools.formats._base import (
    MAX_CALLS,
    ToolCall,
    arguments_object,
    capped,
    dump_json,
    error_call,
    json_arguments,
)

__all__ = ["CALL", "CHANNEL", "END", "MESSAGE", "RETURN", "START", "parse", "render"]

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
CONSTRAIN = "<|constrain|>"

# What ends a message body (or an unfinished one: the next message's start).
_BODY_END = re.compile(r"<\|(?:end|call|return|start)\|>")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """``(final channel text, calls)`` of a gpt-oss reply; text without harmony markers is prose."""
    if MESSAGE not in text:
        return text.strip(), []
    final: list[str] = []
    calls: list[ToolCall] = []
    more = False
    pos = 0
    size = len(text)
    message_at = text.find(MESSAGE)  # the next <|message|> at or after ``pos`` (-1: none left)
    while pos < size:
        if text.startswith(START, pos):
            pos += len(START)
        if 0 <= message_at < pos:
            message_at = text.find(MESSAGE, pos)
        if message_at < 0:
            break  # a header cut off before its body: nothing was said yet
        restart = text.find(START, pos, message_at)
        if restart >= 0:  # a header with no body, then another message: skip to it
            pos = restart
            continue
        header = text[pos:message_at]
        body_start = message_at
        body_start += len(MESSAGE)
        found = _BODY_END.search(text, body_start)
        body_end = found.start() if found else size
        ending = found.group() if found else ""
        pos = body_end + (len(ending) if ending and ending != START else 0)
        body = text[body_start:body_end]
        recipient = _RECIPIENT.search(header)
        role = header.split(CHANNEL, 1)[0].split(None, 1)
        if role and role[0] not in ("assistant",) and not role[0].startswith("to="):
            continue  # not the assistant's (a tool's answer echoed back)
        if recipient is None:
            channel = _CHANNEL.search(header)
            if channel is not None and channel.group(1) == "final":
                final.append(body)
            continue
        if len(calls) >= MAX_CALLS:
            more = True
            break
        name = recipient.group(1).removeprefix("functions.")
        call = json_arguments(body, len(calls), "harmony", name, what=repr(name))
        if not ending and call.error is not None:
            call = error_call(
                len(calls), "harmony", f"the call to {name!r} was cut off before {CALL}", name=name
            )
        calls.append(call)
    return "".join(final).strip(), capped(calls, "harmony", more=more)


def render(calls: Sequence[ToolCall], content: str = "") -> str:
    """As the gpt-oss template writes an assistant's tool calls in history.

    Each call is its own message, ``<|start|>assistant to=functions.name<|channel|>commentary
    json<|message|>{json}<|call|>``; ``content`` goes before them on the analysis
    channel, where the template puts an assistant's content that comes with calls.
    The text includes each message's ``<|start|>assistant``.
    """
    parts = [f"{START}assistant{CHANNEL}analysis{MESSAGE}{content}{END}"] if content else []
    for call in calls:
        arguments = dump_json(dict(arguments_object(call, "harmony")))
        parts.append(
            f"{START}assistant to=functions.{call.name}{CHANNEL}commentary json{MESSAGE}{arguments}{CALL}"
        )
    return "".join(parts)
