"""Hypothesis strategies for the schema layer's property tests and its fuzzing.

:func:`instances`: a small generator of instances for the keywords the property tests'
schemas contain (type, properties, required, additionalProperties, items, anyOf/oneOf,
enum/const and ``$ref`` into the root's retained defs); generated instances are filtered
through the real validator anyway.

:func:`fuzz_schemas` and :func:`fuzz_arguments`: recipes for any schema and any
arguments (``tests/test_schema_fuzz.py``, ``bench/schema_fuzz.py``), and
:func:`fuzz_problems`, what counts as a failure for them.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

_SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(-(2**40), 2**40),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=64) | st.integers(-1000, 1000),
    "string": st.text(max_size=12),
}


def instances(schema: Any, root: Any | None = None, depth: int = 0) -> st.SearchStrategy[Any]:
    root = schema if root is None else root
    if schema is True or schema == {}:
        return st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    if not isinstance(schema, dict):
        return st.nothing()
    if "$ref" in schema:
        target = root
        for token in schema["$ref"].lstrip("#/").split("/"):
            target = target[token]
        return instances(target, root, depth + 1) if depth < 4 else st.nothing()
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for keyword in ("anyOf", "oneOf"):
        if keyword in schema:
            return st.one_of([instances(b, root, depth + 1) for b in schema[keyword]])
    declared = schema.get("type")
    if declared is None:
        declared = "object" if "properties" in schema else "string"
    types = [declared] if isinstance(declared, str) else list(declared)
    return st.one_of([_typed(kind, schema, root, depth) for kind in types])


def _typed(kind: str, schema: dict[str, Any], root: Any, depth: int) -> st.SearchStrategy[Any]:
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        items = schema.get("items", {})
        if depth > 3:
            return st.just([])
        return st.lists(instances(items, root, depth + 1), max_size=3)
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        fixed = {k: instances(v, root, depth + 1) for k, v in properties.items() if k in required}
        optional = {
            k: instances(v, root, depth + 1) for k, v in properties.items() if k not in required
        }
        base = st.fixed_dictionaries(fixed, optional=optional)
        additional = schema.get("additionalProperties")
        if isinstance(additional, dict) and depth <= 3:
            extra = st.dictionaries(
                st.text(min_size=1, max_size=6).filter(lambda k: k not in properties),
                instances(additional, root, depth + 1),
                max_size=3,
            )
            return st.builds(lambda a, b: {**b, **a}, base, extra)
        return base
    return st.nothing()


# -- any schema, any arguments: the fuzz cases (tests/test_schema_fuzz.py, bench/schema_fuzz.py) --

_TYPE_NAMES = ("null", "boolean", "integer", "number", "string", "array", "object")
_REFS = (
    "#",
    "#/$defs/a",
    "#/$defs/b",
    "#/$defs/missing",
    "#/properties/x",
    "#/$defs/a/properties/x",
    "#/definitions/a",
    "#a",
    "#/$defs/a%20b",
    "other.json",
    "https://example.com/s.json",
    "urn:x:y",
    "#/items/0",
    "",
)
_PATTERNS = ("^[a-z]+$", "^\\d+$", "(", "\\p{L}", "[", "a{2,}", "", "^\\[", "(?<name>x)")
_FORMATS = ("date-time", "email", "uri", "uuid", "ipv4", "unknown-format", "regex")
_LOOKALIKE_TEXT = (
    "42",
    "-7",
    "4.0",
    "1e3",
    "1e400",
    "007",
    " 7 ",
    "true",
    "False",
    "null",
    "[1]",
    "[",
    '{"x": "1"}',
    '{"x": [1, "2"]}',
    "{",
    "nan",
    "inf",
    "\ud800",
    '["\\udc00"]',
    "9" * 30,
    "[" * 80 + "]" * 80,
)

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(_LOOKALIKE_TEXT)
)
#: Any JSON value (also what schemas hold where they hold data: enum, const, default).
json_values: st.SearchStrategy[Any] = st.recursive(
    _json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["x", "y", "k", "a"]) | st.text(max_size=3), children)
    ),
    max_leaves=12,
)
# Values beside the ones a schema asks for: bad keyword values that a meta-schema refuses.
_odd = st.sampled_from([-1, 0, 1.5, "3", None, True, [], {}, "x", 10**30])


def _keywords(child: st.SearchStrategy[Any]) -> dict[str, st.SearchStrategy[Any]]:
    names = st.sampled_from(["x", "y", "k", "a b", "", "~/"])
    some = st.lists(child, min_size=0, max_size=3)
    return {
        "type": st.sampled_from(_TYPE_NAMES)
        | st.lists(st.sampled_from(_TYPE_NAMES), min_size=1, max_size=4)
        | st.sampled_from(["dict", "float", "any", 3]),
        "properties": st.dictionaries(names, child, max_size=4) | _odd,
        "required": st.lists(names, max_size=3) | _odd,
        "additionalProperties": child,
        "patternProperties": st.dictionaries(st.sampled_from(_PATTERNS), child, max_size=2),
        "propertyNames": child,
        "items": child | some,
        "prefixItems": some,
        "additionalItems": child,
        "contains": child,
        "anyOf": some | _odd,
        "oneOf": some,
        "allOf": some,
        "not": child,
        "if": child,
        "then": child,
        "else": child,
        "dependentSchemas": st.dictionaries(names, child, max_size=2),
        "dependentRequired": st.dictionaries(names, st.lists(names, max_size=2), max_size=2),
        "unevaluatedProperties": child,
        "enum": st.lists(json_values, max_size=4) | _odd,
        "const": json_values,
        "default": json_values,
        "examples": st.lists(json_values, max_size=2),
        "pattern": st.sampled_from(_PATTERNS) | _odd,
        "format": st.sampled_from(_FORMATS),
        "minLength": st.integers(-1, 5) | _odd,
        "maxLength": st.integers(0, 5),
        "minimum": st.integers(-5, 50) | st.floats(-10, 10),
        "maximum": st.integers(-5, 50) | _odd,
        "exclusiveMinimum": st.integers(-5, 5) | st.booleans(),
        "multipleOf": st.sampled_from([2, 0.5, 3, 0, -1, 1e-9]),
        "minItems": st.integers(0, 3),
        "maxItems": st.integers(0, 3),
        "uniqueItems": st.booleans(),
        "minProperties": st.integers(0, 2),
        "$ref": st.sampled_from(_REFS) | _odd,
        "$dynamicRef": st.sampled_from(["#a", "#"]),
        "$anchor": st.sampled_from(["a", "b", "1bad"]),
        "$id": st.sampled_from(["https://example.com/s.json", "#frag", "urn:x:y", "rel"]),
        "nullable": st.booleans(),
        "title": st.text(max_size=5),
    }


def _node(child: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    pool = _keywords(child)
    return st.booleans() | st.lists(
        st.sampled_from(sorted(pool)), min_size=0, max_size=5, unique=True
    ).flatmap(lambda keys: st.fixed_dictionaries({key: pool[key] for key in keys}))


_subschemas: st.SearchStrategy[Any] = st.recursive(
    st.sampled_from(
        [
            {},
            True,
            False,
            {"type": "integer"},
            {"type": ["string", "null"]},
            {"$ref": "#/$defs/a"},
            {"$ref": "#"},
        ]
    ),
    _node,
    max_leaves=15,
)

_DEEP_KINDS = ("properties", "items", "allOf", "anyOf", "oneOf", "not", "$ref", "prefixItems")


def deep_schema(kind: str, levels: int, leaf: Any) -> dict[str, Any]:
    """``levels`` of ``kind`` around ``leaf``, built without recursion (a ``$ref`` chain for
    ``$ref``)."""
    if kind == "$ref":
        defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(levels)}
        defs[f"d{levels}"] = leaf if isinstance(leaf, dict) else {"type": "integer"}
        return {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    schema: Any = leaf
    for _ in range(levels):
        if kind == "properties":
            schema = {"type": "object", "properties": {"x": schema}}
        elif kind == "items":
            schema = {"type": "array", "items": schema}
        elif kind == "prefixItems":
            schema = {"prefixItems": [schema, schema]}
        elif kind == "not":
            schema = {"not": {"not": schema}}
        else:
            schema = {kind: [schema]}
    return {"type": "object", "properties": {"x": schema}}


def deep_value(levels: int, leaf: Any, *, in_objects: bool) -> Any:
    """``leaf`` under ``levels`` of ``{"x": ...}`` (or ``[...]``), built without recursion."""
    value = leaf
    for _ in range(levels):
        value = {"x": value} if in_objects else [value]
    return value


@st.composite
def fuzz_schemas(draw: st.DrawFn) -> tuple[Any, ...]:
    """A recipe for any schema (:func:`make_schema` builds it): random keyword trees (bad
    keyword values, refs that resolve, cycle, dangle or leave the document), very deep and
    very wide ones, and $ref chains. Recipes keep what hypothesis prints small: it cannot
    print a 2,000-level schema (its printer recurses)."""
    shape = draw(st.sampled_from(["tree"] * 5 + ["defs"] * 3 + ["deep"] * 2 + ["wide"]))
    if shape == "deep":
        kind = draw(st.sampled_from(_DEEP_KINDS))
        levels = draw(st.sampled_from([1, 5, 50, 120, 200, 240, 300, 550, 2_000]))
        return ("deep", kind, levels, draw(_subschemas))
    if shape == "wide":
        return ("wide", draw(st.sampled_from([50, 300, 1_000])), draw(_subschemas))
    schema = draw(_subschemas)
    if shape == "defs" and isinstance(schema, dict):
        defs = draw(st.fixed_dictionaries({"a": _subschemas, "b": _subschemas}))
        dialect = draw(
            st.sampled_from(
                [
                    "https://json-schema.org/draft/2020-12/schema",
                    "http://json-schema.org/draft-07/schema#",
                    "https://example.com/unknown",
                ]
            )
        )
        return ("schema", {**schema, "$defs": defs, "$schema": dialect})
    return ("schema", schema)


def make_schema(recipe: tuple[Any, ...]) -> Any:
    """The schema a :func:`fuzz_schemas` recipe describes (a new one on every call)."""
    if recipe[0] == "deep":
        return deep_schema(recipe[1], recipe[2], recipe[3])
    if recipe[0] == "wide":
        count, child = recipe[1], recipe[2]
        return {
            "type": "object",
            "properties": {f"p{i}": child for i in range(count)},
            "required": [f"p{i}" for i in range(0, count, 7)],
        }
    return recipe[1]


@st.composite
def fuzz_arguments(draw: st.DrawFn) -> tuple[Any, ...]:
    """A recipe for what a model (or a caller) may pass as arguments (:func:`make_arguments`
    builds it): JSON values of any kind, deep ones, their JSON text, broken text, and
    non-JSON Python values."""
    kind = draw(st.sampled_from(["object", "object", "object", "text", "deep", "odd", "any"]))
    if kind == "object":
        keys = st.sampled_from(["x", "y", "k", "p0", "p7"])
        return ("value", draw(st.dictionaries(keys, json_values)))
    if kind == "deep":
        levels = draw(st.sampled_from([10, 63, 64, 65, 300, 5_000]))
        return ("deep", levels, draw(json_values), draw(st.booleans()), draw(st.booleans()))
    if kind == "text":
        value = draw(st.dictionaries(st.sampled_from(["x", "y", "k"]), json_values))
        text = json.dumps(value)
        return (
            "value",
            draw(
                st.sampled_from(
                    [text, text.encode(), text[: len(text) // 2], text + text, "", "[1]", "null"]
                )
            ),
        )
    if kind == "odd":
        return (
            "value",
            draw(
                st.sampled_from(
                    [
                        {"x": {1, 2}},
                        {"x": float("nan")},
                        {1: "a"},
                        {"x": b"bytes"},
                        {"x": (1, 2)},
                        {"x": 2**70},
                        {"x": "\ud800"},
                        bytearray(b'{"x": 1}'),
                        b"\xff\xfe",
                        None,
                        42,
                    ]
                )
            ),
        )
    return ("value", draw(json_values))


def make_arguments(recipe: tuple[Any, ...]) -> Any:
    """The arguments a :func:`fuzz_arguments` recipe describes."""
    if recipe[0] != "deep":
        return recipe[1]
    _, levels, leaf, in_objects, as_text = recipe
    if not as_text:
        return {"x": deep_value(levels, leaf, in_objects=in_objects)}
    opener, closer = ('{"x": ', "}") if in_objects else ("[", "]")
    return '{"x": ' + opener * levels + json.dumps(leaf) + closer * levels + "}"


def _shape_of(value: Any) -> list[Any]:
    """A flat record of ``value`` (types, keys, scalar reprs), iterative: two values with the
    same record are the same. For checking that a caller's arguments were not mutated."""
    record: list[Any] = []
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if isinstance(node, dict):
            record.append((kind, id(node), list(node.keys())))
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            record.append((kind, id(node), len(node)))
            stack.extend(node)
        elif isinstance(node, set | frozenset):
            record.append((kind, id(node), sorted(map(repr, node))))
        else:
            record.append((kind, repr(node)))
    return record


def fuzz_problems(
    schema: Any, arguments: list[Any], *, inject_defaults: bool
) -> tuple[bool, list[str]]:
    """Whether ``schema`` loaded, and what went wrong with it and each of its arguments.

    Loading may raise only ``SchemaError``, preparing only ``ToolArgumentError``; what
    ``prepare`` returns must be a dict the schema accepts, and the caller's arguments must
    be left as they were. Anything else is described (clipped), once per argument.
    """
    from agent_backend.errors import SchemaError, ToolArgumentError
    from agent_backend.schema import compile_schema

    try:
        compiled = compile_schema(schema)
    except SchemaError:
        return False, []
    except Exception as exc:
        problem = f"compile_schema raised {type(exc).__name__}: {str(exc)[:200]}"
        return False, [problem] * len(arguments)
    problems = []
    for given in arguments:
        before = _shape_of(given)
        try:
            out = compiled.prepare(given, None, inject_defaults)
        except ToolArgumentError:
            out = None
        except Exception as exc:
            problems.append(f"prepare raised {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if _shape_of(given) != before:
            problems.append("prepare mutated the caller's arguments")
        elif out is not None and (type(out) is not dict or not compiled.is_valid(out)):
            problems.append(f"prepare returned arguments the schema refuses: {str(out)[:200]}")
    return True, problems
