"""Tool: validated name, immutable, compiled exactly once, picklable by its definition."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest

from agent_backend.errors import SchemaError, ToolArgumentError
from agent_backend.schema import CompiledSchema, compile_schema
from agent_backend.tools import Tool

PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["n"],
}


def test_schema_is_compiled_once_not_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[CompiledSchema] = []
    real = compile_schema

    def counting(schema: Any, **kwargs: Any) -> CompiledSchema:
        compiled.append(real(schema, **kwargs))
        return compiled[-1]

    monkeypatch.setattr("agent_backend.tools.tool.compile_schema", counting)
    tool = Tool(name="count", parameters=PARAMS)
    for i in range(200):
        assert tool.prepare(f'{{"n": "{i}"}}') == {"n": i}
    assert len(compiled) == 1
    assert tool.compiled is compiled[0]


def test_tool_is_immutable_and_owns_its_data() -> None:
    params: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    meta: dict[str, Any] = {"x-agent-backend": {"timeout": 5}}
    tool = Tool(name="t", parameters=params, meta=meta)
    params["properties"]["n"]["type"] = "string"
    meta["x-agent-backend"]["timeout"] = 99
    assert tool.parameters["properties"]["n"]["type"] == "integer"
    assert tool.meta["x-agent-backend"] == {"timeout": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        tool.name = "u"  # type: ignore[misc]
    with pytest.raises(TypeError):
        tool.meta["new"] = 1  # type: ignore[index]
    assert tool.prepare({"n": 1}) == {"n": 1}


@pytest.mark.parametrize("name", ["get_weather", "math.factorial", "a-b", "A" * 64, "x"])
def test_valid_names(name: str) -> None:
    assert Tool(name=name).name == name


@pytest.mark.parametrize("name", ["", "a b", "a/b", "é", "A" * 65, "call()", None, 3])
def test_invalid_names(name: Any) -> None:
    with pytest.raises(SchemaError) as info:
        Tool(name=name)
    assert info.value.pointer == "/name"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"type": "string"}, "describe an object"),
        ([], "must be an object"),
        (
            {"type": "object", "properties": {"n": {"type": "integer", "minimum": "0"}}},
            "valid JSON Schema",
        ),
    ],
)
def test_bad_parameters(parameters: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Tool(name="t", parameters=parameters)


def test_default_parameters_accept_an_empty_object_only() -> None:
    tool = Tool(name="noop")
    assert tool.prepare("{}") == {}
    with pytest.raises(ToolArgumentError):
        tool.prepare("")
    with pytest.raises(ToolArgumentError):
        tool.prepare("[]")


def test_prepare_names_the_tool_in_errors() -> None:
    tool = Tool(name="count", parameters=PARAMS)
    with pytest.raises(ToolArgumentError) as info:
        tool.prepare('{"n": "many"}')
    assert info.value.tool == "count"
    assert "/n" in info.value.to_model_message()


def test_pickle_round_trip_recompiles() -> None:
    tool = Tool(
        name="math.count",
        description="Count.",
        parameters=PARAMS,
        meta={"x-agent-backend": {"backend": "ssh"}},
        source="tools/count.json",
        normalizations=("/type",),
    )
    again = pickle.loads(pickle.dumps(tool))
    assert (
        again.name,
        again.description,
        again.parameters,
        again.source,
        again.normalizations,
    ) == (
        tool.name,
        tool.description,
        tool.parameters,
        tool.source,
        tool.normalizations,
    )
    assert dict(again.meta) == dict(tool.meta)
    assert again.prepare({"n": "2"}) == {"n": 2}
    assert again.compiled is not tool.compiled
