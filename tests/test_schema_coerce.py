"""The compiled repair (``agent_backend.schema.coerce``): the edges its per-node functions make delicate.

Each schema node is compiled once into a function specialized for what it
holds; these tests pin the behaviour that specialization must not change:
recursive ``$defs`` (compiled lazily), unions of objects, positional items,
defaults, what already validates, copy on write, and the depth bound on
JSON text found inside arguments.
"""

from __future__ import annotations

import copy
import enum
import json
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.schema_strategies import json_values

from agent_backend.errors import ToolArgumentError
from agent_backend.schema import Limits, compile_schema, prepare_arguments
from agent_backend.schema.coerce import Coercer
from agent_backend.schema.coerce_rules import json_equal, member_test


def never_valid(node: Any, value: Any) -> bool:
    return False


def coercer(schema: dict[str, Any], **kw: Any) -> Coercer:
    return Coercer(schema, is_valid=kw.pop("is_valid", never_valid), max_depth=64, **kw)


# -- recursive schemas -------------------------------------------------------------------


class Tree(pydantic.BaseModel):
    value: int
    children: list[Tree] = []


def test_recursive_defs_repair_at_every_level_and_keep_what_is_valid() -> None:
    schema = Tree.model_json_schema()
    leaf = {"value": 4, "children": []}
    given = {
        "value": "1",
        "children": [
            {"value": "2", "children": json.dumps([{"value": "3"}])},
            leaf,
        ],
    }
    out = prepare_arguments(schema, given)
    assert out == {
        "value": 1,
        "children": [{"value": 2, "children": [{"value": 3}]}, leaf],
    }
    Tree.model_validate(out)


def test_recursion_as_deep_as_the_depth_bound_is_repaired_without_recursion_error() -> None:
    schema = Tree.model_json_schema()
    nested: dict[str, Any] = {"value": "0"}
    for level in range(1, 31):  # 31 objects and 30 arrays: 61 levels, within 64
        nested = {"value": str(level), "children": [nested]}
    out = prepare_arguments(schema, nested)
    node = out
    for level in range(30, 0, -1):
        assert node["value"] == level
        node = node["children"][0]
    assert node == {"value": 0}


def test_mutual_recursion_through_draft7_definitions() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"a": {"$ref": "#/definitions/A"}},
        "definitions": {
            "A": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "b": {"$ref": "#/definitions/B"}},
            },
            "B": {
                "type": "object",
                "properties": {"m": {"type": "boolean"}, "a": {"$ref": "#/definitions/A"}},
            },
        },
    }
    given = {"a": {"n": "1", "b": {"m": "true", "a": '{"n": "2", "b": {"m": "false"}}'}}}
    assert prepare_arguments(schema, given) == {
        "a": {"n": 1, "b": {"m": True, "a": {"n": 2, "b": {"m": False}}}}
    }


def test_root_recursion_through_hash_ref() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "next": {"$ref": "#"}},
    }
    given = {"n": "1", "next": {"n": "2", "next": '{"n": "3"}'}}
    assert prepare_arguments(schema, given) == {"n": 1, "next": {"n": 2, "next": {"n": 3}}}


def test_a_deeply_nested_schema_compiles_without_recursion() -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(120):
        schema = {"type": "object", "properties": {"p": schema}}
    value: Any = "7"
    for _ in range(120):
        value = {"p": value}
    out = Coercer(schema, is_valid=never_valid, max_depth=64).coerce(value, known_invalid=True)
    for _ in range(120):
        out = out["p"]
    assert out == 7


# -- unions ------------------------------------------------------------------------------

ONE_OF_OBJECTS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "shape": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                    "required": ["kind", "r"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                    "required": ["kind", "side"],
                },
            ]
        }
    },
}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"kind": "circle", "r": "1.5"}, {"kind": "circle", "r": 1.5}),
        ({"kind": "square", "side": "3"}, {"kind": "square", "side": 3}),
        ('{"kind": "square", "side": "3"}', {"kind": "square", "side": 3}),
        ({"kind": "circle", "r": 2}, {"kind": "circle", "r": 2}),
    ],
)
def test_union_of_objects_takes_the_branch_its_repair_satisfies(
    given: Any, expected: dict[str, Any]
) -> None:
    assert prepare_arguments(ONE_OF_OBJECTS, {"shape": given}) == {"shape": expected}


def test_union_branch_that_already_accepts_wins_and_is_not_entered() -> None:
    schema = {
        "type": "object",
        "properties": {
            "v": {
                "anyOf": [
                    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["m"]},
                    {"type": "object"},
                ]
            }
        },
    }
    # The first branch would turn "5" into 5, but the second accepts the value as it is.
    assert prepare_arguments(schema, {"v": {"n": "5"}}) == {"v": {"n": "5"}}


def test_union_branch_whose_repair_still_fails_is_passed_over() -> None:
    schema = {
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "boolean"}]},
        },
    }
    assert prepare_arguments(schema, {"v": "true"}) == {"v": True}
    assert prepare_arguments(schema, {"v": "12"}) == {"v": 12}
    with pytest.raises(ToolArgumentError):
        prepare_arguments(schema, {"v": "5"})


def test_integral_float_satisfies_an_integer_branch() -> None:
    schema = {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
    }
    out = prepare_arguments(schema, {"v": 2.0})
    assert out == {"v": 2.0}
    assert type(out["v"]) is float


def test_nullable_ref_union_keeps_null_and_repairs_the_object() -> None:
    class Inner(pydantic.BaseModel):
        k: int

    class Outer(pydantic.BaseModel):
        inner: Inner | None = None

    schema = Outer.model_json_schema()
    assert prepare_arguments(schema, {"inner": None}) == {"inner": None}
    assert prepare_arguments(schema, {"inner": "null"}) == {"inner": None}
    assert prepare_arguments(schema, {"inner": '{"k": "3"}'}) == {"inner": {"k": 3}}


# -- positional items ---------------------------------------------------------------------


def test_draft7_items_array_with_and_without_additional_items() -> None:
    with_more = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "t": {
                "type": "array",
                "items": [{"type": "integer"}, True, {"type": "boolean"}],
                "additionalItems": {"type": "number"},
            },
            "u": {"type": "array", "items": [{"type": "integer"}]},
        },
    }
    out = prepare_arguments(with_more, {"t": ["1", "2", "true", "4.5"], "u": ["1", "2"]})
    assert out == {"t": [1, "2", True, 4.5], "u": [1, "2"]}


def test_prefix_items_then_items_and_json_text_array() -> None:
    schema = {
        "type": "object",
        "properties": {
            "p": {
                "type": "array",
                "prefixItems": [{"type": "string"}, {"type": "integer"}],
                "items": {"type": "boolean"},
            }
        },
    }
    assert prepare_arguments(schema, {"p": '["1", "2", "true", "false"]'}) == {
        "p": ["1", 2, True, False]
    }


# -- own value: enum, const, type lists ---------------------------------------------------


def test_enum_and_const_of_containers_are_read_from_json_text() -> None:
    schema = {
        "type": "object",
        "properties": {
            "e": {"enum": [[1, 2], {"a": 1}, 3.0]},
            "c": {"const": {"x": [1]}},
            "s": {"enum": ["1", "2"]},
        },
    }
    assert prepare_arguments(schema, {"e": "[1, 2]", "c": '{"x": [1]}', "s": "1"}) == {
        "e": [1, 2],
        "c": {"x": [1]},
        "s": "1",
    }
    out = prepare_arguments(schema, {"e": "3"})
    assert out == {"e": 3}


def test_type_list_with_a_container_keeps_the_container_and_converts_text() -> None:
    schema = {
        "type": "object",
        "properties": {"v": {"type": ["array", "null"]}, "w": {"type": ["object", "integer"]}},
    }
    assert prepare_arguments(schema, {"v": [1, "x"], "w": {"a": "1"}}) == {
        "v": [1, "x"],
        "w": {"a": "1"},
    }
    assert prepare_arguments(schema, {"v": "null", "w": "4"}) == {"v": None, "w": 4}
    assert prepare_arguments(schema, {"v": "[1]", "w": '{"a": 1}'}) == {"v": [1], "w": {"a": 1}}
    assert prepare_arguments(schema, {"v": 7}) == {"v": [7]}


@pytest.mark.parametrize(
    ("text", "wanted", "expected"),
    [
        ("-12", "integer", -12),
        ("+4", "integer", 4),
        ("1e2", "integer", 100),
        ("2.50", "integer", None),
        ("-2.5", "number", -2.5),
        ("+0.5", "number", 0.5),
        ("1.5e3", "number", 1500.0),
        ("1e2", "number", 100.0),
        ("1.", "number", None),
        (".5", "number", None),
        ("1.5.5", "number", None),
        ("+", "number", None),
        ("-", "integer", None),
        ("9" * 401, "integer", None),
        ("9" * 390 + ".5", "number", None),  # finite text, infinite float
        ("9" * 310 + ".5", "number", None),
        ("9" * 299 + ".5", "number", float("9" * 299 + ".5")),
        ("9" * 305 + ".5", "number", float("9" * 305 + ".5")),
        ("9.5", "number", 9.5),
        (" 120.0\n", "number", 120.0),
        ("\u0663.\u0665", "number", 3.5),  # Unicode decimal digits, as int() and float() read
        ("\u0663", "integer", 3),
        ("1_000", "integer", None),
        ("1_000.5", "number", None),
        ("1.5_0", "number", None),
        ("nan", "number", None),
        ("inf", "number", None),
        ("Infinity", "number", None),
        ("9.5", "integer", None),
        ("4.0", "integer", 4),
    ],
)
def test_numeric_text_rules(text: str, wanted: str, expected: Any) -> None:
    fix = coercer({"type": wanted})
    out = fix.coerce(text)
    if expected is None:
        assert out == text
    else:
        assert out == expected
        assert type(out) is type(expected)


# -- defaults, what validates, copy on write ------------------------------------------------


def test_defaults_are_injected_into_valid_and_nested_objects_only_when_asked() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "default": 3},
            "o": {
                "type": "object",
                "properties": {"k": {"type": "boolean", "default": False}},
                "additionalProperties": {"type": "integer"},
            },
        },
    }
    assert prepare_arguments(schema, {"o": {}}) == {"o": {}}
    assert prepare_arguments(schema, {"o": {}}, inject_defaults=True) == {
        "n": 3,
        "o": {"k": False},
    }
    assert prepare_arguments(schema, {"o": '{"x": "2"}'}, inject_defaults=True) == {
        "n": 3,
        "o": {"x": 2, "k": False},
    }


def test_a_container_the_subschema_accepts_is_not_entered() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"o": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    }
    inner = schema["properties"]["o"]

    def accepts_inner(node: Any, value: Any) -> bool:
        return node is inner

    given = {"o": {"n": "5"}, "p": 1}
    fix = coercer(schema, is_valid=accepts_inner)
    assert fix.coerce(given, known_invalid=True) is given  # "o" accepted: nothing changed
    assert coercer(schema).coerce(given, known_invalid=True) == {"o": {"n": 5}, "p": 1}


def test_input_is_never_mutated_and_unchanged_parts_are_shared() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}},
            "b": {"type": "object", "properties": {"k": {"type": "integer"}}},
            "c": {"type": "object", "properties": {"k": {"type": "integer"}}},
        },
    }
    given = {"a": ["1", 2], "b": {"k": "3"}, "c": {"k": 4}}
    before = copy.deepcopy(given)
    out = coercer(schema).coerce(given, known_invalid=True)
    assert given == before
    assert out == {"a": [1, 2], "b": {"k": 3}, "c": {"k": 4}}
    assert out is not given
    assert out["a"] is not given["a"]
    assert out["c"] is given["c"]  # copy on write: nothing in "c" changed


# -- JSON text inside arguments ----------------------------------------------------------


def test_json_text_inside_arguments_respects_the_depth_bound() -> None:
    schema = {
        "type": "object",
        "properties": {"o": {"type": "object"}, "a": {"type": "array"}},
    }
    compiled = compile_schema(schema, limits=Limits(max_depth=4))
    assert compiled.prepare({"o": '{"b": {"c": {}}}'}) == {"o": {"b": {"c": {}}}}  # levels 2-4
    with pytest.raises(ToolArgumentError):
        compiled.prepare({"o": '{"b": {"c": {"d": {}}}}'})  # level 5: left as text, which fails
    hostile = "[" * 100_000 + "]" * 100_000
    assert Coercer(schema, is_valid=never_valid, max_depth=64).coerce({"a": hostile}) == {
        "a": [hostile]  # not read (too deep): taken as a lone value, as any other text
    }


def test_big_integers_inside_json_text_stay_exact() -> None:
    schema = {
        "type": "object",
        "properties": {"o": {"type": "object", "properties": {"k": {"type": "integer"}}}},
    }
    big = 123456789012345678901234567890
    out = prepare_arguments(schema, {"o": json.dumps({"k": big})})
    assert out == {"o": {"k": big}}
    assert type(out["o"]["k"]) is int


def test_json_text_depth_bound_holds_for_short_text_and_for_long_shallow_text() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array"}}}
    compiled = compile_schema(schema, limits=Limits(max_depth=4))
    assert compiled.prepare({"a": "[[[]]]"}) == {"a": [[[]]]}  # levels 2-4
    assert compiled.prepare({"a": "[[[[]]]]"}) == {"a": ["[[[[]]]]"]}  # level 5: not read
    # Long text with many brackets, side by side rather than nested: walked, and within bound.
    wide = json.dumps([[[]] for _ in range(50)])
    assert compiled.prepare({"a": wide}) == {"a": [[[]] for _ in range(50)]}
    deep_and_wide = json.dumps([[[[]]]] + [[] for _ in range(50)])
    assert compiled.prepare({"a": deep_and_wide}) == {"a": [deep_and_wide]}


@pytest.mark.parametrize(
    "literal", ["12345678901234567890", "-9223372036854775809", "1e19", "1.5E20", "-2e300"]
)
def test_short_json_text_with_a_big_number_is_read_exactly(literal: str) -> None:
    fix = coercer({"type": "array", "items": {"type": "number"}})
    out = fix.coerce(f"[{literal}, 1]")
    assert out == [json.loads(literal), 1]
    assert type(out[0]) is type(json.loads(literal))


def test_array_of_objects_from_text_and_a_lone_value_are_repaired_item_by_item() -> None:
    item = {"type": "object", "properties": {"n": {"type": "integer"}}}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": item}},
    }
    text = json.dumps([{"n": "1"}, json.dumps({"n": "2"}), {"n": 3}])
    assert coercer(schema).coerce({"a": text}) == {"a": [{"n": 1}, {"n": 2}, {"n": 3}]}
    assert coercer(schema).coerce({"a": "not json"}) == {"a": ["not json"]}
    given = [{"n": 1}, {"n": "2"}]
    out = coercer(schema).coerce({"a": given})["a"]
    assert out == [{"n": 1}, {"n": 2}]
    assert out is not given
    assert out[0] is given[0]  # copy on write
    inner = schema["properties"]["a"]
    accepted = coercer(schema, is_valid=lambda node, value: node is inner)
    assert accepted.coerce({"a": given}, known_invalid=True)["a"] is given  # not entered


def test_a_union_keeps_a_value_of_a_type_a_plain_branch_allows() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "t": {"anyOf": [{"type": "string", "title": "Text"}, {"type": "integer"}]},
        },
        "required": ["n", "t"],
    }
    fix = coercer(schema)
    assert fix.coerce({"n": None, "t": "5"}) == {"n": None, "t": "5"}
    assert fix.coerce({"n": "5", "t": 5}) == {"n": 5, "t": 5}
    assert fix.coerce({"n": "null"}) == {"n": None}


def test_json_text_with_a_lone_surrogate_is_not_decoded() -> None:
    # orjson refuses it, the standard library would read it: not Unicode text, so the
    # text is not taken for the array it spells (only wrapped as a lone string, by rule).
    lone_surrogate = '["\\ud800", "x"]'
    fix = coercer({"type": "array", "items": {"type": "string"}})
    assert fix.coerce(lone_surrogate) == [lone_surrogate]


_ODD_SCALARS = [1, 1.0, -0.0, 0, True, False, None, "1", "", 2**63, float(2**63), float("nan")]


class _Number(enum.IntEnum):
    ONE = 1


class _Text(str):
    pass


@settings(max_examples=300, deadline=None, database=None)
@given(
    members=st.lists(st.one_of(json_values, st.sampled_from(_ODD_SCALARS)), max_size=6),
    value=st.one_of(
        json_values, st.sampled_from([*_ODD_SCALARS, _Number.ONE, _Text("1"), [1], {"a": 1}])
    ),
)
def test_enum_membership_by_key_is_json_equality(members: list[Any], value: Any) -> None:
    """``member_test`` (a set lookup for scalar members) answers as ``json_equal`` with each."""
    assert member_test(members)(value) == any(json_equal(value, m) for m in members)
