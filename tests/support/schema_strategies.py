"""Hypothesis strategies for instances of the (resolved) schemas the property tests use.

A small generator for the keywords those schemas contain: type, properties,
required, additionalProperties, items, anyOf/oneOf, enum/const and ``$ref``
into the root's retained defs. It is not a general JSON Schema generator;
generated instances are filtered through the real validator anyway.
"""

from __future__ import annotations

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
