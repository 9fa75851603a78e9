"""plain_copy: the C accelerator and its pure-Python equivalent give the same answers.

Both return a deep copy of a plain JSON object within the limits, or None.
The C one must also never leak or free a reference it does not own, and must
not let a finalizer that mutates the input smuggle a non-JSON value through.
"""

from __future__ import annotations

import collections
import enum
import gc
import inspect
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_backend.errors import ConfigError, ToolArgumentError
from agent_backend.schema import Limits, compile_schema, prepare_arguments
from agent_backend.schema import plain as plain_module
from agent_backend.schema import prepare as prepare_module
from agent_backend.schema.parse import has_big_float
from agent_backend.schema.plain import (
    ACCELERATED,
    big_float,
    plain_copy,
    plain_copy_python,
)

accelerated = pytest.mark.skipif(not ACCELERATED, reason="the C accelerator is not built")

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


IMPLEMENTATIONS: list[Callable[[Any, int, int], dict[str, Any] | None]] = [plain_copy_python]
if ACCELERATED:
    IMPLEMENTATIONS.append(plain_copy)


@pytest.mark.parametrize("copy", IMPLEMENTATIONS, ids=lambda f: f.__module__.rsplit(".", 1)[-1])
class TestEachImplementation:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(objects(odd=True))
    def test_a_copy_is_equal_plain_and_unshared(self, copy: Any, value: dict[Any, Any]) -> None:
        result = copy(value, 64, BIG)
        if result is None:
            assert not is_plain(value) or len(orjson.dumps(value)) > BIG
            return
        assert is_plain(value)
        assert is_plain(result)
        assert result == value
        assert not set(containers(result)) & set(containers(value))

    @given(objects(odd=False))
    def test_plain_objects_are_always_copied(self, copy: Any, value: dict[str, Any]) -> None:
        if not is_plain(value):  # NaN or an integer beyond 64 bits
            assert copy(value, 64, BIG) is None
        else:
            assert copy(value, 64, BIG) == value

    @pytest.mark.parametrize("levels", [1, 2, 5, 64])
    def test_depth_bound_is_exact(self, copy: Any, levels: int) -> None:
        nested = depth_of(levels)  # the top object is level 1
        assert copy(nested, levels, BIG) == nested
        assert copy(nested, levels - 1, BIG) is None

    def test_size_bound_is_never_exceeded(self, copy: Any) -> None:
        value = {"text": "x" * 1000, "n": [1.25, -7, True, None, 'q"\n\\é中😀']}
        size = len(orjson.dumps(value))
        assert copy(value, 64, size - 1) is None
        assert copy(value, 64, 24 * size) == value

    @pytest.mark.parametrize("text", ["x" * 1000, "é" * 1000, 'a"\\\n' * 250])
    def test_a_string_is_counted_exactly_when_its_worst_case_does_not_fit(
        self, copy: Any, text: str
    ) -> None:
        # The C copy bounds a one-byte-per-character string by 6 bytes a character unread,
        # and counts it when that does not fit: within a few bytes of separators of the exact
        # size (and of \\u00XX for a control character: its bound is never under the size),
        # far below the unread worst case.
        value = {"text": text, "more": [text]}
        size = len(orjson.dumps(value))
        assert copy(value, 64, size + 8 + 2 * 4 * text.count("\n")) == value
        assert copy(value, 64, size - 1) is None

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
    def test_edges_that_are_plain(self, copy: Any, value: dict[str, Any]) -> None:
        assert copy(value, 64, BIG) == value

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
    def test_anything_else_is_refused(self, copy: Any, value: Any) -> None:
        assert copy(value, 64, BIG) is None

    def test_a_cycle_is_refused_by_the_depth_bound(self, copy: Any) -> None:
        value: dict[str, Any] = {}
        value["self"] = value
        assert copy(value, 64, BIG) is None
        assert copy(value, 10**6, BIG) is None  # the C stack guard, or orjson's own


@given(objects(odd=True), st.integers(1, 6), st.integers(0, 400))
@settings(max_examples=500, deadline=None)
@accelerated
def test_c_and_python_agree(value: dict[Any, Any], max_depth: int, max_bytes: int) -> None:
    fast = plain_copy(value, max_depth, max_bytes)
    slow = plain_copy_python(value, max_depth, max_bytes)
    if fast is not None:  # the C bound is never under the exact size
        assert slow == fast
    if slow is not None and 24 * len(orjson.dumps(slow)) <= max_bytes:
        assert fast == slow


@accelerated
def test_references_are_neither_leaked_nor_stolen() -> None:
    leaf = "a string only this test holds " * 3
    number = 10**15 + 7
    accepted = {"a": [leaf, {"b": leaf, "n": number}], "c": leaf}
    refused = {"a": [leaf, {"b": leaf, "n": number}], "z": [leaf, float("nan")]}
    before = sys.getrefcount(leaf), sys.getrefcount(number)
    for _ in range(1000):
        assert plain_copy(accepted, 64, BIG) == accepted
        assert plain_copy(refused, 64, BIG) is None
        assert plain_copy(accepted, 2, BIG) is None
        assert plain_copy(accepted, 64, 10) is None
    assert (sys.getrefcount(leaf), sys.getrefcount(number)) == before


@accelerated
@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 40])
def test_a_dict_with_many_nested_containers_is_copied_all_through(count: int) -> None:
    # The C copy keeps the nested containers of a dict from its first pass when there are at
    # most 16, and walks the copy again when there are more: on both sides of 16, every one
    # of them is copied and checked.
    leaf = "held by this test alone " * 2
    value: dict[str, Any] = {}
    inner: Any = None
    for i in range(count):
        value[f"s{i}"] = i
        value[f"c{i}"] = {"k": [leaf, i]} if i % 2 else [leaf, {"k": i}]
    value["last"] = leaf
    before = sys.getrefcount(leaf)
    for _ in range(200):
        copied = plain_copy(value, 64, BIG)
        assert copied == value == plain_copy_python(value, 64, BIG)
        for i in range(count):
            assert copied[f"c{i}"] is not value[f"c{i}"]
            inner = copied[f"c{i}"]["k"] if i % 2 else copied[f"c{i}"][1]
            assert inner is not (value[f"c{i}"]["k"] if i % 2 else value[f"c{i}"][1])
        for bad in {0, count - 1} if count else set():  # one bad value deep refuses all
            spoiled = dict(value)
            spoiled[f"c{bad}"] = [leaf, {"k": float("nan")}]
            assert plain_copy(spoiled, 64, BIG) is None
            del spoiled
    del copied, inner
    assert sys.getrefcount(leaf) == before


@accelerated
def test_no_python_code_runs_inside_the_copy() -> None:
    """A collection (triggered by an allocation) runs gc callbacks and finalizers: code that
    could find the copies being built (gc.get_referrers) and change or free what was checked.
    The collector is off for the call, so none runs inside it; it is back on afterwards."""
    sentinel = "sentinel-" + str(id(object()))
    inner: list[Any] = [sentinel, [1], {"k": [2]}]
    value = {"a": inner, "nested": [{"k": i} for i in range(50)]}
    inside = [False]
    ran_inside: list[bool] = []

    def meddle(phase: str, info: dict[str, Any]) -> None:
        if phase != "start":
            return
        ran_inside.append(inside[0])
        if not inside[0]:
            return  # between calls: the caller's own objects, not the copy's business
        for holder in gc.get_referrers(sentinel):
            if type(holder) is list and holder is not inner and holder and holder[0] is sentinel:
                holder[0] = {1, 2}  # not JSON: had this run inside, a checked slot would change
                holder.clear()

    threshold = gc.get_threshold()
    gc.callbacks.append(meddle)
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(100):
            hold = [([], {}) for _ in range(100)]  # drain the free lists: the copies are allocated
            inside[0] = True
            result = plain_copy(value, 64, BIG)
            inside[0] = False
            assert result is not None
            assert result["a"][0] is sentinel  # checked before any allocation can collect
            assert gc.isenabled()
            del hold, result
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(meddle)
    assert ran_inside  # collections did run, between the calls
    assert not any(ran_inside)


def test_colliding_keys_with_their_own_eq_are_refused_without_calling_it() -> None:
    """Copying a dict with deleted entries compares keys of equal hash: never a user's __eq__."""
    armed = [False]

    class Key:
        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            if armed[0]:
                raise AssertionError("__eq__ ran inside plain_copy")
            return self is other

    def dirty() -> dict[Any, Any]:
        value: dict[Any, Any] = {"x1": 0, "x2": 0, "x3": 0, Key(): 1, Key(): 2}
        for key in ("x1", "x2", "x3"):
            del value[key]
        return value

    top, nested = dirty(), {"ok": [dirty()]}
    armed[0] = True
    for copy in IMPLEMENTATIONS:
        assert copy(top, 64, BIG) is None
        assert copy(nested, 64, BIG) is None


@pytest.mark.parametrize("copy", IMPLEMENTATIONS, ids=lambda f: f.__module__.rsplit(".", 1)[-1])
def test_bounds_at_the_edges_of_their_range(copy: Any) -> None:
    value = {"a": "x" * 1000}
    for max_bytes in (-(2**63), -(2**63) + 1, -(2**64), -1, 0, 1):
        assert copy(value, 64, max_bytes) is None  # the budget never wraps around
    assert copy({}, 64, 1) is None
    assert copy({}, 64, 2) == {}
    for max_bytes in (2**63, 10**30):
        assert copy(value, 64, max_bytes) == value
    for max_depth in (2**31, 10**30):
        assert copy(value, max_depth, BIG) == value
    for max_depth in (0, -1, -(2**70)):
        assert copy(value, max_depth, BIG) is None


def test_deeper_than_orjson_goes_to_the_checked_path() -> None:
    """orjson refuses 254 levels; so does either copy, and the checked path takes it (this also
    bounds the C recursion whatever Limits.max_depth says)."""
    deep: Any = 1
    for _ in range(299):
        deep = [deep]
    value = {"a": deep}
    for copy in IMPLEMENTATIONS:
        assert copy(value, 10**6, BIG) is None
    compiled = compile_schema({"type": "object"}, limits=Limits(max_depth=400))
    assert compiled.prepare(value) == value
    with pytest.raises(ToolArgumentError, match="deeper than 299"):
        compile_schema({"type": "object"}, limits=Limits(max_depth=299)).prepare(value)


@pytest.mark.parametrize("field", ["max_bytes", "max_depth", "max_issues"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, float("inf"), True, "10"])
def test_limits_must_be_positive_integers(field: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match=f"Limits.{field}") as info:
        Limits(**{field: bad})
    assert info.value.key == field


def test_the_accelerator_is_built_under_ci() -> None:
    if os.environ.get("CI") == "true":
        assert ACCELERATED, (
            "CI=true: agent_backend.schema._plain was not built (is a C compiler installed?)"
        )
    # The fast path calls the implementation plain.py selected: the compiled one when built.
    assert prepare_module.plain_copy is plain_module.plain_copy
    expected = "agent_backend.schema._plain" if ACCELERATED else "agent_backend.schema.plain"
    assert plain_module.plain_copy.__module__ == expected
    prepare = compile_schema({"type": "object"}).prepare
    if ACCELERATED:  # the hot path of prepare itself runs in C
        assert type(prepare) is plain_module.DictPrepare
        assert type(prepare_module.prepare_arguments) is plain_module.CachedPrepare
    else:
        assert plain_module.DictPrepare is None
        assert plain_module.CachedPrepare is None
        assert prepare_module.prepare_arguments is prepare_module.prepare_arguments_python


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


def python_compiled(schema: Any) -> Any:
    """``schema`` compiled as an install without the C extension has it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare_module, "_DictPrepare", None)
        compiled = compile_schema(schema)
    assert type(compiled.prepare) is not plain_module.DictPrepare
    return compiled


def answer(prepare: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return ("ok", prepare(*args, **kwargs))
    except ToolArgumentError as exc:
        return ("error", (exc.tool, [issue.pointer for issue in exc.issues]))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@given(value=objects(odd=True))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_prepare_answers_the_same_with_either_copy(index: int, value: dict[Any, Any]) -> None:
    """The pure-Python prepare with either copy, and (when built) the C prepare."""
    schema = SCHEMAS[index]
    answers = []
    for copy in IMPLEMENTATIONS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prepare_module, "plain_copy", copy)
            answers.append(answer(python_compiled(schema).prepare, value))
    if ACCELERATED:
        compiled = compile_schema(schema)
        answers.append(answer(compiled.prepare, value))
        answers.append(answer(compiled.prepare, value, tool="t"))
        answers.append(answer(prepare_arguments, schema, value))
    oks = {kind for kind, _ in answers}
    assert len(oks) == 1, answers
    if answers[0][0] == "ok":
        assert all(out == answers[0][1] for _, out in answers), answers
        assert is_json(answers[0][1])
        for _, out in answers:
            assert out is not value
            assert not any(id(c) in {id(d) for d in containers(value)} for c in containers(out))
    else:
        pointers = {tuple(out[1]) for _, out in answers}
        assert len(pointers) == 1, answers


# -- the C prepare: the Python functions' answers, without their frames ---------------------

CALL_SHAPES: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    (("calc",), {}),
    (("calc", False), {}),
    (("calc", True), {}),
    ((), {"tool": "calc"}),
    ((None,), {"inject_defaults": False}),
    ((), {"tool": "calc", "inject_defaults": True}),
    ((), {"inject_defaults": 0}),
]


@accelerated
@pytest.mark.parametrize("value", [{"n": 1}, {"n": "2"}, {"n": "x"}, {}, {"n": {1}}, '{"n": 3}'])
@pytest.mark.parametrize("shape", range(len(CALL_SHAPES)))
def test_the_c_prepare_answers_every_call_shape_as_the_python_one(value: Any, shape: int) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "d": {"type": "string", "default": "x"}},
        "required": ["n"],
    }
    args, kwargs = CALL_SHAPES[shape]
    expected = answer(python_compiled(schema).prepare, value, *args, **kwargs)
    assert answer(compile_schema(schema).prepare, value, *args, **kwargs) == expected
    keywords = dict(zip(("tool", "inject_defaults"), args, strict=False)) | kwargs
    expected = answer(prepare_module.prepare_arguments_python, schema, value, **keywords)
    assert answer(prepare_arguments, schema, value, **keywords) == expected
    assert answer(prepare_arguments, schema=schema, arguments=value, **keywords) == expected


@accelerated
def test_the_c_prepare_arguments_stands_for_the_python_function() -> None:
    python = prepare_module.prepare_arguments_python
    assert prepare_arguments.__wrapped__ is python
    assert inspect.signature(prepare_arguments) == inspect.signature(python)
    assert prepare_arguments.__doc__ == python.__doc__
    assert prepare_arguments.__name__ == "prepare_arguments"
    assert "prepare_arguments" in repr(prepare_arguments)
    assert pickle.loads(pickle.dumps(prepare_arguments)) is prepare_arguments
    compiled = compile_schema({"type": "object"})
    assert inspect.signature(compiled.prepare) == inspect.signature(compiled.prepare.__wrapped__)
    schema = {"type": "object"}
    # Mistakes in the call are the Python function's own errors, naming it.
    for args, kwargs in [
        ((schema,), {}),
        ((schema, {}, "calc"), {}),
        ((schema, {}), {"tol": "calc"}),
        ((schema, {}), {"tool": "a", "schema": schema}),
    ]:
        with pytest.raises(TypeError, match="prepare_arguments") as info:
            prepare_arguments(*args, **kwargs)
        with pytest.raises(TypeError) as python_info:
            python(*args, **kwargs)
        assert str(info.value) == str(python_info.value)
    with pytest.raises(TypeError):
        compiled.prepare()
    with pytest.raises(TypeError):
        compiled.prepare({}, None, False, "extra")


@accelerated
def test_the_c_prepare_arguments_follows_the_cache_and_holds_what_it_runs() -> None:
    """Alternating schemas, an entry evicted or replaced meanwhile, a CompiledSchema: each
    call is answered for its own schema; nothing the C side holds is freed under it."""
    schemas = [
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": limit}}}
        for limit in range(5)
    ]
    for round_ in range(3):
        for limit, schema in enumerate(schemas):
            assert prepare_arguments(schema, {"n": limit}) == {"n": limit}
            with pytest.raises(ToolArgumentError):
                prepare_arguments(schema, {"n": limit + 1})
            if round_ == 1:
                prepare_module._cache.pop(id(schema), None)  # evicted: compiled again
    compiled = compile_schema(schemas[0])
    assert prepare_arguments(compiled, {"n": "0"}) == {"n": 0}
    before = [sys.getrefcount(schema) for schema in schemas]
    value = {"n": 0, "x": [1, {"y": "z"}]}
    held = [sys.getrefcount(value), sys.getrefcount(value["x"])]
    for _ in range(1000):
        prepare_arguments(schemas[0], value)
        prepare_arguments(schemas[1], {"n": "1"})
    assert [sys.getrefcount(value), sys.getrefcount(value["x"])] == held
    assert [sys.getrefcount(schema) for schema in schemas] == before


@accelerated
def test_an_is_valid_that_raises_or_answers_oddly_is_passed_through() -> None:
    def repair(arguments: Any, tool: Any, parsed: Any) -> Any:
        return ("repaired", tool, parsed)

    def slow(*args: Any, **kwargs: Any) -> Any:
        return ("slow", args, kwargs)

    def boom(value: Any) -> bool:
        raise RuntimeError("validator failed")

    assert plain_module.DictPrepare is not None
    raising = plain_module.DictPrepare(boom, 64, BIG, slow, repair)
    with pytest.raises(RuntimeError, match="validator failed"):
        raising({"a": 1})
    assert raising("text", tool="t") == ("slow", ("text",), {"tool": "t"})
    truthy = plain_module.DictPrepare(lambda value: [1], 64, BIG, slow, repair)
    assert truthy({"a": [1]}) == {"a": [1]}
    falsy = plain_module.DictPrepare(lambda value: 0, 64, BIG, slow, repair)
    assert falsy({"a": 1}, "t") == ("repaired", "t", {"a": 1})
    shallow = plain_module.DictPrepare(lambda value: True, 0, BIG, slow, repair)
    assert shallow({"a": 1}) == ("slow", ({"a": 1},), {})  # the bounds admit no copy
    with pytest.raises(TypeError):
        plain_module.DictPrepare(None, 64, BIG, slow, repair)
    with pytest.raises(TypeError):
        plain_module.CachedPrepare([], slow)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.sampled_from([2.0**63, -(2.0**63), 2.0**63 - 1024, 1e300, -1e300])
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=20,
)


@given(json_values)
@settings(max_examples=500, deadline=None)
@accelerated
def test_big_float_in_c_agrees_with_the_python_walk(value: Any) -> None:
    assert big_float(value) is has_big_float(value)


@accelerated
def test_big_float_answers_true_past_the_c_stack() -> None:
    deep: list[Any] = []
    tip = deep
    for _ in range(100_000):
        tip.append([])
        tip = tip[0]
    assert big_float(deep) is True  # the caller re-reads the text: only slower
    assert big_float([[1.0, {"x": [9.3e18]}]]) is True
    assert big_float({"x": [9.2e18, -9.2e18, "9.3e18"]}) is False
