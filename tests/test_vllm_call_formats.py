"""Tool calls written in each model family's own text format, read from the real vLLM server.

A policy server that does not parse the model's calls (here ``tool_choice: "none"``: the
tools are in the prompt, the reply stays text, as from a server without a tool parser for
the family) returns the call as text; the policy reads it in the family's format
(``call_format``), having asked for the special tokens to be kept. Guided decoding (``structured_outputs``: a regex of the exact text
the family's template writes) makes the random tiny model write one call in each format.
The same holds token in, token out, where the completion's tokens are decoded on our side.
The call's ``code`` parameter is a string that looks like a number (``"007"``): the formats
that write values as bare text (GLM-4.5, Qwen3-Coder) are typed by the turn's tools.
"""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from support.vllm_server import STARTUP_TIMEOUT, VLLMServer, vllm_server_fixture  # noqa: F401

from agent_backend.rollout import (
    ChatTemplate,
    OpenAICompatiblePolicy,
    TokenPolicy,
    VLLMTokenSampler,
)
from agent_backend.tools import TextFormat, ToolCall, render_tool_calls

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(STARTUP_TIMEOUT + 120)]

NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Write a note.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "count": {"type": "integer"}},
            "required": ["code", "count"],
        },
    },
}
ARGUMENTS = {"code": "007", "count": 3}
MESSAGES = [{"role": "user", "content": "Write note 007, three times."}]
FORMATS = get_args(TextFormat)


def written(fmt: str) -> str:
    """The text of one note call as the family's chat template writes it."""
    return render_tool_calls([ToolCall("call_0", "note", ARGUMENTS, "openai")], format=fmt)  # type: ignore[arg-type]


def literal(text: str) -> str:
    """A regex that matches exactly ``text`` (escapes that structured outputs reads)."""
    return "".join(
        "\\n" if char == "\n" else "\\" + char if char in ".^$*+?()[]{}|\\" else char
        for char in text
    )


def read_calls(calls: Any) -> list[tuple[str, Any]]:
    return [
        (
            call.name,
            json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments,
        )
        for call in calls
    ]


@pytest.mark.parametrize("fmt", FORMATS)
async def test_chat_completions_read_the_call_in_the_model_family_format(
    vllm_server: VLLMServer, fmt: str
) -> None:
    text = written(fmt)
    async with OpenAICompatiblePolicy(
        vllm_server.url,
        model=vllm_server.model,
        call_format=fmt,  # type: ignore[arg-type]
        max_tokens=400,  # guided text comes out a character or two at a time
        extra_body={
            "structured_outputs": {"regex": literal(text)},
            "tool_choice": "none",  # the server parses nothing (its tool grammar stays off)
            "seed": 2,
        },
    ) as policy:
        turn = await policy.generate(MESSAGES, [NOTE_TOOL])
    assert read_calls(turn.tool_calls) == [("note", ARGUMENTS)], (fmt, turn.message)
    assert all(call.error is None for call in turn.tool_calls)
    # The reply is text; it goes back into the conversation as it was sampled.
    assert turn.message["content"] == text
    assert "tool_calls" not in turn.message
    assert turn.text.strip() == "" or fmt == "harmony"
    assert len(turn.completion_ids) == len(turn.logprobs) > 0


@pytest.mark.parametrize("fmt", ["llama3", "glm45", "qwen3_coder", "kimi_k2"])
async def test_token_in_token_out_reads_the_call_in_the_model_family_format(
    vllm_server: VLLMServer, fmt: str
) -> None:
    text = written(fmt)
    template = ChatTemplate.from_pretrained(str(vllm_server.model_dir), call_format=fmt)
    async with VLLMTokenSampler(
        vllm_server.url,
        model=vllm_server.model,
        max_tokens=400,
        extra_body={"structured_outputs": {"regex": literal(text)}, "seed": 2},
    ) as sampler:
        turn = await TokenPolicy(sampler, template).for_episode().generate(MESSAGES, [NOTE_TOOL])
    assert read_calls(turn.tool_calls) == [("note", ARGUMENTS)], (fmt, turn.message)
    assert template.tokenizer.decode(turn.completion_ids, skip_special_tokens=False).startswith(
        text
    )
    # As a chat endpoint with a tool parser answers: the calls apart, in OpenAI form.
    arguments = json.loads(turn.message["tool_calls"][0]["function"]["arguments"])
    assert arguments == ARGUMENTS


async def test_an_unknown_call_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown call_format"):
        OpenAICompatiblePolicy("http://127.0.0.1:9/v1", call_format="llama4")  # type: ignore[arg-type]
