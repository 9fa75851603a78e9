"""The compiled repair (``agent_backend.schema.coerce``): the edges its per-node functions make delicate.

Each schema node is compiled once into a function specialized for what it
holds; these tests pin the behaviour that specialization must not change:
recursive ``$defs`` (compiled lazily), unions of objects, positional items,
defaults, what already validates, copy on write, and the depth bound on
JSON text found inside arguments; then the functions of the common node
shapes one at a time.
"""

from __future__ import annotations

import copy
import enum
import json
import sys
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.schema_strategies import json_values

from agent_backend.errors import ToolArgumentError
from agent_backend.schema import Limits, compile_schema, prepare_arguments
from agent_backend.schema.coerce import (
    LEAVE_OUT,
    Coercer,
    array_fix,
    member_fix,
    null_left_out,
    object_fix,
    type_fix,
)
from agent_backend.schema.coerce_rules import FAIL, json_equal, member_test


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


# -- one node at a time ---------------------------------------------------------------------


class Recorder:
    """A child node that records its calls and answers ``answer(value)``."""

    def __init__(self, answer: Callable[[Any], Any]) -> None:
        self.calls: list[tuple[Any, int, bool]] = []
        self.answer = answer

    def __call__(self, value: Any, depth: int, check: bool) -> Any:
        self.calls.append((value, depth, check))
        return self.answer(value)


def never(_: Any) -> bool:
    return False


def no_generic(value: Any, depth: int, check: bool) -> Any:
    return ("generic", value, depth, check)


def parse_json(text: str, opener: str, wanted: type, depth: int) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return FAIL
    return value if text.startswith(opener) and isinstance(value, wanted) else FAIL


def test_an_object_node_descends_copies_on_write_and_leaves_out() -> None:
    doubled = Recorder(lambda v: v * 2)
    gone = Recorder(lambda v: LEAVE_OUT)
    same_child = Recorder(lambda v: v)
    asked: list[Any] = []
    node: dict[str, Any] = {"type": "object"}

    def accepts_of(of: Any) -> Callable[[Any], bool]:
        asked.append(of)
        return never

    fix = object_fix(
        node, {"a": doubled, "b": gone, "c": same_child}, parse_json, no_generic, accepts_of, True
    )
    value = {"a": 2, "b": 1, "c": [1], "d": "x"}
    out = fix(value, 3, True)
    assert out == {"a": 4, "c": [1], "d": "x"}
    assert out is not value
    assert value == {"a": 2, "b": 1, "c": [1], "d": "x"}
    assert out["c"] is value["c"]
    assert doubled.calls == [(2, 4, True)]
    unchanged = {"c": [2], "d": 1}
    assert fix(unchanged, 1, True) is unchanged
    assert fix('{"a": 5}', 1, True) == {"a": 10}  # parsed text is not checked, only descended
    assert fix("{not json", 1, True) == "{not json"
    assert fix(7, 2, False) == ("generic", 7, 2, False)
    assert asked == [node]  # asked once, on the first check


def test_an_array_node_wraps_text_that_is_no_array_and_descends_items() -> None:
    plus = Recorder(lambda v: v + 1 if type(v) is int else v)
    fix = array_fix({"type": "array"}, plus, parse_json, no_generic, lambda node: never, False)
    assert fix([1, "a", 2], 1, True) == [2, "a", 3]
    assert plus.calls[0] == (1, 2, False)
    texts = ["x", "y"]
    assert fix(texts, 1, True) is texts
    assert fix("[1, 2]", 1, True) == [2, 3]
    assert fix("lone", 1, True) == ["lone"]
    assert fix({"k": 1}, 5, True) == ("generic", {"k": 1}, 5, True)


def test_a_checked_container_the_node_accepts_is_kept_and_verdicts_are_truthiness() -> None:
    child = Recorder(lambda v: "changed")
    for verdict, kept_it in ((1, True), ([], False), ("yes", True), (0, False)):
        fix = object_fix(
            {}, {"a": child}, None, no_generic, lambda node, v=verdict: lambda _: v, False
        )
        value = {"a": 1}
        assert (fix(value, 1, True) is value) == kept_it
        array = array_fix({}, child, None, no_generic, lambda node, v=verdict: lambda _: v, False)
        items = [1]
        assert (array(items, 1, True) is items) == kept_it


def test_errors_of_validators_children_and_parsers_propagate() -> None:
    def broken(_: Any) -> bool:
        raise ValueError("validator broke")

    def bad_child(value: Any, depth: int, check: bool) -> Any:
        raise KeyError("child broke")

    def bad_parse(text: str, opener: str, wanted: type, depth: int) -> Any:
        raise RuntimeError("parse broke")

    fix = object_fix({}, {"a": bad_child}, bad_parse, no_generic, lambda node: broken, False)
    with pytest.raises(ValueError, match="validator broke"):
        fix({"a": 1}, 1, True)
    with pytest.raises(KeyError, match="child broke"):
        fix({"a": 1}, 1, False)
    with pytest.raises(RuntimeError, match="parse broke"):
        fix("{}", 1, True)
    array = array_fix({}, bad_child, bad_parse, no_generic, lambda node: broken, False)
    with pytest.raises(KeyError, match="child broke"):
        array([1], 1, False)
    with pytest.raises(RuntimeError, match="parse broke"):
        array("[]", 1, False)


def test_scalar_nodes_convert_strings_and_hand_other_values_to_convert() -> None:
    seen: list[Any] = []

    def convert(value: Any, depth: int) -> Any:
        seen.append((value, depth))
        return "converted"

    integer = type_fix(("integer",), convert)
    boolean = type_fix(("boolean",), convert)
    both = type_fix(("boolean", "null"), convert)
    assert integer(" 42 ", 1, True) == 42
    assert type(integer("42", 1, True)) is int
    assert integer("4.0", 1, True) == 4
    assert integer("4.5", 1, True) == "4.5"
    assert integer(True, 3, True) == "converted"
    assert seen == [(True, 3)]
    assert boolean(" false ", 1, True) is False
    assert boolean("no", 1, True) == "no"
    assert both("null", 1, True) is None
    assert both("true", 1, True) is True
    assert boolean(1.5, 2, True) == "converted"


def test_a_container_type_parses_text_wraps_a_lone_value_and_keeps_its_own_type() -> None:
    repair = Coercer({}, is_valid=never_valid, max_depth=8)
    seen: list[Any] = []

    def node(types: tuple[str, ...]) -> Any:
        step = repair._types_step(types)
        assert step is not None

        def convert(value: Any, depth: int) -> Any:  # the real step; other values recorded
            if isinstance(value, str):
                return step(value, depth)
            seen.append((value, depth))
            return "converted"

        return type_fix(types, convert)

    array, nullable_object = node(("array",)), node(("object", "null"))
    given = ["kept"]
    assert array(given, 1, True) is given
    assert array(' ["a", 1] ', 1, True) == ["a", 1]
    assert array("fries", 1, True) == ["fries"]
    assert array('{"a": 1}', 1, True) == ['{"a": 1}']
    assert nullable_object('{"a": 1}', 1, True) == {"a": 1}
    assert nullable_object("null", 1, True) is None
    assert nullable_object("[1]", 1, True) == "[1]"
    assert array(5, 2, False) == "converted"
    assert nullable_object(True, 3, True) == "converted"
    assert seen == [(5, 2), (True, 3)]


def test_an_enum_converts_strings_to_members_only_and_keeps_everything_else() -> None:
    def members_of(members: list[Any]) -> Any:
        step = Coercer({"enum": members}, is_valid=never_valid, max_depth=8)._members_step(members)
        assert step is not None
        return member_fix(step)

    numbers = members_of([1, 2.5, "x", True, None])
    containers = members_of([[1], {"a": 1}])
    assert numbers(" 1 ", 1, True) == 1
    assert type(numbers("1", 1, True)) is int
    assert numbers("1.0", 1, True) == 1
    assert numbers("2.5", 1, True) == 2.5
    assert numbers("3", 1, True) == "3"  # converts, but to no member
    assert numbers("true", 1, True) is True
    assert numbers("false", 1, True) == "false"
    assert numbers("null", 1, True) is None
    assert numbers("x", 1, True) == "x"
    assert numbers("nan", 1, True) == "nan"
    for value in (7, 2.5, False, None, [1], {"a": 1}, float("nan")):
        assert numbers(value, 1, True) is value
    assert members_of([True])("1", 1, True) == "1"  # 1 is no boolean
    assert members_of([1])("true", 1, True) == "true"
    assert containers("[1]", 1, True) == [1]
    assert containers('{"a": 1}', 1, True) == {"a": 1}


def test_null_leaves_an_optional_property_out_and_other_values_go_to_its_fix() -> None:
    inner = Recorder(lambda v: ("fixed", v))
    fix = null_left_out(inner)
    assert fix(None, 1, True) is LEAVE_OUT
    assert fix("3", 2, False) == ("fixed", "3")
    assert fix(0, 4, True) == ("fixed", 0)
    assert inner.calls == [("3", 2, False), (0, 4, True)]
    out = object_fix({}, {"a": fix}, None, no_generic, lambda node: never, False)(
        {"a": None, "b": 1}, 1, False
    )
    assert out == {"b": 1}


def test_a_schema_and_value_deeper_than_the_recursion_limit_raise_recursion_error() -> None:
    """Values reach repair bounded in depth (``Limits.max_depth``); called directly on a deeper
    one, the nodes stop at Python's recursion limit (an error, never a crash)."""
    levels = sys.getrecursionlimit() * 4
    schema: dict[str, Any] = {"type": "integer"}
    value: Any = "1"
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
        value = {"x": value}
    with pytest.raises(RecursionError):
        Coercer(schema, is_valid=never_valid, max_depth=levels).coerce(value, known_invalid=True)
    items: Any = "1"
    array: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        array = {"type": "array", "items": array}
        items = [items]
    with pytest.raises(RecursionError):
        Coercer(array, is_valid=never_valid, max_depth=levels).coerce(items, known_invalid=True)
