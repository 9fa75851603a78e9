"""The repair nodes in C (agent_backend/schema/_repair.c) give the Python nodes' results.

``coerce_nodes.py`` builds a C node where the extension is built, standing for the Python
function it builds from the same arguments. Here every node is built both ways and held to
the same answers: the same values of the same types, the same objects kept (unchanged parts
are shared, never copied), the same errors; on corrupted BFCL calls, on generated schemas
and arguments, and on the text forms the C fast paths read (or hand back) themselves.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import random
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.realworld import bfcl_cases, corrupt, realworld_missing_reason
from support.schema_strategies import fuzz_arguments, fuzz_schemas, make_arguments, make_schema

from agent_backend.errors import AgentBackendError, ToolArgumentError
from agent_backend.schema import coerce_nodes, compile_schema, plain
from agent_backend.schema.coerce import Coercer
from agent_backend.schema.coerce_nodes import (
    LEAVE_OUT,
    array_fix,
    json_parse,
    member_fix,
    null_left_out,
    object_fix,
    type_fix,
)
from agent_backend.schema.coerce_rules import FAIL, TEXT_RULES

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not plain.ACCELERATED, reason="the C extension is not built"),
]

_C_NODES = (
    "_NumericFix",
    "_ScalarFix",
    "_ObjectFix",
    "_ArrayFix",
    "_NullLeftOut",
    "_TypedFix",
    "_MemberFix",
    "_JsonParse",
)


@contextmanager
def python_nodes() -> Iterator[None]:
    """Nodes built inside are the Python functions (lazily compiled ones too, if called here)."""
    saved = {name: getattr(coerce_nodes, name) for name in _C_NODES}
    for name in _C_NODES:
        setattr(coerce_nodes, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(coerce_nodes, name, value)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "value", call()
    except ToolArgumentError as exc:
        return "refused", (str(exc), [issue.pointer for issue in exc.issues])
    except Exception as exc:
        return "raised", (type(exc), str(exc))


def same(a: Any, b: Any) -> bool:
    """Equal values of the same Python types all the way down (1 != 1.0 != True); iterative
    (generated values nest 5,000 levels)."""
    stack = [(a, b)]
    while stack:
        left, right = stack.pop()
        if type(left) is not type(right):
            return False
        if isinstance(left, dict):
            if left.keys() != right.keys():
                return False
            stack.extend((left[k], right[k]) for k in left)
        elif isinstance(left, list | tuple):
            if len(left) != len(right):
                return False
            stack.extend(zip(left, right, strict=True))
        elif isinstance(left, float) and left != left:
            if right == right:
                return False
        elif not bool(left == right):
            return False
    return True


def kept(result: Any, given: Any) -> list[Any]:
    """Where ``result`` is ``given`` itself, container by container (what was not copied)."""
    marks: list[Any] = []
    stack = [(result, given)]
    while stack:
        out, into = stack.pop()
        marks.append(out is into)
        if type(out) is dict and type(into) is dict:
            stack.extend((out[k], into[k]) for k in out if k in into)
        elif type(out) is list and type(into) is list:
            stack.extend(zip(out, into, strict=False))
    return marks


def assert_same_repair(
    schema: Any, values: list[Any], *, inject_defaults: bool = False, new: Any = None
) -> int:
    """Each value repaired by a C-node and a Python-node copy of ``schema`` (``prepare`` and
    the coercer alone): the same outcomes. How many values took the repair path.
    ``new()`` makes the second copy (default: a deep copy of ``schema``)."""
    try:
        fast = compile_schema(schema)
        slow = compile_schema(copy.deepcopy(schema) if new is None else new())
    except AgentBackendError:
        return 0
    repaired = 0
    for value in values:
        with python_nodes():
            expected = outcome(functools.partial(slow.prepare, value, None, inject_defaults))
            expected_fix = outcome(functools.partial(slow._coercers[inject_defaults].coerce, value))
        got = outcome(functools.partial(fast.prepare, value, None, inject_defaults))
        got_fix = outcome(functools.partial(fast._coercers[inject_defaults].coerce, value))
        for left, right in ((expected, got), (expected_fix, got_fix)):
            assert left[0] == right[0], (schema, value, left, right)
            assert same(left[1], right[1]), (schema, value, left, right)
        if expected_fix[0] == "value":
            assert kept(expected_fix[1], value) == kept(got_fix[1], value), (schema, value)
            repaired += expected_fix[1] is not value
    return repaired


def test_the_nodes_are_built_in_c_and_stand_for_python_functions() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "b": {"type": "boolean"},
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"x": {"type": "number"}}},
            },
        },
    }
    compiled = compile_schema(schema)
    assert compiled.prepare('{"n": "1", "b": "true", "items": "[{\\"x\\": \\"2.5\\"}]"}') == {
        "n": 1,
        "b": True,
        "items": [{"x": 2.5}],
    }
    root = compiled._coercers[False]._fix
    assert type(root).__name__ == "ObjectFix"
    with python_nodes():
        python = compile_schema(schema)
        python.prepare({"n": "1"})
        assert type(python._coercers[False]._fix).__name__ == "function"


# -- the C fast paths' own reading of text --------------------------------------------------

NUMERIC_TEXTS = [
    "0", "7", "007", "-7", "+7", " 12 ", "\t12\n", "\x1c12\x1f", "\x0b12\x0c", "1.5", "01.50",
    "1.", ".5", "1.5.5", "1e5", "1E-2", "-1.5", "", " ", "abc", "12a", "1_000", "0x10", "inf",
    "nan", "NaN", "\u0661\u0662", "12\u00a0", "\u00a012", "\u300012", "\u0663.\u0665", "9" * 299 + ".5",
    "9" * 300 + ".5", "9" * 400, "9" * 401, "1" * 399 + ".5", "1" * 398 + ".5", "4.0",
    "-0", "-0.0", "1.0e400", "true", "null", "-9.81", "+1.50", "+.5", "-", "+", "--5", "+-5",
    "-" + "9" * 299 + ".5", "-" + "9" * 300 + ".5", "-" + "9" * 399, "-" + "9" * 400, " -7 ",
]  # fmt: skip


@pytest.mark.parametrize("kind", ["integer", "number", "boolean", "null"])
@pytest.mark.parametrize("nullable", [False, True])
def test_numeric_and_scalar_text_is_read_as_the_python_node_reads_it(
    kind: str, nullable: bool
) -> None:
    leaf: dict[str, Any] = {"type": [kind, "null"] if nullable else kind}
    schema = {"type": "object", "properties": {"v": leaf, "w": {"type": "array", "items": leaf}}}
    values: list[Any] = [{"v": text} for text in NUMERIC_TEXTS]
    values += [{"w": NUMERIC_TEXTS}, {"w": json.dumps(NUMERIC_TEXTS)}]
    values += [{"v": v} for v in (1, 1.5, True, None, [], {}, 2**70, -(2**70), 1e300)]
    assert_same_repair(schema, values)


@settings(max_examples=400, deadline=None, database=None)
@given(
    text=st.one_of(
        st.text(alphabet="0123456789.+-eE \t\n\x1c\x1f\u00a0\u0663xX_", max_size=12),
        st.from_regex(r"\A[ \t]?[-+]?[0-9]{0,6}(\.[0-9]{0,6})?([eE][-+]?[0-9]{1,3})?[ \t]?\Z"),
        st.text(max_size=6),
    ),
    kind=st.sampled_from(["integer", "number", "boolean", "null"]),
)
def test_generated_numeric_text(text: str, kind: str) -> None:
    schema = {"type": "object", "properties": {"v": {"type": kind}}}
    assert_same_repair(schema, [{"v": text}, {"v": [text]}])


# -- whole schemas -------------------------------------------------------------------------

missing = realworld_missing_reason()


@pytest.mark.skipif(missing is not None, reason=missing or "")
def test_corrupted_bfcl_calls_are_repaired_alike() -> None:
    rng = random.Random(7)
    repaired = 0
    for case in bfcl_cases():
        properties = case.schema.get("properties") or {}
        values = [
            {k: corrupt(v, properties.get(k), rng, rate) for k, v in case.arguments.items()}
            for rate in (1.0, 0.5)
        ]
        values.append(json.dumps(values[0]))
        repaired += assert_same_repair(case.schema, values)
    assert repaired > 3000


@settings(
    max_examples=150,  # about 8 s
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    schema=fuzz_schemas(),
    arguments=st.lists(fuzz_arguments(), min_size=1, max_size=3),
    inject_defaults=st.booleans(),
)
def test_generated_schemas_and_arguments_are_repaired_alike(
    schema: tuple[Any, ...], arguments: list[tuple[Any, ...]], inject_defaults: bool
) -> None:
    assert_same_repair(
        make_schema(schema),
        [make_arguments(a) for a in arguments],
        inject_defaults=inject_defaults,
        new=lambda: make_schema(schema),
    )


# -- one node at a time ---------------------------------------------------------------------


@pytest.fixture(params=["c", "python"])
def built(request: pytest.FixtureRequest) -> Iterator[str]:
    """Nodes built by the tests below are C nodes, then Python functions."""
    if request.param == "c":
        yield "c"
    else:
        with python_nodes():
            yield "python"


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


def never_valid(node: Any, value: Any) -> bool:
    return False


def no_generic(value: Any, depth: int, check: bool) -> Any:
    return ("generic", value, depth, check)


def parse_json(text: str, opener: str, wanted: type, depth: int) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return FAIL
    return value if text.startswith(opener) and isinstance(value, wanted) else FAIL


def test_an_object_node_descends_copies_on_write_and_leaves_out(built: str) -> None:
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
    assert (type(fix).__name__ == "ObjectFix") == (built == "c")
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
    # Odd call shapes go to the Python function unchanged.
    assert fix(value={"a": 1}, depth=1, check=False) == {"a": 2}
    with pytest.raises(TypeError):
        fix({"a": 1}, 1)  # type: ignore[call-arg]


def test_an_array_node_wraps_text_that_is_no_array_and_descends_items(built: str) -> None:
    plus = Recorder(lambda v: v + 1 if type(v) is int else v)
    fix = array_fix({"type": "array"}, plus, parse_json, no_generic, lambda node: never, False)
    assert (type(fix).__name__ == "ArrayFix") == (built == "c")
    assert fix([1, "a", 2], 1, True) == [2, "a", 3]
    assert plus.calls[0] == (1, 2, False)
    texts = ["x", "y"]
    assert fix(texts, 1, True) is texts
    assert fix("[1, 2]", 1, True) == [2, 3]
    assert fix("lone", 1, True) == ["lone"]
    assert fix({"k": 1}, 5, True) == ("generic", {"k": 1}, 5, True)


def test_a_checked_container_the_node_accepts_is_kept_and_verdicts_are_truthiness(
    built: str,
) -> None:
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


def test_errors_of_validators_children_and_parsers_propagate(built: str) -> None:
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


def test_scalar_nodes_convert_strings_and_hand_other_values_to_convert(built: str) -> None:
    seen: list[Any] = []

    def convert(value: Any, depth: int) -> Any:
        seen.append((value, depth))
        return "converted"

    integer = type_fix(("integer",), convert)
    boolean = type_fix(("boolean",), convert)
    both = type_fix(("boolean", "null"), convert)
    assert (type(integer).__name__ == "NumericFix") == (built == "c")
    assert (type(boolean).__name__ == "ScalarFix") == (built == "c")
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
    assert TEXT_RULES["integer"]("42") == 42


def test_a_container_type_parses_text_wraps_a_lone_value_and_keeps_its_own_type(
    built: str,
) -> None:
    coercer = Coercer({}, is_valid=never_valid, max_depth=8)
    seen: list[Any] = []

    def node(types: tuple[str, ...]) -> Any:
        step = coercer._types_step(types)
        assert step is not None

        def convert(value: Any, depth: int) -> Any:  # the real step; other values recorded
            if isinstance(value, str):
                return step(value, depth)
            seen.append((value, depth))
            return "converted"

        return type_fix(types, convert, coercer._parse)

    array, nullable_object = node(("array",)), node(("object", "null"))
    assert (type(array).__name__ == "TypedFix") == (built == "c")
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


def test_an_enum_converts_strings_to_members_only_and_keeps_everything_else(built: str) -> None:
    def members_of(members: list[Any]) -> Any:
        compiled = Coercer({"enum": members}, is_valid=never_valid, max_depth=8)._members_step(
            members
        )
        kinds = Coercer._member_kinds(members)
        rules = tuple(TEXT_RULES[kind] for kind in kinds if kind in TEXT_RULES)
        assert compiled is not None
        return member_fix(members, rules, compiled)

    numbers = members_of([1, 2.5, "x", True, None])
    containers = members_of([[1], {"a": 1}])
    assert (type(numbers).__name__ == "MemberFix") == (built == "c")
    assert type(containers).__name__ == "function"  # a container member: the Python node
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


PARSE_TEXTS = [
    "[1, 2]", '{"a": [1, {"b": 2}]}', "[1, 2", "{'a': 1}", "[9223372036854775808]",
    "[1e300]", "[1.5]", "[]", "{}", "[[[[[[[[1]]]]]]]]", "[[[[[[[[[1]]]]]]]]]",
    "[" * 20 + "]" * 20, "[" + "[1]," * 30 + "[1]]", '{"a": "[[[[[[[[[[[["}', "[NaN]",
    "1", '"[1]"', '{"a": 1}', "[1]", "[\u0661]", '["\u00e9\ud83d\ude00"]',
]  # fmt: skip


@pytest.mark.parametrize("text", PARSE_TEXTS)
def test_the_parser_reads_json_text_as_the_python_parser_does(text: str) -> None:
    coercer = Coercer({}, is_valid=never_valid, max_depth=8)
    fast = json_parse(8, coercer._parse_text)
    assert type(fast).__name__ == "JsonParse"
    for opener, wanted in (("[", list), ("{", dict)):
        for depth in (0, 1, 4, 8, 9, 12):
            expected = outcome(lambda: coercer._parse_text(text, opener, wanted, depth))  # noqa: B023
            got = outcome(lambda: fast(text, opener, wanted, depth))  # noqa: B023
            assert expected[0] == got[0], (text, opener, depth)
            assert same(expected[1], got[1]), (text, opener, depth)
    assert fast(text, "[", tuple, 1) is coercer._parse_text(text, "[", tuple, 1)  # other shapes


def test_a_schema_and_value_deeper_than_the_recursion_limit_raise_recursion_error() -> None:
    """Values reach repair bounded in depth (``Limits.max_depth``); called directly on a deeper
    one, the C nodes stop at Python's recursion limit, as the Python functions do."""
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


def test_null_leaves_an_optional_property_out_and_other_values_go_to_its_fix(
    built: str,
) -> None:
    inner = Recorder(lambda v: ("fixed", v))
    fix = null_left_out(inner)
    assert (type(fix).__name__ == "NullLeftOut") == (built == "c")
    assert fix(None, 1, True) is LEAVE_OUT
    assert fix("3", 2, False) == ("fixed", "3")
    assert fix(value=0, depth=4, check=True) == ("fixed", 0)
    assert inner.calls == [("3", 2, False), (0, 4, True)]
    out = object_fix({}, {"a": fix}, None, no_generic, lambda node: never, False)(
        {"a": None, "b": 1}, 1, False
    )
    assert out == {"b": 1}


def test_reference_counts_are_unchanged_over_many_repairs() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "gone": {"type": "integer"},
            "left_out": {"type": "string"},
            "e": {"type": "integer", "enum": [1, 2, 3]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "lone": {"type": "array", "items": {"type": "string"}},
            "obj": {"type": "object"},
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"q": {"type": "integer"}}},
            },
        },
    }
    compiled = compile_schema(schema)
    value = {
        "n": "1",
        "x": "2.5",
        "b": "true",
        "gone": None,
        "left_out": None,
        "e": "2",
        "tags": '["a", "b"]',
        "lone": " fries ",
        "obj": '{"k": [1]}',
        "items": '[{"q": "3"}, "{}"]',
    }
    texts = [v for v in value.values() if v is not None]
    for _ in range(50):
        compiled.prepare(value)
    gc.collect()
    before = [sys.getrefcount(v) for v in (value, *texts)]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            out = compiled.prepare(value)
            assert out == {
                "n": 1,
                "x": 2.5,
                "b": True,
                "e": 2,
                "tags": ["a", "b"],
                "lone": [" fries "],
                "obj": {"k": [1]},
                "items": [{"q": 3}, {}],
            }
        del out
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert [sys.getrefcount(v) for v in (value, *texts)] == before
    assert grown < 64_000  # one result kept per call would be 2,000 dicts and lists
