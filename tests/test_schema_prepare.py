"""prepare_arguments: parse, keep what validates, repair only what fails, fail closed."""

from __future__ import annotations

import copy
import enum
import json
import pickle
import socket
from typing import Any

import pydantic
import pytest

from agent_backend.errors import SchemaError, SchemaRefError, ToolArgumentError
from agent_backend.schema import Limits, compile_schema, prepare_arguments

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
        "z": {"type": "null"},
        "o": {"type": "object", "properties": {"k": {"type": "integer"}}},
        "a": {"type": "array", "items": {"type": "integer"}},
        "s": {"type": "string"},
        "u": {"type": ["string", "integer"]},
        "nn": {"type": ["integer", "null"]},
        "sn": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "e": {"enum": [1, 2, 3]},
        "es": {"enum": ["1", "2"]},
        "c": {"const": True},
        "l": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": False,
}


def prep(arguments: Any, schema: dict[str, Any] = SCHEMA, **kw: Any) -> dict[str, Any]:
    return prepare_arguments(schema, arguments, **kw)


def fails(arguments: Any, schema: dict[str, Any] = SCHEMA) -> ToolArgumentError:
    with pytest.raises(ToolArgumentError) as info:
        prep(arguments, schema)
    return info.value


# -- each coercion rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"n": "5"}, {"n": 5}),
        ({"n": "-12"}, {"n": -12}),
        ({"n": " 7 "}, {"n": 7}),
        ({"n": "1.0"}, {"n": 1}),
        ({"n": "1e3"}, {"n": 1000}),
        ({"n": "123456789012345678901234567890"}, {"n": 123456789012345678901234567890}),
        ({"x": "1.5"}, {"x": 1.5}),
        ({"x": "3"}, {"x": 3}),
        ({"x": "-2.5e-3"}, {"x": -0.0025}),
        ({"b": "true"}, {"b": True}),
        ({"b": "false"}, {"b": False}),
        ({"b": "False"}, {"b": False}),
        ({"z": "null"}, {"z": None}),
        ({"o": '{"k": 3}'}, {"o": {"k": 3}}),
        ({"o": '{"k": "3"}'}, {"o": {"k": 3}}),
        ({"a": "[1, 2]"}, {"a": [1, 2]}),
        ({"a": '["1", "2"]'}, {"a": [1, 2]}),
        ({"a": 7}, {"a": [7]}),
        ({"a": "7"}, {"a": [7]}),
        ({"l": "x"}, {"l": ["x"]}),
        ({"e": "2"}, {"e": 2}),
        ({"c": "true"}, {"c": True}),
        ({"nn": "5"}, {"nn": 5}),
        ({"nn": "null"}, {"nn": None}),
    ],
)
def test_each_rule_repairs(given: dict[str, Any], expected: dict[str, Any]) -> None:
    out = prep(given)
    assert out == expected
    assert [type(v) for v in out.values()] == [type(v) for v in expected.values()]


@pytest.mark.parametrize(
    "kept",
    [
        {"u": "007"},  # "007" stays a string where a string is allowed
        {"nn": None},  # null stays null in a nullable union, never 0
        {"sn": '{"a": 1}'},  # a JSON-looking string stays a string for string | null
        {"sn": None},
        {"es": "1"},
        {"s": "true"},
        {"s": "123"},
        {"x": 3},
    ],
)
def test_valid_values_are_kept(kept: dict[str, Any]) -> None:
    assert prep(kept) == kept
    assert prep(json.dumps(kept)) == kept


@pytest.mark.parametrize(
    "bad",
    [
        {"n": "1.5"},  # lossy: never truncated
        {"n": "nan"},
        {"x": "inf"},
        {"x": "1e400"},
        {"x": "Infinity"},
        {"n": "0x10"},
        {"n": "12abc"},
        {"n": ""},
        {"e": "4"},
        {"b": "yes"},
        {"o": "{not json"},
        {"o": "[1]"},
        {"q": 1},
    ],
)
def test_unrepairable_values_fail_closed(bad: dict[str, Any]) -> None:
    err = fails(bad)
    assert err.issues
    assert len(err.to_model_message()) <= 2048


def test_branches_tried_in_declared_order_and_valid_branch_wins() -> None:
    schema = {
        "type": "object",
        "properties": {
            "v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "string"}]},
            "w": {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
        },
    }
    assert prep({"v": "true"}, schema) == {"v": "true"}  # already a valid string branch
    assert prep({"w": "[1, 2]"}, schema) == {"w": [1, 2]}
    assert prep({"w": "null"}, schema) == {"w": None}
    schema2 = {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
    }
    assert prep({"v": "true"}, schema2) == {"v": True}
    assert prep({"v": "12"}, schema2) == {"v": 12}


def test_type_list_prefers_conversion_over_wrapping() -> None:
    schema = {
        "type": "object",
        "properties": {"v": {"type": ["array", "integer"], "items": {"type": "integer"}}},
    }
    assert prep({"v": "5"}, schema) == {"v": 5}
    assert prep({"v": "[5]"}, schema) == {"v": [5]}


def test_nested_properties_patterns_additional_and_prefix_items() -> None:
    schema = {
        "type": "object",
        "properties": {
            "cfg": {
                "type": "object",
                "properties": {"depth": {"type": "integer"}},
                "patternProperties": {"^f_": {"type": "number"}},
                "additionalProperties": {"type": "boolean"},
            },
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                "items": {"type": "null"},
            },
        },
    }
    given = {"cfg": '{"depth": "3", "f_a": "1.5", "flag": "true"}', "pair": ["1", "false", "null"]}
    assert prep(given, schema) == {
        "cfg": {"depth": 3, "f_a": 1.5, "flag": True},
        "pair": [1, False, None],
    }


def test_draft7_tuple_items_and_additional_items() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "t": {
                "type": "array",
                "items": [{"type": "integer"}],
                "additionalItems": {"type": "boolean"},
            }
        },
    }
    assert prep({"t": ["1", "true", "false"]}, schema) == {"t": [1, True, False]}


def test_ref_defs_are_resolved_before_coercion() -> None:
    """A bare $ref property must not look typeless (models would send objects as strings)."""

    class Point(pydantic.BaseModel):
        x: int
        y: float

    class Shape(pydantic.BaseModel):
        origin: Point
        points: list[Point]
        label: str | None = None

    schema = Shape.model_json_schema()
    assert "$defs" in schema
    given = {"origin": '{"x": "1", "y": "2.5"}', "points": '[{"x": 3, "y": "4"}]', "label": None}
    out = prep(given, schema)
    assert out == {"origin": {"x": 1, "y": 2.5}, "points": [{"x": 3, "y": 4}], "label": None}
    Shape.model_validate(out)


def test_recursive_schema_coerces_at_every_level() -> None:
    class Node(pydantic.BaseModel):
        value: int
        children: list[Node] = []

    schema = Node.model_json_schema()
    given = {"value": "1", "children": [{"value": "2", "children": '[{"value": "3"}]'}]}
    out = prep(given, schema)
    assert out == {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}


def test_allof_branches_all_apply() -> None:
    schema = {
        "type": "object",
        "allOf": [
            {"properties": {"a": {"type": "integer"}}},
            {"properties": {"b": {"type": "boolean"}}},
        ],
    }
    assert prep({"a": "1", "b": "true"}, schema) == {"a": 1, "b": True}


# -- never mutate, idempotent, defaults only on request ------------------------------------


def test_caller_input_is_never_mutated_nor_shared() -> None:
    given = {"o": {"k": "3"}, "a": ["1"], "n": "2"}
    before = copy.deepcopy(given)
    out = prep(given)
    assert given == before
    assert out["o"] is not given["o"]
    assert out["a"] is not given["a"]
    valid = {"o": {"k": 1}}
    out2 = prep(valid)
    assert out2 == valid
    assert out2 is not valid
    assert out2["o"] is not valid["o"]


def test_prepare_is_idempotent() -> None:
    once = prep({"n": "5", "o": '{"k": "1"}', "a": "3"})
    assert prep(once) == once


def test_defaults_only_when_asked() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "default": 3}}}
    assert prep({}, schema) == {}
    assert prep({}, schema, inject_defaults=True) == {"n": 3}
    assert prep({"n": 1}, schema, inject_defaults=True) == {"n": 1}


# -- fail closed on the text ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ('{"n": 1', "not valid JSON"),
        ('{"n":1}{"n":1}', "more than one JSON value"),  # a stream concatenated twice
        ('{"n":1} trailing', "more than one JSON value"),
        ("[1, 2]", "must be a JSON object"),
        ('"str"', "must be a JSON object"),
        ("null", "must be a JSON object"),
        ('{"x": NaN}', "not valid JSON"),
        ('{"x": Infinity}', "not valid JSON"),
        ('{"x": 1e400}', "infinity"),  # orjson refuses, the standard library reads inf
        ('{"x": -1e400}', "infinity"),
        ('{"x": "\\ud800"}', "surrogate"),  # not Unicode text
        ('{"\\udc00": 1}', "surrogate"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_bad_text_fails_closed(text: str | bytes, needle: str) -> None:
    err = fails(text)
    assert needle in err.message
    assert needle in err.to_model_message()


def test_size_and_depth_bounds() -> None:
    schema: dict[str, Any] = {"type": "object"}
    limits = Limits(max_bytes=100, max_depth=5)
    compiled = compile_schema(schema, limits=limits)
    with pytest.raises(ToolArgumentError, match="larger than 100 bytes"):
        compiled.prepare('{"a": "' + "x" * 200 + '"}')
    with pytest.raises(ToolArgumentError, match="larger than 100 bytes"):
        compiled.prepare({"a": "x" * 200})
    deep = {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}
    with pytest.raises(ToolArgumentError, match="deeper than 5"):
        compiled.prepare(json.dumps(deep))
    with pytest.raises(ToolArgumentError, match="deeper than 5"):
        compiled.prepare(deep)
    very_deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ToolArgumentError):
        prepare_arguments(schema, '{"a": ' + very_deep + "}")


def test_python_values_that_are_not_json_are_refused() -> None:
    with pytest.raises(ToolArgumentError, match="NaN"):
        prep({"x": float("nan")})
    with pytest.raises(ToolArgumentError, match="set is not a JSON value") as info:
        prep({"o": {"k": {1, 2}}})
    assert info.value.issues[0].pointer == "/o/k"
    with pytest.raises(ToolArgumentError, match="keys must be strings"):
        prep({1: 2})
    with pytest.raises(ToolArgumentError, match="JSON object"):
        prep(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "pointer"),
    [
        ({"n": 1, "s": "a\ud800"}, "/s"),
        ({"n": 1, "o": {"\udfff": 1}}, "/o/\udfff"),
        ({"n": "x", "l": ["ok", "\ud83d"]}, "/l/1"),  # refused before any repair or validation
    ],
)
def test_lone_surrogates_are_refused_with_their_pointer(
    arguments: dict[str, Any], pointer: str
) -> None:
    """Not Unicode text: no UTF-8 form, so no tool could be sent it (and validators choke on it)."""
    with pytest.raises(ToolArgumentError, match="lone surrogate") as info:
        prep(arguments)
    assert info.value.issues[0].pointer == pointer


def test_python_subclasses_become_plain_json() -> None:
    class Color(enum.IntEnum):
        RED = 1

    out = prep({"n": Color.RED, "a": (1, 2), "x": 2**70})
    assert out == {"n": 1, "a": [1, 2], "x": 2**70}
    assert type(out["n"]) is int
    assert type(out["a"]) is list


# -- errors the model can act on -----------------------------------------------------------


def test_error_message_is_bounded_and_does_not_repeat_input() -> None:
    """10 KB of arguments must not become 200 KB of feedback."""
    schema = {
        "type": "object",
        "properties": {
            f"p{i}": {"anyOf": [{"type": "integer"}, {"type": "null"}]} for i in range(200)
        },
    }
    big = {f"p{i}": "x" * 300 for i in range(200)}
    err = fails(big, schema)
    message = err.to_model_message()
    assert len(message) <= 2048
    assert "more" in message
    assert "x" * 100 not in message


def test_error_issues_carry_pointer_expected_got_and_pickle() -> None:
    err = fails({"o": {"k": "abc"}})
    issue = err.issues[0]
    assert issue.pointer == "/o/k"
    assert issue.expected == "integer"
    assert '"abc"' in issue.got
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ToolArgumentError
    assert clone.issues == err.issues
    assert clone.message == err.message
    assert clone.to_model_message() == err.to_model_message()


def test_tool_name_in_message() -> None:
    compiled = compile_schema(SCHEMA)
    with pytest.raises(ToolArgumentError) as info:
        compiled.prepare({"n": "x"}, tool="calc")
    assert info.value.tool == "calc"
    assert "'calc'" in info.value.to_model_message()


# -- schemas -------------------------------------------------------------------------------


def test_compiled_once_and_reused() -> None:
    """A schema is compiled on first use and reused, never per call (milliseconds each)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    from agent_backend.schema import prepare as prepare_module

    prepare_arguments(schema, {"n": 1})
    entry = prepare_module._cache[id(schema)][1]
    prepare_arguments(schema, {"n": "2"})
    assert prepare_module._cache[id(schema)][1] is entry


def test_malformed_schema_fails_with_pointer() -> None:
    with pytest.raises(SchemaError) as info:
        compile_schema({"type": "object", "properties": {"a": {"type": "dict"}}}, source="t.json")
    assert info.value.pointer == "/properties/a/type"
    assert "t.json" in str(info.value)


def test_external_ref_is_refused_without_any_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Never fetch a remote $ref: in a daemon that is an SSRF hole."""

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("network used")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    schema = {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/x.json"}}}
    with pytest.raises(SchemaRefError) as info:
        compile_schema(schema)
    assert info.value.ref == "http://127.0.0.1:9/x.json"
    assert info.value.pointer == "/properties/a"


def test_ref_only_cycle_is_a_schema_error_not_recursion_error() -> None:
    """A -> B -> A raises a typed error, not RecursionError."""
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}},
        "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}},
    }
    with pytest.raises(SchemaRefError):
        compile_schema(schema)


def test_depth_bound_holds_for_long_text_and_brackets_in_strings() -> None:
    schema: dict[str, Any] = {"type": "object"}
    nested: Any = 1
    for _ in range(64):  # the arguments object itself is level 1: this is 65 levels
        nested = [nested]
    with pytest.raises(ToolArgumentError, match="deeper than 64"):
        prepare_arguments(schema, json.dumps({"a": nested, "pad": "x" * 200}))
    with pytest.raises(ToolArgumentError, match="deeper than 64"):
        prepare_arguments(schema, {"a": nested, "pad": "x" * 200})
    shallow = {"note": "[[[{{{" * 50, "pad": "y" * 200}
    assert prepare_arguments(schema, json.dumps(shallow)) == shallow
    assert prepare_arguments(schema, shallow) == shallow


@pytest.mark.parametrize(
    "number", [123456789012345678901234567890, -9223372036854775809, 2**64, 2**63]
)
def test_integers_beyond_64_bits_stay_exact(number: int) -> None:
    """orjson reads these as floats; the result must still be the exact integer."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}}
    for key in ("n", "x"):
        for arguments in (f'{{"{key}": {number}}}', {key: number}):
            out = prepare_arguments(schema, arguments)
            assert out == {key: number}
            assert type(out[key]) is int
        long_text = f'{{"{key}": {number}, "pad": "{"z" * 200}"}}'
        assert type(prepare_arguments(schema, long_text)[key]) is int
        assert prepare_arguments(schema, {key: str(number)}) == {key: number}


def test_a_repaired_call_keeps_integers_beyond_64_bits_exact_anywhere() -> None:
    """Text that needs repair and holds such an integer is read again exactly, where the
    schema types it and where it does not; a long digit run in a string changes nothing."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {}}}
    big = 123456789012345678901234567890
    out = prepare_arguments(schema, f'{{"n": "5", "x": {big}, "y": [{{"z": -{big}}}]}}')
    assert out == {"n": 5, "x": big, "y": [{"z": -big}]}
    assert type(out["x"]) is int
    assert type(out["y"][0]["z"]) is int
    out = prepare_arguments(schema, '{"n": "5", "x": "12345678901234567890", "y": 1.5e300}')
    assert out == {"n": 5, "x": "12345678901234567890", "y": 1.5e300}


# -- what only the validator can say -------------------------------------------------------

D7 = "http://json-schema.org/draft-07/schema#"
D2020 = "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        # A subschema in another draft: jsonschema-rs asserts its format (draft 7) ...
        (
            {"type": "object", "properties": {"email": {"$schema": D7, "format": "email"}}},
            {"email": "not-an-email"},
        ),
        # ... and applies the siblings of its $ref (2019-09 on), which draft 7 ignores.
        (
            {
                "$schema": D7,
                "properties": {
                    "a": {
                        "$id": "http://e/a",
                        "$schema": D2020,
                        "$defs": {"s": {"type": "string"}},
                        "properties": {"b": {"$ref": "#/$defs/s", "maxLength": 2}},
                    }
                },
            },
            {"a": {"b": "abcdef"}},
        ),
        # jsonschema-rs's is_valid refuses a value that has a property listed twice in
        # required (where no meta-schema check saw the duplicate).
        (
            {
                "type": "object",
                "allOf": [{"$ref": "#/x-shared/s"}],
                "x-shared": {"s": {"required": ["a", "a"]}},
            },
            {"a": 1},
        ),
    ],
)
def test_what_the_validator_refuses_is_never_returned_as_it_is(schema: Any, value: Any) -> None:
    """Found by review of an earlier fast check: each of these is invalid only by a rule
    that the resolved schema alone does not show."""
    compiled = compile_schema(schema)
    assert not compiled.is_valid(value)
    try:
        out = compiled.prepare(value)
    except ToolArgumentError:
        return
    assert compiled.is_valid(out)


def test_a_subschema_that_cannot_compile_alone_never_fails_a_call() -> None:
    """Found by review: a duplicate "required" behind a $ref from an unknown keyword passes
    the meta-schema check where it stands, and failed to compile as a subschema of its own
    when repair consulted it (SchemaError from prepare). jsonschema-rs's is_valid also
    refuses {"a": 1} for it while its iter_errors names nothing: "0 problems" before."""
    schema = {
        "type": "object",
        "properties": {"x": {"anyOf": [{"$ref": "#/x-shared/s"}, {"type": "integer"}]}},
        "x-shared": {"s": {"type": "object", "required": ["a", "a"]}},
    }
    compiled = compile_schema(schema)
    assert compiled.prepare({"x": "5"}) == {"x": 5}
    with pytest.raises(ToolArgumentError) as refused:
        compiled.prepare({"x": {"a": 1}})
    assert refused.value.issues
    assert "0 problems" not in str(refused.value)


ORDER = {
    "$defs": {
        "Address": {
            "properties": {
                "street": {"title": "Street", "type": "string"},
                "city": {"title": "City", "type": "string"},
                "zip_code": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            },
            "required": ["street", "city"],
            "title": "Address",
            "type": "object",
        },
        "Item": {
            "properties": {
                "sku": {"type": "string"},
                "quantity": {"type": "integer", "minimum": 1},
                "unit_price": {"type": "number", "exclusiveMinimum": 0},
            },
            "required": ["sku", "quantity", "unit_price"],
            "type": "object",
            "additionalProperties": False,
        },
    },
    "properties": {
        "order_id": {"type": "integer"},
        "paid": {"type": "boolean"},
        "status": {"enum": ["new", "paid", "shipped"]},
        "shipping": {"$ref": "#/$defs/Address"},
        "billing": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}], "default": None},
        "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "default": []},
    },
    "required": ["order_id", "paid", "shipping", "items"],
    "type": "object",
}
ORDER_ARGS = {
    "order_id": 1042,
    "paid": True,
    "status": "paid",
    "shipping": {"street": "1 Main St", "city": "Springfield", "zip_code": 12345},
    "billing": None,
    "items": [{"sku": "A-1", "quantity": 2, "unit_price": 9.5}],
    "tags": ["gift"],
}


def test_a_valid_nested_call_is_returned_as_a_copy_and_each_flaw_is_refused() -> None:
    out = prepare_arguments(ORDER, ORDER_ARGS)
    assert out == ORDER_ARGS
    assert out is not ORDER_ARGS
    assert out["shipping"] is not ORDER_ARGS["shipping"]
    assert out["items"][0] is not ORDER_ARGS["items"][0]
    # Valid by JSON Schema's reading (a whole float is an integer): kept as it is.
    floaty = {**ORDER_ARGS, "order_id": 1042.0}
    assert prepare_arguments(ORDER, floaty) == floaty
    flaws = {
        "paid": 1,
        "status": "lost",
        "shipping": {"street": "1 Main St"},
        "billing": {"street": 3, "city": "x"},
        "items": [],
        "tags": ["a very long tag"],
    }
    for key, bad in flaws.items():
        with pytest.raises(ToolArgumentError):
            prepare_arguments(ORDER, {**ORDER_ARGS, key: bad})
