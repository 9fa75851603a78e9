"""Legacy type names (``dict``, ``float``, ``tuple``, ``any``...) become JSON Schema, only where they are types."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_backend.errors import SchemaError
from agent_backend.tools.legacy import JSON_TYPES, LEGACY_TYPES, normalize_legacy_types


def test_maps_every_legacy_name() -> None:
    schema = {
        "type": "dict",
        "properties": {
            "a": {"type": "float"},
            "b": {"type": "tuple", "items": {"type": "int"}},
            "c": {"type": "list", "items": {"type": "str"}},
            "d": {"type": "bool"},
            "e": {"type": "any", "description": "anything"},
        },
    }
    new, pointers = normalize_legacy_types(schema)
    assert new == {
        "type": "object",
        "properties": {
            "a": {"type": "number"},
            "b": {"type": "array", "items": {"type": "integer"}},
            "c": {"type": "array", "items": {"type": "string"}},
            "d": {"type": "boolean"},
            "e": {"description": "anything"},
        },
    }
    assert pointers == (
        "/type",
        "/properties/a/type",
        "/properties/b/type",
        "/properties/b/items/type",
        "/properties/c/type",
        "/properties/c/items/type",
        "/properties/d/type",
        "/properties/e/type",
    )


def test_standard_schema_is_unchanged_and_reports_nothing() -> None:
    schema = {"type": "object", "properties": {"x": {"type": ["string", "null"]}}}
    new, pointers = normalize_legacy_types(schema)
    assert new == schema
    assert pointers == ()


def test_type_lists_are_mapped_and_deduplicated() -> None:
    new, pointers = normalize_legacy_types({"type": ["int", "integer", "float", "null"]})
    assert new == {"type": ["integer", "number", "null"]}
    assert pointers == ("/type",)


def test_any_in_a_type_list_drops_the_constraint() -> None:
    new, pointers = normalize_legacy_types({"type": ["string", "any"], "minLength": 1})
    assert new == {"minLength": 1}
    assert pointers == ("/type",)


def test_data_positions_are_never_rewritten() -> None:
    schema = {
        "type": "object",
        "properties": {
            # Property names that look like keywords or legacy names are data.
            "type": {"type": "string", "enum": ["dict", "float"], "default": "dict"},
            "dict": {"const": {"type": "dict"}, "examples": [{"type": "any"}]},
        },
        "required": ["type"],
    }
    new, pointers = normalize_legacy_types(schema)
    assert new == schema
    assert pointers == ()


def test_every_schema_keyword_is_walked() -> None:
    sub = {"type": "dict"}
    schema = {
        "type": "object",
        "$defs": {"A": dict(sub)},
        "definitions": {"B": dict(sub)},
        "patternProperties": {"^x": dict(sub)},
        "additionalProperties": dict(sub),
        "anyOf": [dict(sub)],
        "oneOf": [dict(sub)],
        "allOf": [dict(sub)],
        "not": dict(sub),
        "if": dict(sub),
        "then": dict(sub),
        "else": dict(sub),
        "prefixItems": [dict(sub)],
        "contains": dict(sub),
        "propertyNames": {"type": "str"},
        "dependentSchemas": {"a": dict(sub)},
        "dependencies": {"a": dict(sub), "b": ["a"]},
        "unevaluatedProperties": dict(sub),
    }
    new, pointers = normalize_legacy_types(schema)
    assert "dict" not in repr(new)
    assert new["dependencies"]["b"] == ["a"]
    assert len(pointers) == 17
    assert "/dependentSchemas/a/type" in pointers
    assert "/propertyNames/type" in pointers


def test_draft7_tuple_items() -> None:
    new, pointers = normalize_legacy_types({"items": [{"type": "int"}, {"type": "str"}]})
    assert new == {"items": [{"type": "integer"}, {"type": "string"}]}
    assert pointers == ("/items/0/type", "/items/1/type")


def test_pointers_escape_property_names() -> None:
    _, pointers = normalize_legacy_types({"properties": {"a/b~c": {"type": "float"}}})
    assert pointers == ("/properties/a~1b~0c/type",)


def test_input_is_never_mutated_and_nothing_is_shared() -> None:
    schema = {"type": "dict", "properties": {"a": {"type": "float", "enum": [[1.5]]}}}
    before = copy.deepcopy(schema)
    new, _ = normalize_legacy_types(schema)
    assert schema == before
    new["properties"]["a"]["enum"][0].append(2)
    assert schema == before


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "dictionary"}, "/type"),
        ({"properties": {"x": {"type": ["string", "String"]}}}, "/properties/x/type/1"),
        ({"type": 5}, "/type"),
        ({"type": [None]}, "/type/0"),
    ],
)
def test_unknown_or_malformed_type_names_fail_with_pointer(schema: Any, pointer: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_legacy_types(schema)
    assert info.value.pointer == pointer


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(2000):
        schema = {"items": schema}
    with pytest.raises(SchemaError, match="deeper"):
        normalize_legacy_types(schema)


_names = st.sampled_from(sorted(JSON_TYPES | LEGACY_TYPES.keys()))
_schemas = st.recursive(
    st.fixed_dictionaries({}, optional={"type": _names | st.lists(_names, min_size=1, max_size=3)}),
    lambda children: st.fixed_dictionaries(
        {},
        optional={
            "type": _names,
            "properties": st.dictionaries(st.text(max_size=5), children, max_size=3),
            "items": children,
            "anyOf": st.lists(children, min_size=1, max_size=3),
            "enum": st.lists(_names, max_size=3),
        },
    ),
    max_leaves=10,
)


@given(_schemas)
def test_result_has_only_standard_types_and_is_idempotent(schema: dict[str, Any]) -> None:
    new, pointers = normalize_legacy_types(schema)
    again, more = normalize_legacy_types(new)
    assert again == new
    assert more == ()

    def types_in(node: Any) -> list[Any]:
        if not isinstance(node, dict):
            return []
        found = [node["type"]] if "type" in node else []
        for key in ("items",):
            found += types_in(node.get(key))
        for sub in node.get("properties", {}).values():
            found += types_in(sub)
        for sub in node.get("anyOf", []):
            found += types_in(sub)
        return found

    for value in types_in(new):
        assert set(value if isinstance(value, list) else [value]) <= JSON_TYPES
    # enum values are data: never rewritten.
    if "enum" in schema:
        assert new["enum"] == schema["enum"]
    assert (pointers == ()) == (new == schema)
