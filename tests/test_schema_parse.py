"""Dict arguments: the fast path's copy (``copy_plain_object``), the checked path behind it,
and the bounds (``Limits``).

``copy_plain_object`` returns a deep copy of a plain JSON object within the limits, or None;
then ``parse_arguments`` converts what it can and names what it cannot. Either way what
``prepare`` returns is plain JSON that shares nothing with the caller's value.
"""

from __future__ import annotations

import collections
import enum
import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_backend.errors import ConfigError, ToolArgumentError
from agent_backend.schema import CompiledSchema, Limits, compile_schema, prepare_arguments
from agent_backend.schema.parse import copy_plain_object, may_hold_big_integer

BIG = 10**9


class Text(str):
    pass


class Number(int):
    pass


class Colour(enum.Enum):
    RED = "red"


class Mapping(dict[str, Any]):
    pass


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**65)
    | st.floats(width=64)  # NaN and infinities included
    | st.text(max_size=12)
)
ODD = st.sampled_from(
    [
        (1, 2),
        {1, 2},
        b"bytes",
        Text("sub"),
        Number(3),
        Colour.RED,
        Mapping(a=1),
        collections.OrderedDict(a=1),
        "\ud800",
        1.5j,
    ]
)


def values(odd: bool) -> st.SearchStrategy[Any]:
    leaves = (JSON_SCALARS | ODD) if odd else JSON_SCALARS
    keys = st.text(max_size=6) | (
        st.sampled_from([1, None, Text("k"), "\udfff"]) if odd else st.nothing()
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),  # type: ignore[arg-type]
        max_leaves=20,
    )


def objects(odd: bool) -> st.SearchStrategy[dict[Any, Any]]:
    keys = st.text(max_size=6) | (st.sampled_from([1, Text("k")]) if odd else st.nothing())
    return st.dictionaries(keys, values(odd), max_size=5)  # type: ignore[arg-type]


def is_plain(value: Any) -> bool:
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and is_plain(k) and is_plain(v) for k, v in value.items())
    if kind is list:
        return all(is_plain(v) for v in value)
    if kind is float:
        return value - value == 0.0
    if kind is str:
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)  # UTF-8 has no surrogates
    if kind is int:
        return -(2**63) <= value < 2**64
    return kind is bool or value is None


def is_json(value: Any) -> bool:
    """Plain JSON types; unlike :func:`is_plain`, any int and any str (the checked path keeps them)."""
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and is_json(v) for k, v in value.items())
    if kind is list:
        return all(is_json(v) for v in value)
    if kind is float:
        return value - value == 0.0
    return kind in (str, int, bool) or value is None


def containers(value: Any) -> Iterator[int]:
    if type(value) in (dict, list):
        yield id(value)
        for child in value.values() if type(value) is dict else value:
            yield from containers(child)


def depth_of(levels: int) -> dict[str, Any]:
    value: Any = 1
    for index in range(levels - 1):
        value = {"d": value} if index % 2 else [value]
    return {"top": value}


# -- the fast path's copy ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(objects(odd=True))
def test_a_copy_is_equal_plain_and_unshared(value: dict[Any, Any]) -> None:
    result = copy_plain_object(value, 64, BIG)
    if result is None:
        assert not is_plain(value) or len(orjson.dumps(value)) > BIG
        return
    assert is_plain(value)
    assert is_plain(result)
    assert result == value
    assert not set(containers(result)) & set(containers(value))


@given(objects(odd=False))
def test_plain_objects_are_always_copied(value: dict[str, Any]) -> None:
    if not is_plain(value):  # NaN or an integer beyond 64 bits
        assert copy_plain_object(value, 64, BIG) is None
    else:
        assert copy_plain_object(value, 64, BIG) == value


@pytest.mark.parametrize("levels", [1, 2, 5, 64])
def test_depth_bound_is_exact(levels: int) -> None:
    nested = depth_of(levels)  # the top object is level 1
    assert copy_plain_object(nested, levels, BIG) == nested
    assert copy_plain_object(nested, levels - 1, BIG) is None


@pytest.mark.parametrize("text", ["x" * 1000, "é" * 1000, 'a"\\\n' * 250])
def test_size_bound_is_the_compact_json_size(text: str) -> None:
    value = {"text": text, "n": [1.25, -7, True, None, 'q"\n\\é中😀', text]}
    size = len(orjson.dumps(value))
    assert copy_plain_object(value, 64, size) == value
    assert copy_plain_object(value, 64, size - 1) is None


@pytest.mark.parametrize(
    "value",
    [
        {"a": 2**63 - 1},
        {"a": -(2**63)},
        {"a": 2**64 - 1},
        {"a": 1.7976931348623157e308},
        {"a": -0.0},
        {"": ""},
        {},
    ],
)
def test_edges_that_are_plain(value: dict[str, Any]) -> None:
    assert copy_plain_object(value, 64, BIG) == value


@pytest.mark.parametrize(
    "value",
    [
        {"a": 2**64},
        {"a": -(2**63) - 1},
        {"a": float("nan")},
        {"a": [float("-inf")]},
        {"a": {"b": (1,)}},
        {"a": "\ud800"},
        {"\ud800": 1},
        {"a": Text("x")},
        {"a": Number(1)},
        {"a": Colour.RED},
        {"a": [Mapping()]},
        {1: "a"},
        Mapping(a=1),
        [1],
        "text",
    ],
)
def test_anything_else_is_refused(value: Any) -> None:
    assert copy_plain_object(value, 64, BIG) is None


def test_a_cycle_is_refused_by_the_depth_bound() -> None:
    value: dict[str, Any] = {}
    value["self"] = value
    assert copy_plain_object(value, 64, BIG) is None
    assert copy_plain_object(value, 10**6, BIG) is None  # orjson's own bound


def test_colliding_keys_with_their_own_eq_are_refused_without_calling_it() -> None:
    """A dict with deleted entries and keys of equal hash: a copy must never run a user's
    __eq__ (code of the caller's, inside the check)."""
    armed = [False]

    class Key:
        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            if armed[0]:
                raise AssertionError("__eq__ ran inside copy_plain_object")
            return self is other

    def dirty() -> dict[Any, Any]:
        value: dict[Any, Any] = {"x1": 0, "x2": 0, "x3": 0, Key(): 1, Key(): 2}
        for key in ("x1", "x2", "x3"):
            del value[key]
        return value

    top, nested = dirty(), {"ok": [dirty()]}
    armed[0] = True
    assert copy_plain_object(top, 64, BIG) is None
    assert copy_plain_object(nested, 64, BIG) is None


def test_bounds_at_the_edges_of_their_range() -> None:
    value = {"a": "x" * 1000}
    for max_bytes in (-(2**63), -(2**63) + 1, -(2**64), -1, 0, 1):
        assert copy_plain_object(value, 64, max_bytes) is None
    assert copy_plain_object({}, 64, 1) is None
    assert copy_plain_object({}, 64, 2) == {}
    for max_bytes in (2**63, 10**30):
        assert copy_plain_object(value, 64, max_bytes) == value
    for max_depth in (2**31, 10**30):
        assert copy_plain_object(value, max_depth, BIG) == value
    for max_depth in (0, -1, -(2**70)):
        assert copy_plain_object(value, max_depth, BIG) is None


# -- through prepare --------------------------------------------------------------------------


def test_deeper_than_orjson_goes_to_the_checked_path() -> None:
    """orjson refuses 254 levels; so does the copy, and the checked path takes it."""
    deep: Any = 1
    for _ in range(299):
        deep = [deep]
    value = {"a": deep}
    assert copy_plain_object(value, 10**6, BIG) is None
    compiled = compile_schema({"type": "object"}, limits=Limits(max_depth=400))
    assert compiled.prepare(value) == value
    with pytest.raises(ToolArgumentError, match="deeper than 299"):
        compile_schema({"type": "object"}, limits=Limits(max_depth=299)).prepare(value)


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object", "properties": {"x": {"type": "number"}}},
        },
        "required": ["n"],
    },
    {"type": "object", "additionalProperties": {"type": ["string", "null"]}},
    {"type": "object"},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@given(value=objects(odd=True))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_prepare_returns_unshared_json_or_refuses(index: int, value: dict[Any, Any]) -> None:
    """Whichever copy took the value: plain JSON that shares no container with it, the same
    from the compiled schema and from prepare_arguments; else a refusal with a pointer."""
    schema = SCHEMAS[index]
    answers = []
    for prepare in (compile_schema(schema).prepare, lambda v: prepare_arguments(schema, v)):
        try:
            answers.append(("ok", prepare(value)))
        except ToolArgumentError as exc:
            answers.append(("error", [issue.pointer for issue in exc.issues]))
    assert answers[0] == answers[1]
    kind, out = answers[0]
    assert out or kind == "ok"  # a refusal names at least one problem
    if kind == "ok":
        assert is_json(out)
        assert out is not value
        assert not set(containers(out)) & set(containers(value))


class _Watched(CompiledSchema):
    """A compiled schema that counts what its fast path hands on to the whole pipeline."""

    __slots__ = ("handed_on",)

    def __init__(self, schema: Any, *, limits: Limits) -> None:
        self.handed_on = 0
        super().__init__(schema, limits=limits)

    def _prepare(self, arguments: Any, **options: Any) -> dict[str, Any]:
        self.handed_on += 1
        return super()._prepare(arguments, **options)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(objects(odd=True), st.sampled_from([(64, 1_000_000), (2, 40)]))
def test_the_fast_path_keeps_what_copy_plain_object_keeps(
    value: dict[Any, Any], bounds: tuple[int, int]
) -> None:
    """prepare's fast path keeps what copy_plain_object keeps, as the same unshared copy, and
    hands everything the function refuses to the checked path."""
    max_depth, max_bytes = bounds
    compiled = _Watched(True, limits=Limits(max_depth=max_depth, max_bytes=max_bytes))
    copied = copy_plain_object(value, max_depth, max_bytes)
    try:
        out: Any = compiled.prepare(value)
    except ToolArgumentError:
        out = None
    if copied is None:
        assert compiled.handed_on == 1
    else:
        assert compiled.handed_on == 0
        assert out == copied
        assert orjson.dumps(out) == orjson.dumps(copied)  # the same types, in the same order
        assert not set(containers(out)) & set(containers(value))


# -- integers orjson cannot read exactly --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "may"),
    [
        ('{"a": 123456789012345678}', False),  # 18 digits: below 2**63
        ('{"a": -999999999999999999, "b": 1.5e300}', False),
        ('{"a": 12345.6789012345678901}', False),  # runs of 5 and 16 digits
        ('{"a": 1234567890123456789}', True),  # 19 digits
        ('{"a": [18446744073709551616]}', True),
        ('{"id": "12345678901234567890"}', True),  # in a string: a false positive, harmless
        ('{"a": "١٢٣٤٥٦٧٨٩٠١٢٣٤٥٦٧٨٩٠"}', False),  # not JSON digits
        ('{"a": "\ud800", "b": "\udfff"}', False),
        ('{"\ud800": "12345678901234567890"}', True),
        (b"[99999999999999999999]", True),
        (b"", False),
    ],
)
def test_texts_that_may_hold_a_big_integer(text: str | bytes, may: bool) -> None:
    assert may_hold_big_integer(text) is may


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.integers(-(2**80), 2**80) | st.floats(allow_nan=False, allow_infinity=False),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=12,
    )
)
def test_text_without_a_long_digit_run_is_read_exactly_by_orjson(value: Any) -> None:
    """What lets repair skip looking for floats orjson made of integers beyond 64 bits."""
    text = json.dumps(value)
    if not may_hold_big_integer(text):
        exact = json.loads(text)
        assert orjson.loads(text) == exact
        assert orjson.dumps(orjson.loads(text)) == orjson.dumps(exact)


@pytest.mark.parametrize("field", ["max_bytes", "max_depth", "max_issues"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, float("inf"), True, "10"])
def test_limits_must_be_positive_integers(field: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"Limits.{field}") as info:
        Limits(**{field: bad})
    assert info.value.key == field
