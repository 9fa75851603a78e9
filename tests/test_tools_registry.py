"""ToolRegistry: loading files in every shape, exports, name aliases, and fail-closed call preparation."""

from __future__ import annotations

import copy
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

import agent_backend.tools as tools_pkg
from agent_backend.errors import SchemaError, ToolArgumentError, UnknownToolError
from agent_backend.tools import (
    PreparedCall,
    Tool,
    ToolCall,
    ToolRegistry,
    from_hermes,
    from_openai,
    load_tool_file,
    tool_from_definition,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "schemas" / "examples"

WEATHER = {
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}


def _write(path: Path, content: Any) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# -- loading --------------------------------------------------------------------------------------


def test_examples_load_in_every_shape(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="agent_backend.tools"):
        registry = ToolRegistry.from_dir(EXAMPLES)
    assert sorted(registry.names()) == [
        "fs.read_file",
        "get_weather",
        "math.factorial",
        "search_files",
        "vehicle.move",
    ]
    weather = registry.get("get_weather")
    assert weather.meta == {"x-agent-backend": {"timeout": 10, "backend": "local"}}
    assert weather.source == str(EXAMPLES / "get_weather.json")
    assert registry.get("search_files").meta == {"strict": False}
    read_file = registry.get("fs.read_file")
    assert read_file.meta["annotations"] == {"readOnlyHint": True}
    assert read_file.meta["title"] == "Read a file"
    # Legacy names: one warning per tool, naming the pointers, recorded on the tool.
    move = registry.get("vehicle.move")
    assert move.normalizations == (
        "/type",
        "/properties/position/type",
        "/properties/position/items/type",
        "/properties/payload/type",
    )
    assert move.parameters["properties"]["mode"]["enum"] == ["dict", "float"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "agent_backend.tools"]
    assert len(warnings) == 2
    assert "'vehicle.move'" in warnings[1]
    assert "/1/parameters/properties/payload/type" in warnings[1]
    assert all(
        not t.normalizations for t in registry if t.name not in ("vehicle.move", "math.factorial")
    )


def test_example_refs_are_resolved_for_arguments() -> None:
    registry = ToolRegistry.from_dir(EXAMPLES)
    call = ToolCall("c", "fs_read_file", '{"path": "a.txt", "range": {"start": "3"}}', "openai")
    prepared = registry.prepare_call(call)
    assert prepared.arguments == {"path": "a.txt", "range": {"start": 3}}
    with pytest.raises(ToolArgumentError):
        registry.prepare_call(
            ToolCall("c", "fs.read_file", {"path": "a", "range": {"end": 2}}, "mcp")
        )


def test_file_holding_an_array(tmp_path: Path) -> None:
    other = dict(WEATHER, name="get_forecast")
    tools = load_tool_file(
        _write(tmp_path / "two.json", [WEATHER, {"type": "function", "function": other}])
    )
    assert [t.name for t in tools] == ["get_weather", "get_forecast"]


def test_load_dir_is_not_recursive_and_sorted(tmp_path: Path) -> None:
    _write(tmp_path / "b.json", dict(WEATHER, name="b"))
    _write(tmp_path / "a.json", dict(WEATHER, name="a"))
    _write(tmp_path / "notes.txt", "not a tool")
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "c.json", dict(WEATHER, name="c"))
    assert ToolRegistry.from_dir(tmp_path).names() == ["a", "b"]


@pytest.mark.parametrize(
    ("content", "pointer", "message"),
    [
        ('{"name": "x", "parameters": ', "", "invalid JSON"),
        ("[1]", "/0", "must be an object"),
        ({"name": "bad name!"}, "/name", "invalid tool name"),
        ({"description": "no name"}, "/name", "must be a string"),
        ({"name": "x", "parameter": {}}, "/parameter", "unknown key"),
        ({"name": "x", "parameters": {}, "inputSchema": {}}, "/inputSchema", "both"),
        ({"name": "x", "description": 5}, "/description", "must be a string"),
        (
            {"type": "function", "function": {"name": "x", "parameters": {"type": "dictionary"}}},
            "/function/parameters/type",
            "unknown type name",
        ),
        ({"type": "custom", "function": {"name": "x"}}, "/type", "type 'function'"),
        (
            [
                WEATHER,
                {
                    "name": "y",
                    "inputSchema": {"type": "object", "properties": {"a": {"minimum": "0"}}},
                },
            ],
            "/1/inputSchema/properties/a/minimum",
            "valid JSON Schema",
        ),
        ({"name": "x", "parameters": {"type": "string"}}, "/parameters/type", "describe an object"),
        (
            {"name": "x", "parameters": {"properties": {"a": {"$ref": "#/$defs/Missing"}}}},
            "/parameters/properties/a",
            "points to nothing",
        ),
        (
            {
                "name": "x",
                "parameters": {"properties": {"a": {"$ref": "https://example.com/s.json"}}},
            },
            "/parameters/properties/a",
            "not fetched",
        ),
    ],
)
def test_bad_files_fail_at_load_with_file_and_pointer(
    tmp_path: Path, content: Any, pointer: str, message: str
) -> None:
    path = _write(tmp_path / "bad.json", content)
    _write(tmp_path / "good.json", dict(WEATHER, name="fine"))
    registry = ToolRegistry()
    with pytest.raises(SchemaError, match=message) as info:
        registry.load_dir(tmp_path)
    assert info.value.source == str(path)
    assert info.value.pointer == pointer
    assert str(path) in str(info.value)
    assert len(registry) == 0  # all or nothing


def test_schema_errors_pickle_with_their_location(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.json", {"name": "x", "parameters": {"type": "dictionary"}})
    with pytest.raises(SchemaError) as info:
        load_tool_file(path)
    copy_ = pickle.loads(pickle.dumps(info.value))
    assert (copy_.source, copy_.pointer, str(copy_)) == (
        info.value.source,
        info.value.pointer,
        str(info.value),
    )


def test_duplicate_names_fail(tmp_path: Path) -> None:
    registry = ToolRegistry([tool_from_definition(WEATHER)])
    with pytest.raises(SchemaError, match="duplicate tool name 'get_weather'"):
        registry.add(tool_from_definition(WEATHER))
    _write(tmp_path / "a.json", dict(WEATHER, name="x"))
    _write(tmp_path / "b.json", dict(WEATHER, name="x"))
    with pytest.raises(SchemaError, match="duplicate"):
        ToolRegistry.from_dir(tmp_path)


def test_missing_directory() -> None:
    with pytest.raises(SchemaError, match="not a directory"):
        ToolRegistry.from_dir("/nonexistent/tools")


# -- names and aliases ----------------------------------------------------------------------------


def test_dotted_names_are_exported_without_dots_and_mapped_back() -> None:
    registry = ToolRegistry([tool_from_definition(dict(WEATHER, name="weather.get"))])
    assert registry.to_openai()[0]["function"]["name"] == "weather_get"
    assert registry.to_anthropic()[0]["name"] == "weather_get"
    assert registry.to_mcp()[0]["name"] == "weather.get"
    assert registry.get("weather_get") is registry.get("weather.get")
    assert "weather_get" in registry
    assert registry.export_name("weather.get") == "weather_get"
    call = from_openai(
        {
            "tool_calls": [
                {"id": "1", "function": {"name": "weather_get", "arguments": '{"city": "x"}'}}
            ]
        }
    )
    assert registry.prepare_call(call[0]).tool.name == "weather.get"


@pytest.mark.parametrize("order", ["dotted-first", "plain-first"])
def test_alias_collisions_resolve_the_same_whatever_the_order(order: str) -> None:
    dotted = tool_from_definition(dict(WEATHER, name="a.b"))
    plain = tool_from_definition(dict(WEATHER, name="a_b"))
    registry = ToolRegistry([dotted, plain] if order == "dotted-first" else [plain, dotted])
    assert registry.get("a_b") is plain
    alias = registry.export_name("a.b")
    assert alias.startswith("a_b_")
    assert registry.get(alias) is dotted
    exported = {t["function"]["name"] for t in registry.to_openai()}
    assert exported == {"a_b", alias}


# -- prepare_call ---------------------------------------------------------------------------------


def test_prepare_call_returns_checked_arguments() -> None:
    registry = ToolRegistry([tool_from_definition(WEATHER)])
    prepared = registry.prepare_call(
        ToolCall("id1", "get_weather", '{"city": "Paris", "days": "3"}', "openai")
    )
    assert prepared == PreparedCall(
        "id1", registry.get("get_weather"), {"city": "Paris", "days": 3}
    )


@pytest.mark.parametrize(
    "arguments", ["", "{", "null", "[]", '{"city": "a"}{"city": "a"}', '{"days": 1}']
)
def test_prepare_call_fails_closed(arguments: str) -> None:
    registry = ToolRegistry([tool_from_definition(WEATHER)])
    with pytest.raises(ToolArgumentError) as info:
        registry.prepare_call(ToolCall("c", "get_weather", arguments, "openai"))
    assert info.value.tool == "get_weather"


def test_unreadable_calls_are_argument_errors_never_empty_arguments() -> None:
    registry = ToolRegistry([tool_from_definition(dict(WEATHER, parameters={"type": "object"}))])
    _, calls = from_hermes(
        '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {}'
    )
    assert len(calls) == 2
    for call in calls:
        with pytest.raises(ToolArgumentError) as info:
            registry.prepare_call(call)
        assert "Invalid arguments" in info.value.to_model_message()
    named = calls[1]
    with pytest.raises(ToolArgumentError) as named_info:
        registry.prepare_call(named)
    assert named_info.value.tool == "get_weather"
    assert "unclosed" in named_info.value.to_model_message()


def test_unknown_tool_message_is_bounded_with_5000_tools() -> None:
    registry = ToolRegistry(Tool(name=f"tool.{i:04d}") for i in range(5000))
    with pytest.raises(UnknownToolError) as info:
        registry.prepare_call(ToolCall("c", "tool_4321x", "{}", "openai"))
    message = info.value.to_model_message()
    assert len(message) <= 2048
    assert "Unknown tool 'tool_4321x'" in message
    assert "more)" in message
    # The closest names come first, in the vocabulary of the call's format.
    assert info.value.available[0] == "tool_4321"
    assert "tool_4321" in message
    with pytest.raises(UnknownToolError) as mcp_info:
        registry.prepare_call(ToolCall("c", "tool.4321x", {}, "mcp"))
    assert mcp_info.value.available[0] == "tool.4321"
    # Case and separators are forgiven when ranking, not when looking up.
    with pytest.raises(UnknownToolError) as folded:
        registry.prepare_call(ToolCall("c", "TOOL-4321", "{}", "openai"))
    assert folded.value.available[0] == "tool_4321"
    # A huge name is clipped, not echoed.
    with pytest.raises(UnknownToolError) as big:
        registry.get("x" * 1_000_000)
    assert len(big.value.to_model_message()) <= 2048


def test_unknown_tool_small_registry_lists_all_sorted() -> None:
    registry = ToolRegistry(
        [tool_from_definition(dict(WEATHER, name=n)) for n in ("zeta", "alpha", "mid")]
    )
    with pytest.raises(UnknownToolError) as info:
        registry.get("nope")
    assert info.value.available == ("alpha", "mid", "zeta")
    assert (
        info.value.to_model_message() == "Unknown tool 'nope'. Available tools: alpha, mid, zeta."
    )


# -- exports --------------------------------------------------------------------------------------


def test_exports_round_trip_and_are_copies() -> None:
    registry = ToolRegistry.from_dir(EXAMPLES)
    for shape in (registry.to_openai(), registry.to_anthropic(), registry.to_mcp()):
        again = ToolRegistry(tool_from_definition(d) for d in shape)
        assert len(again) == len(registry)
        for original, copy_ in zip(registry, again, strict=True):
            assert copy_.parameters == original.parameters
            assert copy_.description == original.description
            assert registry.get(copy_.name) is original
    exported = registry.to_openai()
    before = copy.deepcopy(registry.get("get_weather").parameters)
    exported[0]["function"]["parameters"]["properties"].clear()
    assert registry.get("get_weather").parameters == before


def test_export_shapes() -> None:
    registry = ToolRegistry([tool_from_definition(WEATHER)])
    assert registry.to_openai() == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": WEATHER["parameters"],
            },
        }
    ]
    assert registry.to_anthropic() == [
        {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER["parameters"]}
    ]
    assert registry.to_mcp() == [
        {"name": "get_weather", "description": "Weather.", "inputSchema": WEATHER["parameters"]}
    ]


# -- functions ------------------------------------------------------------------------------------


def test_add_function_and_decorator() -> None:
    registry = ToolRegistry()

    @registry.tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    @registry.tool(name="math.mul", description="Multiply.")
    def mul(a: int, b: int) -> int:
        return a * b

    registry.add_function(lambda: "pong", name="ping")
    assert add(1, 2) == 3  # the decorator returns the function itself
    assert registry.names() == ["add", "math.mul", "ping"]
    assert registry.get("math_mul").description == "Multiply."
    assert registry.get("add").description == "Add two numbers."
    assert repr(registry) == "<ToolRegistry tools=3>"


def test_public_names_are_exported() -> None:
    for name in tools_pkg.__all__:
        assert hasattr(tools_pkg, name), name
    public = {n for n in dir(tools_pkg) if not n.startswith("_")}
    modules = {"calls", "export", "formats", "functions", "invoke", "legacy", "registry", "tool"}
    assert public - modules == set(tools_pkg.__all__)
