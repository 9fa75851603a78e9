"""Locating tool calls in OpenAI, Anthropic, Hermes and MCP output, failing loudly on what cannot be read."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from agent_backend.tools.calls import (
    MAX_CALLS,
    ToolCall,
    from_anthropic,
    from_hermes,
    from_mcp,
    from_openai,
    parse_tool_calls,
)

# -- OpenAI ---------------------------------------------------------------------------------------

OPENAI_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_abc",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"type": "function", "function": {"name": "math_factorial", "arguments": '{"number": 5}'}},
    ],
}


def test_openai_tool_calls_keep_arguments_raw() -> None:
    calls = from_openai(OPENAI_MESSAGE)
    assert calls == [
        ToolCall("call_abc", "get_weather", '{"city": "Paris"}', "openai"),
        ToolCall("call_1", "math_factorial", '{"number": 5}', "openai"),
    ]
    assert from_openai(OPENAI_MESSAGE["tool_calls"]) == calls


def test_openai_legacy_function_call() -> None:
    message = {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}
    assert from_openai(message) == [ToolCall("call_0", "f", "{}", "openai")]


def test_openai_message_without_calls() -> None:
    assert from_openai({"role": "assistant", "content": "hi", "tool_calls": None}) == []
    assert from_openai({"role": "assistant", "content": "hi", "tool_calls": []}) == []


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"id": "x", "type": "function", "function": {"name": "f"}}, "no arguments"),
        ({"id": "x", "type": "function", "function": {"arguments": "{}"}}, "no name"),
        ({"id": "x", "type": "function", "function": {"name": "f", "arguments": 5}}, "JSON string"),
        ({"id": "x", "type": "custom", "custom": {"name": "f", "input": ""}}, "unsupported"),
        ("not a dict", "must be an object"),
    ],
)
def test_openai_unreadable_calls_keep_their_place_with_error(raw: Any, error: str) -> None:
    (call,) = from_openai([raw])
    assert call.error is not None
    assert error in call.error
    assert call.arguments == ""


def test_openai_sdk_objects_are_read_through_model_dump() -> None:
    class FakeSDKMessage:
        def model_dump(self) -> dict[str, Any]:
            return OPENAI_MESSAGE

    assert from_openai(FakeSDKMessage()) == from_openai(OPENAI_MESSAGE)  # type: ignore[arg-type]


# -- Anthropic ------------------------------------------------------------------------------------

ANTHROPIC_CONTENT: list[dict[str, Any]] = [
    {"type": "text", "text": "Let me look."},
    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
    {"type": "tool_use", "id": "toolu_02", "name": "fs.read_file", "input": {}},
]


def test_anthropic_tool_use_blocks() -> None:
    calls = from_anthropic(ANTHROPIC_CONTENT)
    assert calls == [
        ToolCall("toolu_01", "get_weather", {"city": "Paris"}, "anthropic"),
        ToolCall("toolu_02", "fs.read_file", {}, "anthropic"),
    ]
    assert from_anthropic({"role": "assistant", "content": ANTHROPIC_CONTENT}) == calls


def test_anthropic_bad_input_is_an_error_call() -> None:
    (call,) = from_anthropic([{"type": "tool_use", "id": "t", "name": "f", "input": [1]}])
    assert call.error is not None
    assert "object" in call.error


# -- Hermes ---------------------------------------------------------------------------------------

HERMES_TEXT = """I'll check the weather in both cities, then compute.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": "{\\"city\\": \\"Tokyo\\"}"}
</tool_call>
And one more thing:
<tool_call>{"name": "math.factorial", "arguments": {"number": 5}}</tool_call>
Done."""


def test_hermes_three_calls_and_prose() -> None:
    text, calls = from_hermes(HERMES_TEXT)
    assert calls == [
        ToolCall("call_0", "get_weather", {"city": "Paris"}, "hermes"),
        ToolCall("call_1", "get_weather", '{"city": "Tokyo"}', "hermes"),
        ToolCall("call_2", "math.factorial", {"number": 5}, "hermes"),
    ]
    assert text == (
        "I'll check the weather in both cities, then compute.\n\n\nAnd one more thing:\n\nDone."
    )


def test_hermes_text_without_calls_is_kept_whole() -> None:
    assert from_hermes("  just prose, mentioning </tool_call> once  ") == (
        "just prose, mentioning </tool_call> once",
        [],
    )


def test_hermes_unparseable_block_is_an_error_call_not_dropped() -> None:
    text, calls = from_hermes(
        'a<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>b'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert text == "ab"
    assert [c.name for c in calls] == ["", "g"]
    assert calls[0].error is not None
    assert "not valid JSON" in calls[0].error
    assert calls[0].arguments == ""
    assert calls[1].error is None


def test_hermes_unclosed_block_at_end_is_an_error_call() -> None:
    text, calls = from_hermes('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "P')
    assert text == "Sure."
    (call,) = calls
    assert call.name == "get_weather"  # named, so the model's error message can say which
    assert call.error is not None
    assert "unclosed" in call.error
    assert "end of the message" in call.error


def test_hermes_block_interrupted_by_another_block() -> None:
    _, calls = from_hermes(
        '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert [(c.name, c.error is None) for c in calls] == [("a", False), ("b", True)]
    assert calls[0].error is not None
    assert "next block" in calls[0].error


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f"}', ToolCall("call_0", "f", {}, "hermes")),
        ('{"name": "f", "parameters": {"a": 1}}', ToolCall("call_0", "f", {"a": 1}, "hermes")),
        (
            '```json\n{"name": "f", "arguments": {"a": 1}}\n```',
            ToolCall("call_0", "f", {"a": 1}, "hermes"),
        ),
        ('{"name": "f", "arguments": {"n": 123456789012345678901234567890}}', None),
    ],
)
def test_hermes_body_variants(body: str, expected: ToolCall | None) -> None:
    _, (call,) = from_hermes(f"<tool_call>{body}</tool_call>")
    if expected is None:  # integers beyond 64 bits still parse
        assert call.arguments == {"n": 123456789012345678901234567890}
    else:
        assert call == expected


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("[1, 2]", "JSON object"),
        ('"f"', "JSON object"),
        ('{"arguments": {}}', "no name"),
        ('{"name": "f", "arguments": [1]}', "must be an object"),
        ('{"name": "f", "arguments": {}, "parameters": {}}', "both"),
        ('{"name": "f", "arguments": {"x": NaN}}', "not valid JSON"),
        ("", "not valid JSON"),
    ],
)
def test_hermes_bad_bodies(body: str, error: str) -> None:
    _, calls = from_hermes(f"<tool_call>{body}</tool_call>")
    assert calls
    assert calls[0].error is not None
    assert error in calls[0].error


def test_hermes_list_in_one_block_gives_several_calls() -> None:
    _, calls = from_hermes(
        '<tool_call>[{"name": "a"}, {"name": "b", "arguments": {"x": 1}}]</tool_call>'
    )
    assert [(c.id, c.name) for c in calls] == [("call_0", "a"), ("call_1", "b")]


def test_hermes_call_count_is_capped() -> None:
    block = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    _, calls = from_hermes(block * (MAX_CALLS + 10))
    assert len(calls) == MAX_CALLS + 1
    assert calls[-1].error is not None
    assert "more than" in calls[-1].error
    assert all(c.error is None for c in calls[:-1])


@pytest.mark.parametrize(
    "text",
    [
        "x" * 10_000_000,
        "<tool_call>" * 1_000_000,
        ("<tool_call>" + "y" * 100) * 90_000,
        "<tool_call>" + '{"name": "f", "arguments": {"a": "' + "z" * 10_000_000 + '"}}</tool_call>',
        "</tool_call>" * 800_000,
    ],
    ids=["prose", "opens", "opens-with-bodies", "one-big-call", "closes"],
)
def test_hermes_scans_10mb_in_linear_time(text: str) -> None:
    started = time.perf_counter()
    from_hermes(text)
    assert time.perf_counter() - started < 2.0


# -- MCP ------------------------------------------------------------------------------------------


def test_mcp_params_and_request() -> None:
    assert from_mcp({"name": "f", "arguments": {"a": 1}}) == [
        ToolCall("call_0", "f", {"a": 1}, "mcp")
    ]
    request = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "f"}}
    assert from_mcp(request) == [ToolCall("7", "f", {}, "mcp")]


def test_mcp_bad_arguments() -> None:
    (call,) = from_mcp({"name": "f", "arguments": "{}"})
    assert call.error is not None


# -- detection ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "fmt", "count"),
    [
        (OPENAI_MESSAGE, "openai", 2),
        (OPENAI_MESSAGE["tool_calls"], "openai", 2),
        (OPENAI_MESSAGE["tool_calls"][0], "openai", 1),
        ({"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, "openai", 1),
        ({"name": "f", "arguments": "{}"}, "openai", 1),
        (ANTHROPIC_CONTENT, "anthropic", 2),
        ({"role": "assistant", "content": ANTHROPIC_CONTENT}, "anthropic", 2),
        (ANTHROPIC_CONTENT[1], "anthropic", 1),
        (HERMES_TEXT, "hermes", 3),
        ({"role": "assistant", "content": HERMES_TEXT, "tool_calls": []}, "hermes", 3),
        ({"name": "f", "arguments": {}}, "mcp", 1),
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "f"}}, "mcp", 1),
    ],
)
def test_parse_tool_calls_detects_the_format(obj: Any, fmt: str, count: int) -> None:
    calls = parse_tool_calls(obj)
    assert len(calls) == count
    assert {c.format for c in calls} == {fmt}


def test_parse_tool_calls_empty_shapes() -> None:
    assert parse_tool_calls([]) == []
    assert parse_tool_calls({"role": "assistant", "content": None}) == []
    assert parse_tool_calls("no calls") == []


@pytest.mark.parametrize("obj", [42, {"foo": 1}, [1, 2], b"<tool_call>"])
def test_parse_tool_calls_rejects_unknown_shapes(obj: Any) -> None:
    with pytest.raises(ValueError, match="not a recognized"):
        parse_tool_calls(obj)


def test_ids_are_deterministic_per_message() -> None:
    first = [c.id for c in from_hermes(HERMES_TEXT)[1]]
    assert first == [c.id for c in from_hermes(HERMES_TEXT)[1]] == ["call_0", "call_1", "call_2"]


def test_tool_call_is_frozen() -> None:
    call = ToolCall("a", "f", "{}", "openai")
    with pytest.raises(AttributeError):
        call.name = "g"  # type: ignore[misc]
    assert json.loads(str(call.arguments)) == {}


def test_hermes_last_block_cut_off_by_a_stop_sequence_still_counts() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    prose, calls = from_hermes(text)
    assert prose == "Let me check."
    assert len(calls) == 1
    assert calls[0].error is None
    assert calls[0].name == "get_weather"
    assert calls[0].arguments == {"city": "Oslo"}


def test_hermes_last_block_cut_off_mid_json_is_an_error() -> None:
    _, calls = from_hermes('<tool_call>{"name": "get_weather", "arguments": {"city": "Os')
    assert len(calls) == 1
    assert calls[0].error is not None
    assert calls[0].name == "get_weather"
