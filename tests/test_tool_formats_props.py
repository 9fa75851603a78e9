"""Text tool-call formats: render-back round trips, the call cap, and linear time on 1-10 MB replies."""

from __future__ import annotations

import time
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_backend.tools import TextFormat, ToolCall, from_text, render_tool_calls
from agent_backend.tools.calls import MAX_CALLS

FORMATS: tuple[TextFormat, ...] = get_args(TextFormat)
# Every family with each of its template styles.
RENDERINGS: list[tuple[TextFormat, str | None]] = [
    *((fmt, None) for fmt in FORMATS),
    ("deepseek", "v3.1"),
    ("mistral", "list"),
]

# Names as tool names are (the templates insert them unescaped); text without any family's
# markup characters, so a value cannot close its own call (a limit of the formats themselves).
NAMES = st.from_regex(
    r"[A-Za-z_][A-Za-z0-9_]{0,20}(\.[A-Za-z_][A-Za-z0-9_]{0,10})?", fullmatch=True
)
TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="<>[]|\uff5c\\\r"), max_size=20
)
KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)
ARGUMENTS = st.dictionaries(KEYS, JSON, max_size=5)


def _schema_of(value: object) -> dict[str, Any]:
    """The schema a tool would declare for ``value`` (what types a bare-text value)."""
    if value is None:
        return {"type": "null"}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    return {"type": "array"} if isinstance(value, list) else {"type": "object"}


def _tools(calls: list[ToolCall]) -> dict[str, Any]:
    tools: dict[str, Any] = {}
    for call in calls:
        assert isinstance(call.arguments, dict)
        tools[call.name] = {
            "type": "object",
            "properties": {k: _schema_of(v) for k, v in call.arguments.items()},
        }
    return tools


def _roundtrip(fmt: TextFormat, style: str | None, calls: list[ToolCall]) -> list[ToolCall]:
    text = render_tool_calls(calls, format=fmt, style=style)
    _, back = from_text(text, format=fmt, tools=_tools(calls))
    return back


@pytest.mark.parametrize(("fmt", "style"), RENDERINGS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(NAMES, ARGUMENTS).map(lambda c: ToolCall("x", c[0], c[1], "openai")),
        min_size=1,
        max_size=4,
    )
)
def test_render_then_parse_gives_the_same_names_and_arguments(
    fmt: TextFormat, style: str | None, calls: list[ToolCall]
) -> None:
    if fmt in ("glm45", "qwen3_coder"):
        # Tool names key the schemas here: one argument set per name.
        calls = list({c.name: c for c in calls}.values())
    back = _roundtrip(fmt, style, calls)
    assert [(c.name, c.arguments, c.error) for c in back] == [
        (c.name, c.arguments, None) for c in calls
    ]


FIXED_CALLS = [
    ToolCall("call_a", "get_weather", {"city": "São Paulo", "days": 3}, "openai"),
    ToolCall(
        "call_b", "fs.write_file", '{"path": "a/b.txt", "content": "line 1\\nline 2"}', "openai"
    ),
    ToolCall("call_c", "noop", {}, "openai"),
]
FIXED_ARGUMENTS = [
    {"city": "São Paulo", "days": 3},
    {"path": "a/b.txt", "content": "line 1\nline 2"},
    {},
]

# What each family's template writes for FIXED_CALLS[0] after the content "Sure.".
RENDERED_ONE = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "São Paulo", "days": 3}}'
    "\n</tool_call>",
    "llama3": 'Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "São Paulo", "days": 3}}',
    "mistral": 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "São Paulo", "days": 3}',
    "deepseek": "Sure.<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function"
    '<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n{"city": "São Paulo", "days": 3}\n```'
    "<\uff5ctool\u2581call\u2581end\uff5c><\uff5ctool\u2581calls\u2581end\uff5c>",
    "glm45": "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "kimi_k2": "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "São Paulo", "days": 3}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "qwen3_coder": "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "harmony": "<|start|>assistant<|channel|>analysis<|message|>Sure.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "São Paulo", "days": 3}<|call|>',
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_rendering_matches_the_template_text(fmt: TextFormat) -> None:
    assert render_tool_calls(FIXED_CALLS[:1], format=fmt, content="Sure.") == RENDERED_ONE[fmt]


@pytest.mark.parametrize(("fmt", "style"), RENDERINGS)
def test_fixed_calls_round_trip_with_their_prose(fmt: TextFormat, style: str | None) -> None:
    text = render_tool_calls(
        FIXED_CALLS, format=fmt, style=style, content="Let me do three things."
    )
    schemas = {
        "get_weather": {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        "fs.write_file": {
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}}
        },
    }
    prose, calls = from_text(text, format=fmt, tools=schemas)
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, a) for c, a in zip(FIXED_CALLS, FIXED_ARGUMENTS, strict=True)
    ]
    # gpt-oss puts an assistant's content that comes with calls on the analysis channel.
    assert prose == ("" if fmt == "harmony" else "Let me do three things.")


def test_rendering_refuses_what_it_cannot_write() -> None:
    bad = ToolCall("call_0", "f", "", "hermes", error="not valid JSON")
    for fmt in FORMATS:
        with pytest.raises(ValueError, match="has an error"):
            render_tool_calls([bad], format=fmt)
        with pytest.raises(ValueError, match="not JSON"):
            render_tool_calls([ToolCall("c", "f", "{oops", "openai")], format=fmt)
    with pytest.raises(ValueError, match="JSON object"):
        render_tool_calls([ToolCall("c", "f", "[1]", "openai")], format="glm45")
    with pytest.raises(ValueError, match="style"):
        render_tool_calls(FIXED_CALLS, format="deepseek", style="v9")
    with pytest.raises(ValueError, match="no styles"):
        render_tool_calls(FIXED_CALLS, format="hermes", style="v3")


def test_kimi_ids_are_kept_when_they_are_kimis() -> None:
    call = ToolCall("functions.get_weather:7", "get_weather", {}, "kimi_k2")
    assert "functions.get_weather:7<|tool_call_argument_begin|>" in render_tool_calls(
        [call], format="kimi_k2"
    )
    other = ToolCall("call_9", "get_weather", {}, "openai")
    assert "functions.get_weather:0<|tool_call_argument_begin|>" in render_tool_calls(
        [other], format="kimi_k2"
    )


# -- the cap --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "style"), RENDERINGS)
def test_call_count_is_capped(fmt: TextFormat, style: str | None) -> None:
    calls = [ToolCall(f"c{i}", f"f{i}", {"i": i}, "openai") for i in range(MAX_CALLS + 10)]
    text = render_tool_calls(calls, format=fmt, style=style)
    _, back = from_text(
        text,
        format=fmt,
        tools={f"f{i}": {"properties": {"i": {"type": "integer"}}} for i in range(MAX_CALLS + 10)},
    )
    assert len(back) == MAX_CALLS + 1
    assert all(c.error is None for c in back[:-1])
    assert [c.arguments for c in back[:3]] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert back[-1].error is not None
    assert "more than" in back[-1].error


# -- linear time on adversarial replies -----------------------------------------------------------

_MB = 1_000_000
_DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
ADVERSARIAL: dict[str, list[str]] = {
    "hermes": ["<tool_call>" * (_MB // 11), "</tool_call>" * (_MB // 12)],
    "llama3": [
        "<|python_tag|>" + "{" * 50_000,
        '{"name": "f", "parameters": {"a": "' + "z" * 10 * _MB + '"}}',
        '<|python_tag|>{"name": "f", "parameters": {}};' * 100_000,
        "; " * _MB,
    ],
    "mistral": [
        "[TOOL_CALLS]" * (_MB // 12),
        "[TOOL_CALLS]f[ARGS]" * (_MB // 19),
        '[TOOL_CALLS]f[ARGS]{"a": "' * (_MB // 26),
        "[TOOL_CALLS][" + "[" * 50_000,
        "[ARGS]" * _MB,
    ],
    "deepseek": [
        _DS_CALLS * (_MB // 21),
        _DS_CALLS + _DS_CALL * (_MB // 20),
        _DS_CALLS + (_DS_CALL + "function<\uff5ctool\u2581sep\uff5c>f\n```json\n") * (_MB // 40),
    ],
    "glm45": [
        "<tool_call>f" + "<arg_key>" * (_MB // 9),
        "<tool_call>f" + "<arg_key>k</arg_key><arg_value>" * (_MB // 30) + "</tool_call>",
        "<tool_call>f" + " " * 10 * _MB + "</tool_call>",
        "<tool_call>" * (_MB // 11),
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|>" + "<|tool_call_begin|>" * (_MB // 19),
        "<|tool_call_argument_begin|>" * (_MB // 28),
        "<|tool_calls_section_begin|>" * (_MB // 28),
    ],
    "qwen3_coder": [
        "<tool_call><function=f>" + "<parameter=" * (_MB // 11),
        "<tool_call><function=f>" + "<parameter=k>v" * (_MB // 14) + "</function></tool_call>",
        "<tool_call>" + "<function=" * (_MB // 10),
        "<tool_call><function=f>" + " " * 10 * _MB + "</function></tool_call>",
    ],
    "harmony": [
        "<|start|>" * (_MB // 9) + "<|message|>",
        "<|message|>" * (_MB // 11),
        "<|channel|>commentary to=functions.f<|message|>" + "{" * 50_000 + "<|call|>",
        ("<|start|>assistant<|channel|>final<|message|>" + "w" * 50) * (_MB // 95),
    ],
}


@pytest.mark.parametrize(
    ("fmt", "text"),
    [(fmt, text) for fmt, texts in ADVERSARIAL.items() for text in texts]
    + [(fmt, "x" * 10 * _MB) for fmt in FORMATS],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else "",
)
def test_adversarial_replies_parse_in_linear_time(fmt: TextFormat, text: str) -> None:
    started = time.perf_counter()
    _, calls = from_text(text, format=fmt)
    assert time.perf_counter() - started < 2.5
    assert len(calls) <= MAX_CALLS + 1
    assert all(c.error is not None or c.name for c in calls)
