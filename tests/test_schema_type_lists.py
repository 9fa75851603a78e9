"""A type list beside other keywords is repaired as the ``anyOf`` it means (issue 16, item 1).

``{"type": [A, B], **kw}`` accepts exactly what ``{"anyOf": [{"type": A, **kw},
{"type": B, **kw}]}`` accepts, so repair must treat both alike: each listed type is tried
against every sibling keyword. Before, a string was kept because ``string`` was listed,
although it failed the ``pattern`` beside it and the integer it spells was valid.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.realworld import strict_equal

from agent_backend.errors import ToolArgumentError
from agent_backend.schema import prepare_arguments

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")

# Strings that look like another type: what models send for every kind of value.
LOOKALIKES = (
    "42",
    "false",
    "true",
    "null",
    "[1]",
    '["a", "2"]',
    "[",
    "4.0",
    "007",
    "1e3",
    " 7 ",
    "-3",
    "0.5",
    "abc",
    "",
    "{}",
    '{"k": "1"}',
    '{"k": 1, "j": true}',
    "[]",
)

SCALAR_VALUES = (
    st.none() | st.booleans() | st.integers(-20, 120) | st.sampled_from([0.5, 4.0, -2.0, 1e3])
)

VALUES = st.recursive(
    st.sampled_from(LOOKALIKES) | SCALAR_VALUES | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["k", "j", "x"]), children, max_size=3)
    ),
    max_leaves=6,
)

CHILD_SCHEMAS = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "string"},
        {"type": "boolean"},
        {"type": ["integer", "null"]},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "integer", "minimum": 0},
        {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    ]
)

# The keywords of each type, drawn as siblings of the type list.
KEYWORDS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "string": {
        "pattern": st.sampled_from(["^[a-z]+$", "^[0-9]+$", "^0", "e", "^\\[", "^$"]),
        "minLength": st.integers(0, 4),
        "maxLength": st.integers(0, 4),
    },
    "integer": {
        "minimum": st.integers(-5, 50),
        "maximum": st.integers(-5, 50),
        "multipleOf": st.sampled_from([2, 3, 7]),
        "exclusiveMinimum": st.integers(-5, 5),
    },
    "number": {
        "minimum": st.sampled_from([0, 0.5, 5]),
        "maximum": st.sampled_from([1, 4.5, 100]),
        "multipleOf": st.sampled_from([0.5, 2]),
    },
    "array": {
        "minItems": st.integers(0, 2),
        "maxItems": st.integers(0, 2),
        "items": CHILD_SCHEMAS,
        "uniqueItems": st.booleans(),
    },
    "object": {
        "required": st.lists(st.sampled_from(["k", "j"]), min_size=1, max_size=2, unique=True),
        "properties": st.dictionaries(st.sampled_from(["k", "j"]), CHILD_SCHEMAS, max_size=2),
        "additionalProperties": st.booleans() | CHILD_SCHEMAS,
        "minProperties": st.integers(0, 2),
    },
    "any": {
        "enum": st.lists(
            st.sampled_from([1, 42, "42", "abc", True, False, None, 4.0, 7, "007", [1], {}]),
            min_size=1,
            max_size=4,
            unique_by=lambda v: json.dumps(v),
        ),
        "const": st.sampled_from([42, "42", False, None, [1], 7]),
        "description": st.just("a documented field"),
    },
}


@st.composite
def type_lists(draw: st.DrawFn) -> tuple[list[str], dict[str, Any]]:
    """2-4 JSON types and sibling keywords drawn from those types' keywords."""
    types = draw(st.lists(st.sampled_from(TYPES), min_size=2, max_size=4, unique=True))
    pool: dict[str, st.SearchStrategy[Any]] = dict(KEYWORDS["any"])
    for name in types:
        pool.update(KEYWORDS.get(name, {}))
    if "number" in types and "integer" in types:  # both: draw the number bounds, sometimes
        pool.update(draw(st.sampled_from([KEYWORDS["integer"], KEYWORDS["number"]])))
    names = draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=3, unique=True))
    return types, {name: draw(pool[name]) for name in names}


def as_property(schema: dict[str, Any]) -> dict[str, Any]:
    """Where tools see a type list: a property of the arguments object."""
    return {"type": "object", "properties": {"x": schema}, "required": ["x"]}


def outcome(schema: dict[str, Any], arguments: Any) -> tuple[str, Any]:
    try:
        return "repaired", prepare_arguments(schema, arguments)
    except ToolArgumentError:
        return "refused", None


def same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] and strict_equal(a[1], b[1])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=type_lists(), value=VALUES)
@example(drawn=(["integer", "string"], {"pattern": "^[a-z]+$"}), value="42")
@example(drawn=(["string", "boolean"], {"maxLength": 3}), value="false")
@example(drawn=(["string", "integer"], {"minLength": 1}), value="007")
@example(drawn=(["integer", "null"], {"minimum": 0}), value=None)
@example(drawn=(["string", "null"], {"maxLength": 40}), value='{"k": 1}')
@example(drawn=(["array", "integer"], {"items": {"type": "integer"}}), value="5")
@example(drawn=(["number", "integer"], {"minimum": 0}), value="4.0")
@example(drawn=(["string", "integer"], {"enum": ["007", 7]}), value="7")
def test_a_type_list_repairs_as_its_any_of(
    drawn: tuple[list[str], dict[str, Any]], value: Any
) -> None:
    types, keywords = drawn
    listed = as_property({"type": types, **keywords})
    union = as_property({"anyOf": [{"type": name, **keywords} for name in types]})
    for arguments in ({"x": value}, json.dumps({"x": value})):
        got, expected = outcome(listed, arguments), outcome(union, arguments)
        assert same(got, expected), (listed, arguments, got, expected)


@pytest.mark.parametrize(
    ("schema", "sent", "becomes"),
    [
        # The issue's two cases: the string fails its sibling; the other type is valid.
        ({"type": ["integer", "string"], "pattern": "^[a-z]+$"}, "42", 42),
        ({"type": ["string", "boolean"], "maxLength": 3}, "false", False),
        ({"type": ["string", "null"], "pattern": "^[0-9]+$"}, "null", None),
        ({"type": ["string", "array"], "maxLength": 2, "items": {"type": "integer"}}, "[1]", [1]),
        # What validates stays as it is (PITFALLS 4).
        ({"type": ["string", "integer"], "pattern": "^[0-9]+$"}, "007", "007"),
        ({"type": ["integer", "null"], "minimum": 0}, None, None),
        ({"type": ["string", "null"], "maxLength": 40}, '{"a": 1}', '{"a": 1}'),
        ({"type": ["string", "integer"], "enum": ["1", 2]}, "1", "1"),
        ({"type": ["string", "integer"], "enum": ["1", 2]}, "2", 2),
        ({"type": ["string", "boolean"], "const": "false"}, "false", "false"),
        # Conversions before wrapping, in a type list as in an anyOf.
        ({"type": ["array", "integer"], "items": {"type": "integer"}}, "5", 5),
        ({"anyOf": [{"type": "array"}, {"type": "integer"}]}, "5", 5),
        ({"type": ["array", "boolean"], "items": {"type": "string"}}, "x", ["x"]),
        # Types are tried in the order listed (integer and number both read "4.0").
        ({"type": ["integer", "number"], "minimum": 0}, "4.0", 4),
        ({"type": ["number", "integer"], "minimum": 0}, "4.0", 4.0),
    ],
)
def test_type_list_cases(schema: dict[str, Any], sent: Any, becomes: Any) -> None:
    out = prepare_arguments(as_property(schema), {"x": sent})
    assert strict_equal(out, {"x": becomes})


@pytest.mark.parametrize(
    ("schema", "sent"),
    [
        ({"type": ["integer", "string"], "pattern": "^[a-z]+$", "maximum": 10}, "42"),
        ({"type": ["string", "boolean"], "maxLength": 3, "const": True}, "false"),
        ({"type": ["integer", "null"], "minimum": 0}, "-1"),
    ],
)
def test_type_list_refusals(schema: dict[str, Any], sent: Any) -> None:
    with pytest.raises(ToolArgumentError):
        prepare_arguments(as_property(schema), {"x": sent})


def test_the_callers_value_is_not_changed() -> None:
    schema = as_property({"type": ["object", "string"], "properties": {"k": {"type": "integer"}}})
    sent = {"x": {"k": "1"}}
    assert prepare_arguments(schema, sent) == {"x": {"k": 1}}
    assert sent == {"x": {"k": "1"}}
