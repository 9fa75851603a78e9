"""Unit tests for ``agent_backend.schema.refs``: inlining local ``$ref``s without changing meaning."""

from __future__ import annotations

import copy
import pickle
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any, Optional

import jsonschema
import pytest
import referencing
import referencing.exceptions
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from agent_backend.errors import SchemaError, SchemaRefError
from agent_backend.schema.dialect import Dialect
from agent_backend.schema.refs import (
    MAX_DEPTH,
    ExternalRef,
    resolve_local_refs,
    resolve_schema,
)

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT2019 = "https://json-schema.org/draft/2019-09/schema"


def _refuse(uri: str) -> referencing.Resource[Any]:
    raise referencing.exceptions.NoSuchResource(ref=uri)


_NO_NETWORK: referencing.Registry[Any] = referencing.Registry(retrieve=_refuse)


def verdicts(schema: Any, instances: list[Any]) -> list[bool]:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, registry=_NO_NETWORK)
    return [validator.is_valid(instance) for instance in instances]


def assert_equivalent(schema: Any, instances: list[Any]) -> Any:
    resolved = resolve_local_refs(schema)
    assert verdicts(resolved, instances) == verdicts(schema, instances)
    return resolved


def refs_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from refs_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs_in(item)


# -- local refs of every shape ------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "defs"),
    [
        ("#/$defs/X", {"$defs": {"X": {"type": "integer"}}}),
        ("#/definitions/X", {"definitions": {"X": {"type": "integer"}}}),
        ("#/$defs/tilde~0field", {"$defs": {"tilde~field": {"type": "integer"}}}),
        ("#/$defs/slash~1field", {"$defs": {"slash/field": {"type": "integer"}}}),
        ("#/$defs/percent%25field", {"$defs": {"percent%field": {"type": "integer"}}}),
        ("#/$defs/foo%22bar", {"$defs": {'foo"bar': {"type": "integer"}}}),
        ("#/$defs//$defs/", {"$defs": {"": {"$defs": {"": {"type": "integer"}}}}}),
        ("#/$defs/list/1", {"$defs": {"list": [{"type": "string"}, {"type": "integer"}]}}),
        ("#anchor", {"$defs": {"X": {"$anchor": "anchor", "type": "integer"}}}),
        ("#dyn", {"$defs": {"X": {"$dynamicAnchor": "dyn", "type": "integer"}}}),
    ],
)
def test_local_pointer_and_anchor_refs_are_inlined(ref: str, defs: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, **defs}
    resolved = resolve_local_refs(schema)
    assert resolved == {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_refs_chain_and_same_document_pointer() -> None:
    schema = {
        "$defs": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/a"}, "c": {"$ref": "#/$defs/b"}},
        "properties": {"x": {"$ref": "#/$defs/c"}, "y": {"$ref": "#/properties/x"}},
    }
    resolved = assert_equivalent(schema, [{"x": 1, "y": 2}, {"x": "a"}, {"y": 1.5}])
    assert resolved == {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}


def test_draft7_anchor_via_id_and_nested_base_uri() -> None:
    schema = {
        "$schema": DRAFT7,
        "$id": "http://localhost:1234/root",
        "properties": {
            "a": {"$ref": "#foo"},
            "b": {"$ref": "http://localhost:1234/nested.json#bar"},
        },
        "definitions": {
            "A": {"$id": "#foo", "type": "integer"},
            "N": {"$id": "nested.json", "definitions": {"B": {"$id": "#bar", "type": "string"}}},
        },
    }
    resolved = assert_equivalent(schema, [{"a": 1, "b": "x"}, {"a": "x"}, {"b": 1}])
    assert resolved["properties"] == {"a": {"type": "integer"}, "b": {"type": "string"}}
    assert resolved["$id"] == "http://localhost:1234/root"


def test_draft4_uses_id() -> None:
    schema = {
        "$schema": DRAFT4,
        "id": "http://example.com/root.json",
        "properties": {"a": {"$ref": "item.json"}},
        "definitions": {"item": {"id": "item.json", "type": "integer"}},
    }
    resolved = resolve_schema(schema)
    assert resolved.dialect is Dialect.DRAFT4
    assert resolved.schema["properties"] == {"a": {"type": "integer"}}
    assert resolved.schema["id"] == "http://example.com/root.json"


def test_pointer_refs_resolve_inside_the_nearest_resource() -> None:
    schema = {
        "$id": "http://example.com/one.json",
        "$defs": {"inner": {"type": "string"}},
        "properties": {
            "foo": {
                "$id": "two.json",
                "$defs": {"inner": {"type": "integer"}},
                "$ref": "#/$defs/inner",
            },
            "bar": {"$ref": "two.json#/$defs/inner"},
            "baz": {"$ref": "#/$defs/inner"},
        },
    }
    resolved = assert_equivalent(
        schema, [{"foo": 1, "bar": 1, "baz": "s"}, {"foo": "s"}, {"baz": 1}]
    )
    props = resolved["properties"]
    assert props == {
        "foo": {"type": "integer"},
        "bar": {"type": "integer"},
        "baz": {"type": "string"},
    }


@pytest.mark.parametrize(
    "ref",
    [
        "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed#/$defs/bar",
        "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed#thing",
        "#/$defs/bar",
        "#thing",
    ],
)
def test_urn_base_uris(ref: str) -> None:
    schema = {
        "$id": "urn:uuid:deadbeef-1234-0000-0000-4321feebdaed",
        "properties": {"foo": {"$ref": ref}},
        "$defs": {"bar": {"$anchor": "thing", "type": "string"}},
    }
    resolved = assert_equivalent(schema, [{"foo": "x"}, {"foo": 1}])
    assert resolved["properties"] == {"foo": {"type": "string"}}


def test_urn_embedded_resource_with_its_own_pointer_ref() -> None:
    schema = {
        "$ref": "urn:uuid:deadbeef-4321-ffff-ffff-1234feebdaed",
        "$defs": {
            "foo": {
                "$id": "urn:uuid:deadbeef-4321-ffff-ffff-1234feebdaed",
                "$defs": {"bar": {"type": "string"}},
                "$ref": "#/$defs/bar",
            }
        },
    }
    assert resolve_local_refs(schema) == {"type": "string"}


# -- $ref with siblings ---------------------------------------------------------


def test_bare_ref_property_gets_a_concrete_type() -> None:
    """A property that is only a $ref must come out with its type (else it looks typeless)."""
    schema = {
        "type": "object",
        "properties": {"config": {"$ref": "#/$defs/Config", "description": "settings"}},
        "$defs": {
            "Config": {"type": "object", "properties": {"depth": {"type": "integer"}}},
        },
    }
    config = resolve_local_refs(schema)["properties"]["config"]
    assert config == {
        "type": "object",
        "properties": {"depth": {"type": "integer"}},
        "description": "settings",
    }


def test_validating_siblings_go_beside_the_target_in_allof() -> None:
    schema = {
        "$defs": {"A": {"properties": {"a": {"type": "integer"}}}},
        "properties": {
            "x": {
                "$ref": "#/$defs/A",
                "additionalProperties": False,
                "allOf": [{"required": ["a"]}],
            }
        },
    }
    x = assert_equivalent(schema, [{"x": {"a": 1}}, {"x": {"a": 1, "b": 2}}, {"x": {}}])
    x = x["properties"]["x"]
    assert x == {
        "additionalProperties": False,
        "allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["a"]}],
    }


@pytest.mark.parametrize("target", [True, False])
def test_annotations_beside_boolean_targets(target: bool) -> None:
    schema = {"$defs": {"b": target}, "properties": {"x": {"$ref": "#/$defs/b", "title": "T"}}}
    assert_equivalent(schema, [{"x": 1}, {}])


def test_draft7_ignores_siblings_of_ref() -> None:
    schema = {
        "$schema": DRAFT7,
        "definitions": {"reffed": {"type": "array"}},
        "properties": {"foo": {"$ref": "#/definitions/reffed", "maxItems": 2}},
    }
    resolved = assert_equivalent(schema, [{"foo": [1, 2, 3]}, {"foo": "x"}])
    assert resolved["properties"]["foo"] == {"type": "array"}


def test_draft7_ref_prevents_sibling_id_from_changing_base() -> None:
    schema = {
        "$schema": DRAFT7,
        "$id": "http://localhost:1234/sibling_id/base/",
        "definitions": {
            "foo": {"$id": "http://localhost:1234/sibling_id/foo.json", "type": "string"},
            "base_foo": {"$id": "foo.json", "type": "number"},
        },
        "allOf": [{"$id": "http://localhost:1234/sibling_id/", "$ref": "foo.json"}],
    }
    resolved = assert_equivalent(schema, ["a", 1])
    assert resolved["allOf"] == [{"type": "number"}]


# -- recursion and cycles ---------------------------------------------------------


TREE = {
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["value"],
        }
    },
    "$ref": "#/$defs/Node",
}
TREE_INSTANCES: list[Any] = [
    {"value": 1},
    {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
    {"value": 1, "children": [{"value": 2, "children": [{"value": "x"}]}]},
    {"children": []},
]


def test_recursive_schema_stays_recursive() -> None:
    """A tree node containing nodes is legal and keeps working."""
    result = resolve_schema(TREE)
    assert result.recursive_defs == ("_rec_1_Node",)
    schema = result.schema
    assert isinstance(schema, dict)
    assert schema["type"] == "object"  # the outermost use is inlined
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/_rec_1_Node"}
    assert set(schema["$defs"]) == {"_rec_1_Node"}
    assert set(refs_in(schema)) == {"#/$defs/_rec_1_Node"}
    assert verdicts(schema, TREE_INSTANCES) == [True, True, False, False]


def test_recursive_def_name_does_not_collide() -> None:
    schema = copy.deepcopy(TREE)
    schema["$defs"]["_rec_1_Node"] = {"type": "null"}
    result = resolve_schema(schema)
    assert result.recursive_defs == ("_rec_2_Node",)
    assert verdicts(result.schema, TREE_INSTANCES) == [True, True, False, False]


def test_mutual_recursion_and_root_recursion_draft7() -> None:
    schema = {
        "$schema": DRAFT7,
        "properties": {"a": {"$ref": "#/definitions/A"}, "self": {"$ref": "#"}},
        "additionalProperties": False,
        "definitions": {
            "A": {"type": "object", "properties": {"b": {"$ref": "#/definitions/B"}}},
            "B": {"type": "array", "items": {"$ref": "#/definitions/A"}},
        },
    }
    result = resolve_schema(schema)
    assert isinstance(result.schema, dict)
    assert set(result.schema["definitions"]) == set(result.recursive_defs)
    assert sorted(result.recursive_defs) == ["_rec_1_A", "_rec_2_root"]
    instances = [
        {"a": {"b": [{"b": []}, {"b": [{}]}]}, "self": {"self": {}}},
        {"a": {"b": [{"b": [1]}]}},
        {"self": {"self": {"x": 1}}},
    ]
    assert verdicts(result.schema, instances) == verdicts(schema, instances) == [True, False, False]


def test_ref_into_a_definition_that_leads_back_into_itself() -> None:
    """The ref target is reached again lexically, through its own definition."""
    schema = {
        "$defs": {"A": {"properties": {"x": {"items": {"$ref": "#/$defs/A"}}}}},
        "$ref": "#/$defs/A/properties/x",
    }
    result = resolve_schema(schema)
    assert result.recursive_defs == ("_rec_1_x",)
    instances = [[{"x": [{}]}], [{"x": [{"x": 1}]}], [{"x": [{"x": [{"x": "no"}]}]}], 3]
    assert verdicts(result.schema, instances) == verdicts(schema, instances)


@pytest.mark.parametrize(
    ("schema", "cycle"),
    [
        (
            {
                "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
                "$ref": "#/$defs/A",
            },
            ("#/$defs/A", "#/$defs/B", "#/$defs/A"),
        ),
        ({"$ref": "#"}, ("#", "#")),
        ({"allOf": [{"$ref": "#"}]}, ("#", "#")),
        ({"properties": {"a": {"type": "string"}}, "$ref": "#"}, ("#", "#")),
        ({"anyOf": [{"not": {"$ref": "#"}}]}, ("#", "#")),
        (
            {"properties": {"p": {"if": {"$ref": "#/properties/p"}}}},
            ("#/properties/p", "#/properties/p"),
        ),
        ({"dependentSchemas": {"a": {"$ref": "#"}}}, ("#", "#")),
        (
            {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}]}}, "$ref": "#/$defs/A/allOf/0"},
            ("#/$defs/A/allOf/0", "#/$defs/A", "#/$defs/A/allOf/0"),
        ),
        (
            {
                "$schema": DRAFT7,
                "definitions": {"A": {"$ref": "#/definitions/A"}},
                "$ref": "#/definitions/A",
            },
            None,
        ),
    ],
)
def test_ref_only_cycle_raises_named_error(schema: dict[str, Any], cycle: Any) -> None:
    """A ref cycle with no instance step is a SchemaRefError, not RecursionError."""
    with pytest.raises(SchemaRefError, match="cycle") as info:
        resolve_schema(schema, source="tool.json")
    assert info.value.source == "tool.json"
    if cycle is not None:
        assert info.value.cycle == cycle
    assert " -> ".join(info.value.cycle) in str(info.value)


def test_boolean_root_is_returned_as_is() -> None:
    assert resolve_local_refs(True) is True
    assert resolve_schema(False).schema is False


# -- limits: never RecursionError -------------------------------------------------


def nested(depth: int, leaf: Any) -> Any:
    schema = leaf
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_deep_schema_raises_schema_error_not_recursion_error() -> None:
    with pytest.raises(SchemaError, match="deeper"):
        resolve_schema(nested(10_000, {"type": "integer"}))


def test_long_ref_chain_raises_schema_error() -> None:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5_000)}
    defs["d5000"] = {"type": "integer"}
    with pytest.raises(SchemaError, match="deeper"):
        resolve_schema({"$defs": defs, "$ref": "#/$defs/d0"})


def test_schema_just_under_the_depth_bound_resolves() -> None:
    schema = nested(MAX_DEPTH - 2, {"$ref": "#/$defs/leaf"})
    schema = {**schema, "$defs": {"leaf": {"type": "integer"}}}
    resolved = resolve_local_refs(schema)
    assert "$ref" not in str(resolved)


def test_deeply_nested_data_is_copied_without_recursion() -> None:
    data: Any = 0
    for _ in range(10_000):
        data = [data]
    resolved = resolve_local_refs({"const": data, "default": {"k": data}})
    assert isinstance(resolved, dict)
    assert resolved["const"] is not data


def test_exponential_inlining_is_bounded() -> None:
    defs: dict[str, Any] = {"d40": {"type": "integer"}}
    for i in range(40):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
    with pytest.raises(SchemaError, match="more than"):
        resolve_schema({"$defs": defs, "$ref": "#/$defs/d0"})


# -- external refs: never fetched ---------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.mark.usefixtures("no_network")
def test_remote_refs_are_reported_not_fetched() -> None:
    """An external $ref is an SSRF hole in a daemon; leave it and report it."""
    schema = {
        "$id": "https://tools.example.com/schemas/search.json",
        "properties": {
            "remote": {"$ref": "http://169.254.169.254/latest/meta-data"},
            "sibling": {"$ref": "common.json#/$defs/Query", "description": "q"},
            "meta": {"$ref": "https://json-schema.org/draft/2020-12/schema"},
            "file": {"$ref": "file:///etc/passwd"},
        },
    }
    result = resolve_schema(schema)
    assert result.external_refs == (
        ExternalRef(
            "/properties/remote",
            "http://169.254.169.254/latest/meta-data",
            "http://169.254.169.254/latest/meta-data",
        ),
        ExternalRef(
            "/properties/sibling",
            "common.json#/$defs/Query",
            "https://tools.example.com/schemas/common.json#/$defs/Query",
        ),
        ExternalRef(
            "/properties/meta",
            "https://json-schema.org/draft/2020-12/schema",
            "https://json-schema.org/draft/2020-12/schema",
        ),
        ExternalRef("/properties/file", "file:///etc/passwd", "file:///etc/passwd"),
    )
    assert isinstance(result.schema, dict)
    assert result.schema["properties"]["sibling"] == {
        "$ref": "https://tools.example.com/schemas/common.json#/$defs/Query",
        "description": "q",
    }


@pytest.mark.usefixtures("no_network")
def test_external_ref_inside_moved_resource_is_made_absolute() -> None:
    schema = {
        "$id": "http://example.com/root.json",
        "properties": {"a": {"$ref": "sub/item.json"}},
        "$defs": {"item": {"$id": "sub/item.json", "$ref": "other.json"}},
    }
    result = resolve_schema(schema)
    assert result.schema == {
        "$id": "http://example.com/root.json",
        "properties": {"a": {"$ref": "http://example.com/sub/other.json"}},
    }
    assert [ref.pointer for ref in result.external_refs] == ["/$defs/item"]


def test_relative_external_ref_stays_relative_without_base() -> None:
    result = resolve_schema({"properties": {"a": {"$ref": "other.json#/x"}}})
    assert result.schema == {"properties": {"a": {"$ref": "other.json#/x"}}}
    assert result.external_refs == (ExternalRef("/properties/a", "other.json#/x", "other.json#/x"),)


# -- what is data stays data --------------------------------------------------------


def test_non_schema_keywords_are_not_walked() -> None:
    data_ref = {"$ref": "#/$defs/missing"}
    schema = {
        "enum": [data_ref],
        "const": data_ref,
        "default": data_ref,
        "examples": [data_ref],
        "required": ["$ref"],
        "x-vendor": data_ref,
        "properties": {"$ref": {"type": "string"}},
        "dependencies": {"a": ["b"], "c": {"$ref": "#/$defs/S"}},
        "$defs": {"S": {"required": ["d"]}},
    }
    resolved = assert_equivalent(schema, [data_ref, {"$ref": 1}, {"c": 1}])
    for key in ("enum", "const", "default", "examples", "required", "x-vendor"):
        assert resolved[key] == schema[key]
    assert resolved["properties"] == {"$ref": {"type": "string"}}
    assert resolved["dependencies"] == {"a": ["b"], "c": {"required": ["d"]}}


def test_property_named_ref_holding_a_real_ref() -> None:
    schema = {"properties": {"$ref": {"$ref": "#/$defs/s"}}, "$defs": {"s": {"type": "string"}}}
    assert resolve_local_refs(schema) == {"properties": {"$ref": {"type": "string"}}}


def test_every_schema_position_is_walked() -> None:
    leaf = {"$ref": "#/$defs/i"}
    schema = {
        "$defs": {"i": {"type": "integer"}},
        "additionalProperties": leaf,
        "patternProperties": {"^x": leaf},
        "propertyNames": leaf,
        "items": leaf,
        "prefixItems": [leaf],
        "contains": leaf,
        "unevaluatedItems": leaf,
        "unevaluatedProperties": leaf,
        "if": leaf,
        "then": leaf,
        "else": leaf,
        "not": leaf,
        "anyOf": [leaf],
        "oneOf": [leaf],
        "allOf": [leaf],
        "dependentSchemas": {"a": leaf},
        "contentSchema": leaf,
    }
    resolved = resolve_local_refs(schema)
    assert list(refs_in(resolved)) == []


# -- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref", ["#/$defs/missing", "#nowhere", "#/$defs/list/7", "#/$defs/list/01"]
)
def test_missing_local_target_raises(ref: str) -> None:
    schema = {"$defs": {"list": [True]}, "properties": {"a": {"$ref": ref}}}
    with pytest.raises(SchemaRefError, match="points to nothing") as info:
        resolve_schema(schema, source="search")
    error = info.value
    assert (error.ref, error.pointer, error.source) == (ref, "/properties/a", "search")
    restored = pickle.loads(pickle.dumps(error))
    assert (restored.ref, restored.pointer, str(restored)) == (ref, "/properties/a", str(error))


@pytest.mark.parametrize(
    "schema",
    [
        {"$dynamicRef": "#meta", "$defs": {"m": {"$dynamicAnchor": "meta"}}},
        {"$schema": DRAFT2019, "properties": {"a": {"$recursiveRef": "#"}}},
    ],
)
def test_dynamic_refs_are_unsupported(schema: dict[str, Any]) -> None:
    with pytest.raises(SchemaRefError, match="is not supported"):
        resolve_schema(schema)


def test_non_string_ref_raises() -> None:
    with pytest.raises(SchemaRefError, match="must be a string"):
        resolve_schema({"properties": {"a": {"$ref": 3}}})


# -- copies, not views ---------------------------------------------------------------


def containers(node: Any) -> Iterator[int]:
    if isinstance(node, dict | list):
        yield id(node)
        for child in node.values() if isinstance(node, dict) else node:
            yield from containers(child)


def test_input_is_never_mutated_and_never_shared() -> None:
    schema = {
        "$id": "http://example.com/x.json",
        "properties": {
            "a": {"$ref": "#/$defs/A", "title": "a", "default": {"k": [1]}},
            "b": {"enum": [[1], {"x": 1}]},
        },
        "$defs": {"A": {"type": "object", "properties": {"n": {"const": {"deep": [1]}}}}},
    }
    before = copy.deepcopy(schema)
    resolved = resolve_local_refs(schema)
    assert schema == before
    assert not set(containers(resolved)) & set(containers(schema))
    again = resolve_schema(TREE).schema
    assert not set(containers(again)) & set(containers(TREE))


# -- pydantic ---------------------------------------------------------------------------


class Address(BaseModel):
    street: str
    zip_code: int


class Person(BaseModel):
    name: str
    home: Address = Field(description="where they live")
    work: Optional[Address] = None  # noqa: UP045 - the Optional spelling pydantic users write


class Category(BaseModel):
    name: str
    parent: Optional[Category] = None  # noqa: UP045
    children: list[Category] = []


def test_pydantic_nested_models_resolve_to_concrete_types() -> None:
    schema = Person.model_json_schema()
    resolved = resolve_schema(schema)
    assert resolved.recursive_defs == ()
    assert isinstance(resolved.schema, dict)
    home = resolved.schema["properties"]["home"]
    assert home["type"] == "object"
    assert home["description"] == "where they live"
    assert "$defs" not in resolved.schema
    assert list(refs_in(resolved.schema)) == []
    instances = [
        {"name": "a", "home": {"street": "s", "zip_code": 1}},
        {"name": "a", "home": {"street": "s", "zip_code": "1"}},
        {"name": "a", "home": {"street": "s", "zip_code": 1}, "work": None},
        {"name": "a", "home": {"street": "s", "zip_code": 1}, "work": {"street": 1}},
    ]
    assert verdicts(resolved.schema, instances) == verdicts(schema, instances)


def test_pydantic_self_referential_model() -> None:
    schema = Category.model_json_schema()
    result = resolve_schema(schema)
    assert result.recursive_defs == ("_rec_1_Category",)
    assert isinstance(result.schema, dict)
    assert result.schema["type"] == "object"
    instances = [
        {"name": "root", "children": [{"name": "a", "children": [{"name": "b"}]}]},
        {"name": "root", "parent": {"name": "p", "parent": None}},
        {"name": "root", "children": [{"name": "a", "children": [{"name": 1}]}]},
        {"name": "root", "parent": {"parent": None}},
    ]
    assert (
        verdicts(result.schema, instances)
        == verdicts(schema, instances)
        == [True, True, False, False]
    )


# -- property: resolution never changes a verdict --------------------------------------

_LEAVES = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "string"},
        {"type": "array"},
        {"minimum": 2},
        {"required": ["a"]},
        {"const": None},
        True,
        False,
    ]
)


# Refs to whole definitions, and into the middle of one (which may not exist).
_REF_TARGETS = st.sampled_from(
    [
        "#/$defs/d0",
        "#/$defs/d1",
        "#/$defs/d1/items",
        "#/$defs/d1/not",
        "#/$defs/d1/anyOf/0",
        "#/$defs/d1/properties/a",
        "#/allOf/0",
    ]
)


def _compose(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda xs: {"anyOf": xs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda x: {"not": x}, children),
        st.builds(lambda x: {"items": x}, children),
        st.builds(
            lambda d, extra: {"properties": d, "additionalProperties": extra},
            st.dictionaries(st.sampled_from("abc"), children, max_size=2),
            children,
        ),
        st.builds(
            lambda x, t: {"$ref": x, "title": t},
            _REF_TARGETS,
            st.text(max_size=3),
        ),
        st.builds(lambda x: {"$ref": x, "minProperties": 1}, _REF_TARGETS),
        st.builds(lambda: {"properties": {"r": {"$ref": "#"}}}),
    )


_SCHEMAS = st.recursive(_LEAVES, _compose, max_leaves=8)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "a"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "b", "r"]), inner, max_size=3)
    ),
    max_leaves=6,
)


def _resolve_unless_cycle(schema: Any) -> Any:
    try:
        return resolve_local_refs(schema)
    except SchemaRefError as error:
        assume("points to nothing" not in str(error))  # a generated ref into a missing place
        if "cycle" not in str(error):
            raise
        return None


@settings(max_examples=300, deadline=None)
@given(
    body=_SCHEMAS,
    d0=_LEAVES,
    d1=_SCHEMAS,
    instances=st.lists(_JSON, min_size=1, max_size=5),
)
def test_resolution_keeps_every_verdict(body: Any, d0: Any, d1: Any, instances: list[Any]) -> None:
    """d1 may refer to d0, to itself and to the root; the result must judge alike."""
    schema = {"$defs": {"d0": d0, "d1": d1}}
    schema.update(body if isinstance(body, dict) else {"allOf": [body]})
    resolved = _resolve_unless_cycle(schema)
    if resolved is None:  # a ref-only cycle: validating the original would never end either
        return
    try:
        expected = verdicts(schema, instances)
    except RecursionError:  # pragma: no cover - a cycle the resolver should have refused
        pytest.fail("original loops but resolution succeeded")
    assert verdicts(resolved, instances) == expected
