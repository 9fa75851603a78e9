"""The fast path's quick check (quick.py, _quick.c) is never looser than the validator.

The quick check answers "surely valid" or "not sure" (then jsonschema-rs decides). These
tests hold it to that: on the BFCL schemas with their ground-truth calls and corrupted
forms of them, on the JSON Schema test suite, and on generated schemas and values. For
schemas and values inside its subset (no floats, integer bounds, scalar enums) it must
agree with the validator exactly, so it is not a check that only ever says "not sure".
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
from typing import Any

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import jsts_suite
from support.realworld import bfcl_cases, corrupt, realworld_missing_reason
from support.schema_strategies import fuzz_arguments, fuzz_schemas, make_arguments, make_schema

from agent_backend.errors import SchemaError, ToolArgumentError
from agent_backend.schema import compile_schema, prepare_arguments
from agent_backend.schema.plain import ACCELERATED, QuickNode, QuickValid, plain_copy
from agent_backend.schema.quick import MAX_DEPTH, MAX_NODES, quick_valid
from agent_backend.schema.refs import resolve_schema

pytestmark = [
    pytest.mark.skipif(not ACCELERATED, reason="the C accelerator is not built"),
    pytest.mark.timeout(300),
]

UNSURE = "unsure"


def _fallback(value: Any) -> str:
    return UNSURE


def quick_of(schema: Any) -> Any:
    """The schema's quick check with a fallback that says UNSURE: True means surely valid."""
    resolution = resolve_schema(schema)
    return quick_valid(schema, resolution.schema, resolution.dialect, _fallback)


def sure(schema: Any, value: Any) -> bool:
    return quick_of(schema)(value) is True


def rs_valid(schema: Any, value: Any) -> bool:
    return bool(jsonschema_rs.validator_for(schema).is_valid(value))


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


def test_a_pydantic_style_schema_is_checked_quickly_and_each_flaw_is_left_to_the_validator() -> (
    None
):
    assert sure(ORDER, ORDER_ARGS)
    flaws = {
        "order_id": "1042",
        "paid": 1,
        "status": "lost",
        "shipping": {"street": "1 Main St"},
        "billing": {"street": 3, "city": "x"},
        "items": [],
        "tags": ["a very long tag"],
    }
    for key, bad in flaws.items():
        value = {**ORDER_ARGS, key: bad}
        assert not sure(ORDER, value), key
        assert not rs_valid(ORDER, value), key
    extra_item = {**ORDER_ARGS, "items": [{"sku": "A", "quantity": 1, "unit_price": 1, "x": 0}]}
    assert not sure(ORDER, extra_item)
    assert not sure(ORDER, {k: v for k, v in ORDER_ARGS.items() if k != "items"})


@pytest.mark.parametrize(
    ("schema", "value", "quick", "valid"),
    [
        # A whole float is an integer to JSON Schema: left to the validator.
        ({"type": "integer"}, 1.0, False, True),
        ({"type": "integer"}, True, False, False),
        ({"type": "number"}, 3, True, True),
        ({"type": "number"}, False, False, False),
        ({"type": ["string", "null"]}, None, True, True),
        # Floats in an enum are compared by the validator (1 == 1.0 in JSON).
        ({"enum": [1.0]}, 1, False, True),
        ({"enum": [1]}, 1.0, False, True),
        ({"enum": [1]}, True, False, False),
        ({"enum": ["a", 1, True, None]}, None, True, True),
        ({"enum": [{"a": 1}]}, {"a": 1}, False, True),
        ({"const": "x", "enum": ["x", "y"]}, "y", False, False),
        ({"const": "x", "enum": ["x", "y"]}, "x", True, True),
        # Numbers beyond 2**53 against a float bound, and integer bounds beyond it.
        ({"exclusiveMinimum": 2.0**53}, 2**53 + 1, False, True),
        ({"maximum": 2.0**53}, 2**53 + 1, False, False),
        ({"maximum": 2**60}, 5, False, True),
        ({"minimum": 1.5}, 2, True, True),
        ({"exclusiveMaximum": 2}, 2, False, False),
        # Keywords apply to their own types only.
        ({"minimum": 5, "minLength": 3, "minItems": 1, "required": ["a"]}, "abc", True, True),
        ({"minimum": 5}, "x", True, True),
        ({"maxLength": 1}, "\U0001f600", True, True),
        ({"maxLength": 1}, "ab", False, False),
        ({"additionalProperties": False, "properties": {"a": {}}}, {"a": 1, "b": 2}, False, False),
        ({"additionalProperties": {"type": "integer"}}, {"a": 1, "b": 2}, True, True),
        ({"additionalProperties": {"type": "integer"}}, {"a": "1"}, False, False),
        ({"required": ["b"], "properties": {"a": {}}}, {"a": 1}, False, False),
        ({"maxProperties": 1}, {"a": 1, "b": 2}, False, False),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 3, True, True),
        ({"anyOf": [{"type": "integer"}, {"pattern": "^a"}]}, "abc", False, True),
        # Keywords outside the subset leave their node to the validator.
        ({"pattern": "^a"}, "abc", False, True),
        ({"oneOf": [{"type": "integer"}]}, 1, False, True),
        ({"not": {"type": "string"}}, 1, False, True),
        ({"uniqueItems": True}, [1, 2], False, True),
        ({"properties": {"a": {"multipleOf": 2}}}, {"a": 4}, False, True),
        ({"properties": {"a": {"multipleOf": 2}}}, {"b": 3}, True, True),  # not reached
        # format asserts before 2019-09 (jsonschema-rs), and is an annotation from then on.
        ({"format": "email"}, "x", True, True),
        (
            {"$schema": "http://json-schema.org/draft-07/schema#", "format": "email"},
            "x",
            False,
            False,
        ),
        (
            {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "minimum": 1,
                "exclusiveMinimum": True,
            },
            1,
            False,
            False,
        ),
        # Annotations and keywords no draft defines are ignored, as the validator does.
        ({"title": "t", "x-order": 1, "nullable": True, "type": "string"}, "s", True, True),
        (True, 1, False, True),
        (False, 1, False, False),
    ],
)
def test_what_the_quick_check_decides_and_what_it_leaves(
    schema: Any, value: Any, quick: bool, valid: bool
) -> None:
    assert rs_valid(schema, value) is valid
    assert sure(schema, value) is quick


def test_a_recursive_ref_is_left_to_the_validator_below_its_first_use() -> None:
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name"],
    }
    assert sure(tree, {"name": "root"})
    assert sure(tree, {"name": "root", "children": []})
    assert not sure(tree, {"name": "root", "children": [{"name": "leaf"}]})
    assert rs_valid(tree, {"name": "root", "children": [{"name": "leaf"}]})


def test_deep_and_large_schemas_are_bounded() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    value: Any = 1
    for _ in range(MAX_DEPTH + 5):
        deep = {"type": "object", "properties": {"x": deep}}
        value = {"x": value}
    assert not sure(deep, value)
    assert sure(deep, {})  # the levels it reads are checked
    wide = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_NODES)},
    }
    assert quick_of(wide) is _fallback  # too many nodes: no quick check at all
    assert sure(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}},
        {"p1": 1},
    )


def test_an_unknown_meta_schema_gets_no_quick_check() -> None:
    schema = {"$schema": "https://example.com/my-dialect", "type": "object"}
    try:
        compiled = compile_schema(schema)
    except SchemaError:
        return
    assert quick_of(schema) is _fallback
    assert compiled.prepare({"a": 1}) == {"a": 1}


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
def test_what_only_the_validator_can_say_is_left_to_it(schema: Any, value: Any) -> None:
    """Found by review: each was "surely valid" to the quick check, invalid to jsonschema-rs."""
    assert not rs_valid(schema, value)
    assert not sure(schema, value)
    compiled = compile_schema(schema)
    try:
        out = compiled.prepare(value)
    except ToolArgumentError:
        return
    assert compiled.is_valid(out)


_HASH_EMPTIES_THE_DICT = """
from agent_backend.schema.quick import quick_valid
from agent_backend.schema.refs import resolve_schema

schema = {
    "properties": {"a": {}},
    "additionalProperties": {"type": "array", "items": {"type": "array"}},
}
resolution = resolve_schema(schema)
check = quick_valid(schema, resolution.schema, resolution.dialect, lambda value: "unsure")
armed = []

class Key(str):
    __slots__ = ()

    def __hash__(self):
        if armed:
            armed.pop().clear()
        return str.__hash__(self)

    def __eq__(self, other):
        return str.__eq__(self, other)

for _ in range(200):
    value = {"a": 1, Key("zz"): [[i, i + 1] for i in range(50)]}
    armed.append(value)
    assert check(value) in (True, "unsure")
    junk = [[object()] * 7 for _ in range(100)]
print("ok")
"""


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


def test_keys_whose_hash_changes_the_dict_are_read_safely() -> None:
    """Called directly (the fast path passes its plain copy only), a str subclass whose
    __hash__ empties the dict being checked must not make the check read freed items.
    CPython's debug allocator fills freed memory, so such a read crashes at once."""
    done = subprocess.run(
        [sys.executable, "-c", _HASH_EMPTIES_THE_DICT],
        env={**os.environ, "PYTHONMALLOC": "debug"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-2000:]


def test_nodes_nest_at_most_256_levels() -> None:
    node = quick_of({"type": "array"}).root  # one level
    for _ in range(255):  # up to 256 levels
        node = _wrap_items(node)
    with pytest.raises(ValueError, match="nested too deeply"):
        _wrap_items(node)


def _wrap_items(node: Any) -> Any:
    """A node whose items are ``node`` (the constructor's fields, as quick.py passes them)."""
    assert QuickNode is not None
    return QuickNode(
        False,
        127,
        (),
        (),
        b"",
        (),
        frozenset(),
        None,
        node,
        False,
        frozenset(),
        frozenset(),
        0,
        None,
        None,
        None,
        None,
        0,
        -1,
        0,
        -1,
        0,
        -1,
        None,
        None,
    )


def test_prepare_answers_as_before_and_returns_a_copy() -> None:
    out = prepare_arguments(ORDER, ORDER_ARGS)
    assert out == ORDER_ARGS
    assert out is not ORDER_ARGS
    assert out["shipping"] is not ORDER_ARGS["shipping"]
    assert out["items"][0] is not ORDER_ARGS["items"][0]
    # Valid only by the validator (a whole float as an integer): still valid, unchanged.
    floaty = {**ORDER_ARGS, "order_id": 1042.0}
    assert prepare_arguments(ORDER, floaty) == floaty


def test_the_check_keeps_reference_counts_and_objects() -> None:
    check = quick_of(ORDER)
    value = plain_copy(ORDER_ARGS, 64, 1_000_000)
    bad = {**ORDER_ARGS, "items": [{"sku": 1}]}
    for _ in range(10):
        check(value), check(bad)
    gc.collect()
    counts = (sys.getrefcount(value), sys.getrefcount(bad), sys.getrefcount(True))
    objects = len(gc.get_objects())
    for _ in range(2_000):
        assert check(value) is True
        assert check(bad) == UNSURE
    gc.collect()
    assert (sys.getrefcount(value), sys.getrefcount(bad)) == counts[:2]
    assert abs(len(gc.get_objects()) - objects) < 10


def test_the_c_types_refuse_fields_of_the_wrong_shape() -> None:
    assert QuickNode is not None
    assert QuickValid is not None
    with pytest.raises(TypeError):
        QuickNode(1, 2)
    with pytest.raises(TypeError):
        QuickValid(object(), _fallback)  # type: ignore[arg-type]
    root = quick_of(ORDER).root
    with pytest.raises(TypeError):
        QuickValid(root, 3)  # type: ignore[arg-type]
    assert root.accepts(ORDER_ARGS) is True


# -- never looser than the validator ------------------------------------------------------------


def _never_looser(schema: Any, values: list[Any]) -> tuple[int, int]:
    """(values surely accepted, values the validator accepts); fails on any looser answer."""
    try:
        compiled = compile_schema(schema)
    except SchemaError:
        return 0, 0
    check = quick_of(schema)
    quick = valid = 0
    for given_value in values:
        wrapped = plain_copy({"v": given_value}, 64, 1_000_000)
        if wrapped is None:
            continue  # not plain JSON: the fast path never checks it
        value = wrapped["v"]
        accepted = compiled.is_valid(value)
        if check(value) is True:
            assert accepted, (schema, value)
            quick += 1
        valid += accepted
    return quick, valid


@pytest.mark.skipif(
    realworld_missing_reason() is not None and not jsts_suite.must_fail_when_missing(),
    reason=str(realworld_missing_reason()),
)
def test_never_looser_on_bfcl_calls_and_their_corrupted_forms() -> None:
    rng = random.Random(7)
    quick = valid = 0
    for case in bfcl_cases():
        properties = case.schema.get("properties") or {}
        values = [case.arguments]
        for _ in range(3):
            values.append(
                {k: corrupt(v, properties.get(k), rng, 0.5) for k, v in case.arguments.items()}
            )
        q, v = _never_looser(case.schema, values)
        quick, valid = quick + q, valid + v
    assert valid > 1000
    # Most valid BFCL calls take the quick path (what the fast path's figure rests on).
    assert quick >= 0.9 * valid, (quick, valid)


@pytest.mark.skipif(
    jsts_suite.missing_suite_reason() is not None and not jsts_suite.must_fail_when_missing(),
    reason=str(jsts_suite.missing_suite_reason()),
)
def test_never_looser_on_the_json_schema_test_suite() -> None:
    checked = quick_total = 0
    for case in jsts_suite.load_cases():
        try:
            resolution = resolve_schema(case.schema)
        except SchemaError:
            continue
        if resolution.external_refs:
            continue
        check = quick_valid(case.schema, resolution.schema, resolution.dialect, _fallback)
        for test in case.tests:
            checked += 1
            if check(test["data"]) is True:
                quick_total += 1
                assert test["valid"], (case.name, test["description"])
    assert checked > 300
    assert quick_total > 50


_NAMES = st.sampled_from(["a", "b", "c"])
_SUBSET_SCALARS = (
    st.none() | st.booleans() | st.integers(-6, 6) | st.sampled_from(["", "a", "ab", "abc"])
)


def _subset_node(child: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Schemas inside the quick check's subset, with integer bounds and scalar enums."""
    types = st.sampled_from(["null", "boolean", "integer", "number", "string", "array", "object"])
    pool: dict[str, st.SearchStrategy[Any]] = {
        "type": types | st.lists(types, min_size=1, max_size=3, unique=True),
        "properties": st.dictionaries(_NAMES, child, max_size=3),
        "required": st.lists(_NAMES, max_size=2, unique=True),
        "additionalProperties": child,
        "items": child,
        "enum": st.lists(_SUBSET_SCALARS, min_size=1, max_size=4),
        "const": _SUBSET_SCALARS,
        "minimum": st.integers(-3, 3),
        "maximum": st.integers(-3, 3),
        "exclusiveMinimum": st.integers(-3, 3),
        "exclusiveMaximum": st.integers(-3, 3),
        "minLength": st.integers(0, 3),
        "maxLength": st.integers(0, 3),
        "minItems": st.integers(0, 2),
        "maxItems": st.integers(0, 2),
        "minProperties": st.integers(0, 2),
        "maxProperties": st.integers(0, 2),
        "anyOf": st.lists(child, min_size=1, max_size=3),
        "allOf": st.lists(child, min_size=1, max_size=3),
        "title": st.just("annotation"),
    }
    return st.booleans() | st.lists(st.sampled_from(sorted(pool)), max_size=4, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({key: pool[key] for key in keys})
    )


_SUBSET_SCHEMAS = st.recursive(
    st.just({}) | st.sampled_from([{"type": "integer"}, {"type": "string"}]),
    _subset_node,
    max_leaves=10,
)
_SUBSET_VALUES = st.recursive(
    _SUBSET_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_NAMES, children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(schema=_SUBSET_SCHEMAS, values=st.lists(_SUBSET_VALUES, min_size=1, max_size=6))
def test_inside_its_subset_the_quick_check_agrees_with_the_validator(
    schema: Any, values: list[Any]
) -> None:
    if not isinstance(schema, dict):  # a boolean root gets no quick check: wrapped, it does
        schema = {"allOf": [schema]}
    check = quick_of(schema)
    for value in values:
        assert (check(value) is True) is rs_valid(schema, value), (schema, value)


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(schema=fuzz_schemas(), arguments=st.lists(fuzz_arguments(), min_size=1, max_size=4))
def test_on_any_schema_and_value_it_is_never_looser(
    schema: tuple[Any, ...], arguments: list[tuple[Any, ...]]
) -> None:
    values = [make_arguments(a) for a in arguments]
    _never_looser(make_schema(schema), values)
