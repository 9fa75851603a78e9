"""Text tool-call formats of open models: the families' real shapes, read exactly, failing loudly.

The examples are written the way each family's model card, chat template and
vLLM's/SGLang's parser tests show them: several calls, prose before and
after, unicode, nested JSON. Malformed calls keep their place with ``error``
set (never dropped, never ``{}``); a reply cut at any position never raises
and never yields a complete call that differs from the finished reply's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

import agent_backend
from agent_backend.rollout import ChatTemplate
from agent_backend.tools import (
    TextFormat,
    ToolCall,
    detect_call_format,
    from_hermes,
    from_text,
    parse_tool_calls,
    render_tool_calls,
)

DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

NESTED = {"filter": {"tags": ["a", "b"], "range": {"min": 1, "max": 2.5}}, "deep": [[{"x": None}]]}


def kimi(header: str, arguments: str) -> str:
    return f"{KIMI_CALL}{header}{KIMI_ARGS}{arguments}{KIMI_CALL_END}"


# (format, model output, expected prose, expected [(name, arguments)])
EXAMPLES: list[tuple[TextFormat, str, str, list[tuple[str, Any]]]] = [
    # -- hermes (Qwen2.5 / Qwen3 / Hermes 2 Pro) --
    (
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(NESTED) + "}\n</tool_call>",
        "Let me check both.",
        [("get_weather", {"city": "東京", "unit": "celsius"}), ("search", NESTED)],
    ),
    # -- llama3 --
    (
        "llama3",
        '{"name": "get_current_weather", "parameters": {"city": "San Francisco", "state": "CA", '
        '"unit": "fahrenheit"}}',
        "",
        [
            (
                "get_current_weather",
                {"city": "San Francisco", "state": "CA", "unit": "fahrenheit"},
            )
        ],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "searchTool", "parameters": {"query": "café ☕"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}',
        "",
        [("searchTool", {"query": "café ☕"}), ("getOpenIncidentsTool", {})],
    ),
    (
        "llama3",
        'I will look it up.<|python_tag|>{"name": "lookup", "arguments": '
        + json.dumps(NESTED)
        + "}",
        "I will look it up.",
        [("lookup", NESTED)],
    ),
    (
        "llama3",
        '{"name": "a", "parameters": {"n": 1}}\n{"name": "b", "parameters": {"n": 2}}\nDone.',
        "Done.",
        [("a", {"n": 1}), ("b", {"n": 2})],
    ),
    # -- mistral --
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}, "id": "abcdef123"}, {"name": "add", "arguments": '
        '{"a": 3.5, "b": 4}, "id": "zyx987654"}]',
        "",
        [
            ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
            ("add", {"a": 3.5, "b": 4}),
        ],
    ),
    (
        "mistral",
        'Sure, two calls.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}'
        "[TOOL_CALLS]search[ARGS]" + json.dumps(NESTED),
        "Sure, two calls.",
        [("get_weather", {"city": "Zürich"}), ("search", NESTED)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # -- deepseek --
    (
        "deepseek",
        "I'll call two tools."
        + DS_CALLS_BEGIN
        + DS_CALL_BEGIN
        + 'function<\uff5ctool\u2581sep\uff5c>get_weather\n```json\n{"location": "杭州"}\n```'
        + DS_CALL_END
        + "\n"
        + DS_CALL_BEGIN
        + "function"
        + DS_SEP
        + "search\n```json\n"
        + json.dumps(NESTED, indent=2)
        + "\n```"
        + DS_CALL_END
        + DS_CALLS_END
        + DS_EOS,
        "I'll call two tools." + DS_EOS,
        [("get_weather", {"location": "杭州"}), ("search", NESTED)],
    ),
    (
        "deepseek",
        DS_CALLS_BEGIN
        + DS_CALL_BEGIN
        + 'get_weather<\uff5ctool\u2581sep\uff5c>{"city": "Beijing"}'
        + DS_CALL_END
        + DS_CALL_BEGIN
        + "search"
        + DS_SEP
        + json.dumps(NESTED)
        + DS_CALL_END
        + DS_CALLS_END
        + " Done.",
        "Done.",
        [("get_weather", {"city": "Beijing"}), ("search", NESTED)],
    ),
    # -- glm45 --
    (
        "glm45",
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
        "<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>\n"
        "<tool_call>search<arg_key>filter</arg_key><arg_value>"
        + json.dumps(NESTED["filter"])
        + "</arg_value><arg_key>limit</arg_key><arg_value>5</arg_value></tool_call>",
        "Let me check.",
        [
            ("get_weather", {"city": "北京", "date": "2024-06-27"}),
            ("search", {"filter": NESTED["filter"], "limit": 5}),
        ],
    ),
    ("glm45", "<tool_call>list_files\n</tool_call>", "", [("list_files", {})]),
    (  # literal "\n" instead of newlines, as SGLang's GLM tests show some outputs
        "glm45",
        "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # -- kimi_k2 --
    (
        "kimi_k2",
        "I'll check. "
        + KIMI_BEGIN
        + kimi("functions.get_weather:0", '{"city": "Beijing"}')
        + kimi("functions.get_weather:1 ", '{\n  "city": "上海"\n}')
        + kimi("functions.process_html:2", '{"html": "<div>content</div>"}')
        + KIMI_END,
        "I'll check.",
        [
            ("get_weather", {"city": "Beijing"}),
            ("get_weather", {"city": "上海"}),
            ("process_html", {"html": "<div>content</div>"}),
        ],
    ),
    (
        "kimi_k2",
        KIMI_BEGIN
        + kimi("get_weather:0", '{"city": "Tokyo"}')
        + kimi("functions.test:1", "{}")
        + KIMI_END,
        "",
        [("get_weather", {"city": "Tokyo"}), ("test", {})],
    ),
    # -- qwen3_coder --
    (
        "qwen3_coder",
        "I'll write the file.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
        "src/main.py\n</parameter>\n<parameter=content>\ndef main():\n    print('héllo')\n\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nDallas\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
        "</tool_call>",
        "I'll write the file.",
        [
            ("write_file", {"path": "src/main.py", "content": "def main():\n    print('héllo')\n"}),
            ("get_weather", {"city": "Dallas", "days": "3"}),  # no schema: text stays text
        ],
    ),
    # -- harmony (gpt-oss) --
    (
        "harmony",
        '<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to use '
        "get_current_weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_current_weather <|constrain|>json<|message|>{"location": "Tokyo"}<|call|>',
        "",
        [("get_current_weather", {"location": "Tokyo"})],
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>Two tools.<|end|>"
        "<|start|>assistant to=functions.get_user_location<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
        + json.dumps(NESTED)
        + "<|call|><|start|>assistant<|channel|>final<|message|>Voilà, c'est fait.<|return|>",
        "Voilà, c'est fait.",
        [("get_user_location", {}), ("search", NESTED)],
    ),
]


def _ids(example: tuple[str, str, str, list[Any]]) -> str:
    return f"{example[0]}-{len(example[3])}-calls"


@pytest.mark.parametrize("example", EXAMPLES, ids=[_ids(e) for e in EXAMPLES])
def test_every_example_call_is_recovered_exactly(example: tuple[Any, str, str, list[Any]]) -> None:
    fmt, text, prose, expected = example
    got_prose, calls = from_text(text, format=fmt)
    assert [(c.name, c.arguments) for c in calls] == expected
    assert all(c.error is None and c.format == fmt for c in calls)
    assert got_prose == prose
    assert len({c.id for c in calls}) == len(calls)


def test_all_eight_families_have_examples() -> None:
    assert {e[0] for e in EXAMPLES} == set(get_formats())


def get_formats() -> tuple[str, ...]:
    from typing import get_args

    return get_args(TextFormat)


def _example(fmt: str, n: int) -> str:
    return [text for f, text, _, _ in EXAMPLES if f == fmt][n]


def test_native_ids_are_kept() -> None:
    _, calls = from_text(_example("kimi_k2", 0), format="kimi_k2")
    assert [c.id for c in calls] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
        "functions.process_html:2",
    ]
    _, calls = from_text(_example("mistral", 0), format="mistral")
    assert [c.id for c in calls] == ["abcdef123", "zyx987654"]
    _, calls = from_text(_example("mistral", 2), format="mistral")
    assert [c.id for c in calls] == ["a1b2c3d4e"]


def test_text_without_calls_is_prose_in_every_format() -> None:
    for fmt in get_formats():
        assert from_text("  Just an answer, with {braces} and [brackets].  ", format=fmt) == (
            "Just an answer, with {braces} and [brackets].",
            [],
        )


def test_llama3_json_inside_prose_is_not_a_call() -> None:
    text = 'The config is {"name": "x", "parameters": {}} as you asked.'
    assert from_text(text, format="llama3") == (text, [])
    assert from_text('{"answer": 42}', format="llama3") == ('{"answer": 42}', [])


# -- malformed calls: found, kept with an error, never {} ------------------------------------------

MALFORMED: list[tuple[TextFormat, str, int, str, str]] = [
    # (format, text, index of the bad call, its name as far as known, a word of the error)
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', 0, "", "JSON"),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}', 0, "f", "JSON"),
    ("llama3", '{"parameters": {"x": 1}}', 0, "", "no name"),
    (
        "llama3",
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": }}',
        1,
        "b",
        "JSON",
    ),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1[TOOL_CALLS]g[ARGS]{}', 0, "f", "JSON"),
    ("mistral", "[TOOL_CALLS]get_weather", 0, "get_weather", "[ARGS]"),
    ("mistral", '[TOOL_CALLS][ARGS]{"x": 1}', 0, "", "no name"),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}]', 0, "", "JSON"),
    ("mistral", "[TOOL_CALLS]f[ARGS][1, 2]", 0, "f", "object"),
    (
        "deepseek",
        DS_CALLS_BEGIN
        + DS_CALL_BEGIN
        + 'f<\uff5ctool\u2581sep\uff5c>{"x": 1'
        + DS_CALL_END
        + DS_CALLS_END,
        0,
        "f",
        "JSON",
    ),
    (
        "deepseek",
        DS_CALLS_BEGIN + DS_CALL_BEGIN + 'f<\uff5ctool\u2581sep\uff5c>{"x": 1}',
        0,
        "f",
        "unclosed",
    ),
    (
        "deepseek",
        DS_CALLS_BEGIN + DS_CALL_BEGIN + DS_SEP + "{}" + DS_CALL_END + DS_CALLS_END,
        0,
        "",
        "no name",
    ),
    (
        "deepseek",
        DS_CALLS_BEGIN
        + DS_CALL_BEGIN
        + "function"
        + DS_SEP
        + 'f\n{"x": 1}'
        + DS_CALL_END
        + DS_CALLS_END,
        0,
        "f",
        "fence",
    ),
    (
        "glm45",
        "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1\n</tool_call>",
        0,
        "f",
        "</arg_value>",
    ),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n", 0, "f", "unclosed"),
    (
        "glm45",
        "<tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
        0,
        "",
        "no name",
    ),
    (
        "glm45",
        "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value><arg_key>x</arg_key>"
        "<arg_value>2</arg_value></tool_call>",
        0,
        "f",
        "twice",
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + kimi("functions.bad:0", '{"city": "Beijing"') + KIMI_END,
        0,
        "bad",
        "JSON",
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + KIMI_CALL + "functions.f:0" + KIMI_CALL_END + KIMI_END,
        0,
        "f",
        "argument",
    ),
    (
        "kimi_k2",
        KIMI_BEGIN + kimi("functions.f:0", "{}") + KIMI_CALL + "functions.g:1",
        1,
        "g",
        "unclosed",
    ),
    ("kimi_k2", KIMI_BEGIN + kimi("0", "{}") + KIMI_END, 0, "", "no name"),
    (
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n",
        0,
        "f",
        "</function>",
    ),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>", 0, "", "no name"),
    ("qwen3_coder", '<tool_call>\n{"name": "f"}\n</tool_call>', 0, "", "<function="),
    (
        "harmony",
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1<|call|>',
        0,
        "f",
        "JSON",
    ),
    ("harmony", '<|channel|>commentary to=functions.f json<|message|>{"x": ', 0, "f", "cut off"),
]


@pytest.mark.parametrize(
    ("fmt", "text", "index", "name", "word"),
    MALFORMED,
    ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)],
)
def test_malformed_calls_keep_their_place_with_an_error(
    fmt: TextFormat, text: str, index: int, name: str, word: str
) -> None:
    _, calls = from_text(text, format=fmt)
    assert len(calls) > index
    bad = calls[index]
    assert bad.error is not None
    assert word in bad.error
    assert bad.arguments == ""  # never {}
    assert bad.name == name
    assert bad.format == fmt


def test_a_bad_call_does_not_swallow_the_next_one() -> None:
    _, calls = from_text('[TOOL_CALLS]f[ARGS]{"x": 1[TOOL_CALLS]g[ARGS]{"y": 2}', format="mistral")
    assert [(c.name, c.error is None, c.arguments) for c in calls] == [
        ("f", False, ""),
        ("g", True, {"y": 2}),
    ]
    _, calls = from_text(
        KIMI_BEGIN + kimi("functions.bad:0", "{") + kimi("functions.good:1", '{"a": 1}') + KIMI_END,
        format="kimi_k2",
    )
    assert [(c.name, c.error is None) for c in calls] == [("bad", False), ("good", True)]


# -- a reply cut anywhere ---------------------------------------------------------------------------


def _multi_call_examples() -> list[tuple[TextFormat, str]]:
    seen: dict[str, str] = {}
    for fmt, text, _, expected in EXAMPLES:
        if len(expected) >= 2 and fmt not in seen:
            seen[fmt] = text
    return list(seen.items())  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "text"), _multi_call_examples(), ids=lambda v: str(v)[:12])
def test_a_reply_cut_at_every_position_never_yields_a_wrong_call(
    fmt: TextFormat, text: str
) -> None:
    _, full = from_text(text, format=fmt)
    assert len(full) >= 2
    assert all(c.error is None for c in full)
    for cut in range(len(text) + 1):
        _, calls = from_text(text[:cut], format=fmt)
        assert len(calls) <= len(full), cut
        for i, call in enumerate(calls):
            if call.error is None:
                assert (call.name, call.arguments) == (full[i].name, full[i].arguments), (cut, call)
            else:
                assert call.arguments == ""
        # Only the last call found can be the one cut off.
        assert all(c.error is None for c in calls[:-1]), (cut, calls)


def test_every_example_family_is_cut_tested() -> None:
    assert {fmt for fmt, _ in _multi_call_examples()} == set(get_formats())


# -- schema-typed values (glm45, qwen3_coder) -------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "flag": {"type": "boolean"},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "items": {"type": "array", "items": {"type": "integer"}},
        "where": {"$ref": "#/$defs/place"},
        "level": {"enum": [1, 2, 3]},
    },
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
VALUES = {
    "code": "007",
    "count": "42",
    "ratio": "2.5",
    "flag": "true",
    "maybe": "null",
    "either": "007",
    "items": "[1, 2]",
    "where": '{"city": "Oslo"}',
    "level": "2",
}
TYPED = {
    "code": "007",  # a string parameter keeps its text: "007" never becomes 7
    "count": 42,
    "ratio": 2.5,
    "flag": True,
    "maybe": None,
    "either": "007",
    "items": [1, 2],
    "where": {"city": "Oslo"},  # typed through its $ref
    "level": 2,
}


def _glm(values: Mapping[str, str]) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items()
    )
    return f"<tool_call>f\n{pairs}</tool_call>"


def _coder(values: Mapping[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"


@pytest.mark.parametrize(
    "tools",
    [
        {"f": SCHEMA},
        [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
        [{"name": "f", "input_schema": SCHEMA}],
        [agent_backend.Tool(name="f", parameters=SCHEMA)],
    ],
    ids=["mapping", "openai", "anthropic", "Tool"],
)
@pytest.mark.parametrize(("fmt", "build"), [("glm45", _glm), ("qwen3_coder", _coder)])
def test_bare_values_are_typed_by_the_tool_schema(fmt: TextFormat, build: Any, tools: Any) -> None:
    (call,) = from_text(build(VALUES), format=fmt, tools=tools)[1]
    assert call.error is None
    assert call.arguments == TYPED


def test_without_a_schema_glm_reads_json_and_qwen3_coder_keeps_text() -> None:
    values = {"n": "5", "obj": '{"a": [1]}', "word": "hello", "flag": "true"}
    (glm,) = from_text(_glm(values), format="glm45")[1]
    assert glm.arguments == {"n": 5, "obj": {"a": [1]}, "word": "hello", "flag": True}
    (coder,) = from_text(_coder(values), format="qwen3_coder")[1]
    assert coder.arguments == values


def test_a_value_that_fits_no_declared_type_stays_text_for_the_schema_layer() -> None:
    (call,) = from_text(_coder({"count": "many"}), format="qwen3_coder", tools={"f": SCHEMA})[1]
    assert call.arguments == {"count": "many"}
    assert call.error is None


def test_qwen3_coder_python_spellings_and_a_missing_parameter_close() -> None:
    schema = {
        "properties": {
            "flag": {"type": "boolean"},
            "none": {"type": "null"},
            "n": {"type": "integer"},
        }
    }
    text = "<tool_call>\n<function=f>\n<parameter=flag>\nTrue\n<parameter=none>\nNone\n</parameter>\n<parameter=n>\n1\n</function>\n</tool_call>"
    (call,) = from_text(text, format="qwen3_coder", tools={"f": schema})[1]
    assert call.arguments == {"flag": True, "none": None, "n": 1}


# -- selection and detection ------------------------------------------------------------------------


def test_parse_tool_calls_selects_a_format_by_name() -> None:
    text = KIMI_BEGIN + kimi("functions.f:0", '{"a": 1}') + KIMI_END
    assert parse_tool_calls(text, format="kimi_k2") == [
        ToolCall("functions.f:0", "f", {"a": 1}, "kimi_k2")
    ]
    assert parse_tool_calls({"role": "assistant", "content": text}, format="kimi_k2")[0].name == "f"
    assert parse_tool_calls({"role": "assistant", "content": None}, format="kimi_k2") == []
    assert parse_tool_calls(text) == []  # today's default: Hermes text
    hermes = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert (
        parse_tool_calls(hermes)
        == parse_tool_calls(hermes, format="hermes")
        == from_hermes(hermes)[1]
    )
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls(hermes, format="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reads text"):
        parse_tool_calls([1], format="hermes")


# Fragments of the real chat templates, with the markers each uses for an assistant's calls.
TEMPLATES: dict[TextFormat, str] = {
    "hermes": '{%- for tool_call in message.tool_calls %}{{- \'\\n<tool_call>\\n{"name": "\' }}'
    '{{- tool_call.name }}{{- \'", "arguments": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}{%- endfor %}<|im_start|>assistant\\n",
    "llama3": "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '{\"name\": \"' + "
    "tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}<|eot_id|>",
    "mistral": '{{- "[TOOL_CALLS]" + tool.function.name + "[ARGS]" + arguments }}{{- eos_token }}',
    "deepseek": "{{'<\uff5cAssistant\uff5c>"
    + DS_CALLS_BEGIN
    + DS_CALL_BEGIN
    + "' + tool['type'] + '"
    + DS_SEP
    + "' + tool['function']['name'] + '\\n' + '```json'}}",
    "glm45": "{{ '\\n<tool_call>' + tc.name }}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>",
    "kimi_k2": "{{render_content(message)}}<|tool_calls_section_begin|>{%- for tool_call in "
    "message['tool_calls'] -%}<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>",
    "qwen3_coder": "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- '\\n</parameter>\\n' }}{{- '</function>\\n</tool_call>' }}",
    "harmony": '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
    '{{- "<|constrain|>json<|message|>" }}{{- tool_call.arguments|tojson }}{{- "<|call|>" }}',
}


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_detect_call_format_from_the_chat_template(fmt: TextFormat) -> None:
    assert detect_call_format(TEMPLATES[fmt]) == fmt

    class Tokenizer:
        chat_template = TEMPLATES[fmt]

    assert detect_call_format(Tokenizer()) == fmt

    class Named:
        chat_template: ClassVar = {"default": "{{ messages }}", "tool_use": TEMPLATES[fmt]}

    assert detect_call_format(Named()) == fmt


def test_detect_call_format_refuses_to_guess() -> None:
    assert detect_call_format("{{ messages[0].content }}") is None  # no tool calls at all
    assert detect_call_format(TEMPLATES["hermes"] + TEMPLATES["mistral"]) is None  # two families
    assert detect_call_format(object()) is None

    class NoTemplate:
        chat_template = None

    assert detect_call_format(NoTemplate()) is None


def test_public_names_are_exported() -> None:
    assert agent_backend.from_text is from_text
    assert agent_backend.render_tool_calls is render_tool_calls
    assert agent_backend.detect_call_format is detect_call_format


# -- the rollout layer reads completions in the model's format ---------------------------------------


class CharTokenizer:
    """A tokenizer with one id per character, plus whole special tokens: enough for ChatTemplate."""

    eos_token = "<|eot|>"

    def __init__(self, template: str | None, specials: tuple[str, ...] = ()) -> None:
        self.chat_template = template
        self.specials = (self.eos_token, *specials)

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
        return "".join(f"<{m['role']}>{m.get('content') or ''}{self.eos_token}" for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            special = next(
                (i for i, s in enumerate(self.specials) if text.startswith(s, pos)), None
            )
            if special is not None:
                ids.append(-1 - special)
                pos += len(self.specials[special])
            else:
                ids.append(ord(text[pos]))
                pos += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.specials[-1 - i] if i < 0 else chr(i) for i in ids)


def test_chat_template_reads_calls_in_the_detected_format() -> None:
    tokenizer = CharTokenizer(
        TEMPLATES["kimi_k2"], (KIMI_BEGIN, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, KIMI_END)
    )
    template = ChatTemplate(tokenizer)
    assert template.call_format == "kimi_k2"
    completion = (
        "Checking. " + KIMI_BEGIN + kimi("functions.get_weather:0", '{"city": "Oslo"}') + KIMI_END
    )
    message, prose, calls = template.assistant_message(
        tokenizer.encode(completion + tokenizer.eos_token)
    )
    assert prose == "Checking."
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Oslo"})
    ]
    assert message == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }


def test_chat_template_call_format_option_and_fallback() -> None:
    assert ChatTemplate(CharTokenizer(None)).call_format == "hermes"  # nothing to detect
    chosen = ChatTemplate(CharTokenizer(TEMPLATES["kimi_k2"]), call_format="harmony")
    assert chosen.call_format == "harmony"
    text = (
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    )
    message, prose, calls = chosen.assistant_message(chosen.encode(text))
    assert (message["content"], prose, calls) == ("Hi!", "Hi!", [])
    with pytest.raises(ValueError, match="unknown call_format"):
        ChatTemplate(CharTokenizer(None), call_format="nope")  # type: ignore[arg-type]
