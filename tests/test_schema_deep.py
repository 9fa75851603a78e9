"""Loading any schema, however deep, wide or cyclic, raises SchemaError and nothing else.

Peers' suites carry 550- and 5,000-level schemas; here 10,000 levels of each of
``properties``, ``items``, ``allOf``, ``anyOf`` and ``$ref`` chains, a dict that contains
itself, and a document that shares subtrees to explode. Before, anything past ~240 levels
raised RecursionError from the copy made when a schema was compiled (issue 16, first part).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from agent_backend.errors import SchemaError
from agent_backend.schema import check_json_shape, compile_schema
from agent_backend.tools import Tool

pytestmark = pytest.mark.timeout(120)

KINDS = ("properties", "items", "allOf", "anyOf", "$ref", "default")


def nested(kind: str, levels: int) -> dict[str, Any]:
    """``levels`` of ``kind`` around an integer schema, built without recursion."""
    if kind == "$ref":
        defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(levels)}
        defs[f"d{levels}"] = {"type": "integer"}
        return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    schema: dict[str, Any] = {"type": "integer"}
    value: Any = 1
    for _ in range(levels):
        if kind == "properties":
            schema = {"type": "object", "properties": {"a": schema}}
        elif kind == "items":
            schema = {"type": "array", "items": schema}
        elif kind == "default":  # deep data where no walker expects a schema
            value = [value]
        else:
            schema = {kind: [schema]}
    if kind == "default":
        schema = {"type": "array", "default": value}
    return {"type": "object", "properties": {"x": schema}}


def outcome(load: Any, schema: dict[str, Any]) -> str | None:
    """None when ``load(schema)`` loads it, else its SchemaError's message (anything else
    raised fails the test)."""
    try:
        load(schema)
    except SchemaError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("levels", [1, 100, 240, 550, 5_000, 10_000])
def test_any_depth_loads_or_raises_schema_error(kind: str, levels: int) -> None:
    schema = nested(kind, levels)
    for load in (compile_schema, lambda s: Tool(name="deep", parameters=s)):
        message = outcome(load, schema)
        if levels <= 100:
            assert message is None  # shallow schemas still load
        elif levels >= 550:
            assert message is not None
            assert len(message) < 500  # a bounded message, not the schema
        # At 240 levels either: items still load, properties are refused by the compiler.


def test_a_dict_that_contains_itself_is_refused() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    with pytest.raises(SchemaError, match="deeper than"):
        compile_schema(schema)
    with pytest.raises(SchemaError, match="deeper than"):
        Tool(name="cyclic", parameters=schema)


def test_a_document_that_shares_subtrees_to_explode_is_refused_quickly() -> None:
    shared: Any = {"type": "integer"}
    for _ in range(40):  # 2**40 paths through 40 objects
        shared = {"anyOf": [shared, shared]}
    with pytest.raises(SchemaError, match="more than"):
        check_json_shape({"type": "object", "properties": {"x": shared}})


def test_the_check_does_not_recurse() -> None:
    deep: Any = 0
    for _ in range(sys.getrecursionlimit() * 20):
        deep = [deep]
    with pytest.raises(SchemaError):
        check_json_shape(deep)
    check_json_shape(deep, max_depth=sys.getrecursionlimit() * 30)  # walks it, iteratively


@pytest.mark.parametrize("kind", ["oneOf", "anyOf", "allOf", "not"])
@pytest.mark.parametrize("levels", [120, 180])
def test_a_deep_malformed_schema_raises_schema_error(kind: str, levels: int) -> None:
    """The reference checker that names a malformed schema's problem recurses several frames
    per level; found by bench/schema_fuzz.py: RecursionError at 120 levels, now SchemaError."""
    leaf: Any = {"anyOf": True}  # malformed: anyOf takes a list
    for _ in range(levels):
        leaf = {"not": leaf} if kind == "not" else {kind: [leaf]}
    with pytest.raises(SchemaError, match="not a valid JSON Schema"):
        compile_schema({"type": "object", "properties": {"x": leaf}})
