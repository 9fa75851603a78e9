"""Where JSON Schema keeps subschemas: the one table every schema walker here uses.

Pure: no I/O. A walker that treats ``enum``, ``const``, ``default``,
``examples`` or property names as schemas corrupts data, so every walk over
schema positions (ref resolution, legacy type names, integer guards) goes
through :func:`subschema_shape` or :func:`map_schema`, never its own list.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from agent_backend.errors import SchemaError

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_DEPTH",
    "MAX_JSON_NODES",
    "check_json_shape",
    "escape_pointer",
    "iter_schema_nodes",
    "map_schema",
    "steps_into_child",
    "subschema_shape",
]

#: Deepest subschema nesting any walker accepts; deeper schemas are refused, not truncated.
MAX_DEPTH = 256
#: Deepest nesting of objects and arrays a schema document may have, checked without recursion
#: before anything recursive (a copy, the compiler) sees it: a subschema level is one or two
#: containers (``items``: one; ``properties``: two), and the compiler refuses ~240 levels
#: of ``properties`` on its own. Deeper documents raised RecursionError from copying.
MAX_JSON_DEPTH = 400
#: Most objects and arrays a schema document may hold (shared ones counted each time they
#: are reached: a document that shares subtrees to explode is refused, not walked).
MAX_JSON_NODES = 1_000_000


def check_json_shape(
    value: Any,
    *,
    source: str | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    max_nodes: int = MAX_JSON_NODES,
) -> None:
    """Refuse a schema document nested deeper than ``max_depth`` containers, or holding more
    than ``max_nodes``, with a :class:`SchemaError`; iterative, so no depth or cycle (a
    dict that contains itself) can overflow the stack. Bounded: at most ``max_nodes``
    containers are visited."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        seen += 1
        if depth > max_depth:
            raise SchemaError(
                f"the schema nests objects and arrays deeper than {max_depth} levels",
                source=source,
            )
        if seen > max_nodes:
            raise SchemaError(
                f"the schema holds more than {max_nodes} objects and arrays", source=source
            )
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, Mapping | list | tuple)
        )


# Keywords whose values hold subschemas, by shape. The flag says whether the
# subschema applies to a child instance (an element, a property value, a
# property name); a ref cycle through such a keyword is a legal recursive
# schema, a cycle through the others re-applies to the same instance forever.
ONE_SCHEMA = {
    "additionalProperties": True,
    "additionalItems": True,
    "items": True,
    "contains": True,
    "propertyNames": True,
    "unevaluatedItems": True,
    "unevaluatedProperties": True,
    "contentSchema": True,
    "if": False,
    "then": False,
    "else": False,
    "not": False,
}
SCHEMA_LIST = {"allOf": False, "anyOf": False, "oneOf": False, "prefixItems": True, "items": True}
SCHEMA_MAP = {
    "properties": True,
    "patternProperties": True,
    "dependentSchemas": False,
    "dependencies": False,
    "$defs": False,
    "definitions": False,
}


def escape_pointer(token: str | int) -> str:
    """One JSON pointer token (RFC 6901)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def subschema_shape(key: str, value: Any) -> str | None:
    """How ``value`` holds subschemas under keyword ``key``: "one", "list", "map" or None (data).

    In a "map", only the mapping's values that are objects or booleans are
    schemas (draft 7 ``dependencies`` also holds arrays of names).
    """
    if key in SCHEMA_MAP:
        return "map" if isinstance(value, Mapping) else None
    if key in SCHEMA_LIST and isinstance(value, list | tuple):
        return "list"
    if key in ONE_SCHEMA and isinstance(value, Mapping | bool):
        return "one"
    return None


def steps_into_child(key: str) -> bool:
    """Whether the subschemas under ``key`` apply to a child instance, not the instance itself."""
    return ONE_SCHEMA.get(key) or SCHEMA_LIST.get(key) or SCHEMA_MAP.get(key) or False


def map_schema(
    schema: Any,
    rewrite: Callable[[dict[str, Any], str], dict[str, Any]],
    *,
    max_depth: int = MAX_DEPTH,
) -> Any:
    """A deep copy of ``schema`` whose every object node went through ``rewrite``, parents first.

    ``rewrite(node, pointer)`` gets a shallow copy of the node that it may
    change and returns the node to keep; the subschemas of what it returns
    are walked next. Booleans and malformed nodes are copied as they are.
    """

    def walk(node: Any, pointer: str, depth: int) -> Any:
        if not isinstance(node, Mapping):
            return copy.deepcopy(node)
        if depth > max_depth:
            raise SchemaError(f"schema nested deeper than {max_depth} levels", pointer=pointer)
        out: dict[str, Any] = {}
        for key, value in rewrite(dict(node), pointer).items():
            here = f"{pointer}/{escape_pointer(key)}"
            shape = subschema_shape(key, value)
            if shape == "one":
                out[key] = walk(value, here, depth + 1)
            elif shape == "list":
                out[key] = [walk(v, f"{here}/{i}", depth + 1) for i, v in enumerate(value)]
            elif shape == "map":
                out[key] = {
                    name: walk(sub, f"{here}/{escape_pointer(name)}", depth + 1)
                    if isinstance(sub, Mapping | bool)
                    else copy.deepcopy(sub)
                    for name, sub in value.items()
                }
            else:
                out[key] = copy.deepcopy(value)
        return out

    return walk(schema, "", 0)


def iter_schema_nodes(schema: Any) -> Iterator[Mapping[str, Any]]:
    """Every object node of ``schema`` in schema positions (iterative, any order)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        yield node
        for key, value in node.items():
            shape = subschema_shape(key, value)
            if shape == "one":
                stack.append(value)
            elif shape == "list":
                stack.extend(value)
            elif shape == "map":
                stack.extend(value.values())
