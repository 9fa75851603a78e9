"""The strict variant of an argument schema: the form OpenAI's strict mode accepts.

OpenAI strict function calling (``"strict": true``, and the Agents SDK's
``FunctionTool(strict_json_schema=True)``) takes a subset of JSON Schema: every
object closed (``additionalProperties: false``) with every property required,
every value typed, no ``allOf``/``not``/``if``, no object with free keys, and
few other keywords. :func:`strict_schema` writes that variant of a schema.

The canonical schema stays the one calls are checked against; the variant is
only what a strict client is shown. Two repair rules (``coerce.py``) read a
call written against the variant back into the canonical call:

* an optional property is required and nullable in the variant; null for a
  property whose canonical schema refuses null means it was left out;
* a map (an ``additionalProperties`` schema and no ``properties``) is a list of
  ``{"name": ..., "value": ...}`` pairs in the variant, read back into the object.

So a strict call means what the canonical call means. What the subset cannot
say (``minLength``, ``propertyNames``, ``default``, ``examples``,
``if``/``then``/``else``...) is left out of the variant and still checked by
the canonical schema: a call that breaks it gets the usual message. ``oneOf``
becomes ``anyOf``. A schema with no strict form (an untyped value, an object
with free keys and untyped values, a tuple, ``allOf``, nesting deeper than
OpenAI allows) raises :class:`~agent_backend.errors.SchemaError`.

Pure: no I/O; never mutates its input, and shares no mutable object with it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

from agent_backend.errors import SchemaError
from agent_backend.schema.coerce_rules import is_map
from agent_backend.schema.keywords import escape_pointer
from agent_backend.schema.refs import resolve_schema

__all__ = ["STRICT_FORMATS", "strict_schema"]

#: String formats strict mode accepts; any other ``format`` is left out of the variant.
STRICT_FORMATS: Final = frozenset(
    ("date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid")
)
_ANNOTATIONS: Final = ("description",)
_NUMBER_KEYWORDS: Final = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
)
_KEPT_BY_TYPE: Final = {
    "number": _NUMBER_KEYWORDS,
    "integer": _NUMBER_KEYWORDS,
    "array": ("minItems", "maxItems"),
}
_LOOKAROUND: Final = ("(?=", "(?!", "(?<=", "(?<!")
_VALUE_KEYWORDS: Final = frozenset(("type", "enum", "const", "anyOf"))
#: OpenAI's limit on nested objects in one strict schema (its definitions count apart).
MAX_OBJECT_DEPTH: Final = 10
PAIRS_NOTE: Final = 'Given as a list of {"name": ..., "value": ...} pairs, one per entry.'


def strict_schema(schema: Mapping[str, Any], *, source: str | None = None) -> dict[str, Any]:
    """The strict variant of the arguments schema ``schema`` (see the module docstring).

    Local ``$ref``\\ s are inlined first (recursive ones stay, under ``$defs``).
    Raises :class:`SchemaError` naming the place (a pointer into the resolved
    schema) when part of it has no strict form.
    """
    resolution = resolve_schema(schema, source=source)
    if resolution.external_refs:
        first = resolution.external_refs[0]
        raise SchemaError(
            f"no strict variant: external $ref {first.ref!r}", source=source, pointer=first.pointer
        )
    root = resolution.schema
    writer = _Writer(source)
    if not isinstance(root, dict):
        raise SchemaError(
            "no strict variant: the arguments schema must be an object", source=source
        )
    declared = root.get("type", "object")
    if declared not in ("object", ["object"]):
        raise SchemaError(
            f"no strict variant: the arguments must be a plain object, not type {declared!r}",
            source=source,
            pointer="/type",
        )
    if not isinstance(root.get("properties"), dict):
        # A tool without parameters often says only {"type": "object"}: it takes nothing.
        root = {**root, "properties": {}, "additionalProperties": False}
    strict = writer.node({**root, "type": "object"}, "", depth=0)
    defs_keyword = resolution.dialect.defs_keyword
    defs = root.get(defs_keyword)
    if isinstance(defs, dict) and defs:
        strict[defs_keyword] = {
            name: writer.node(definition, f"/{defs_keyword}/{escape_pointer(name)}", depth=0)
            for name, definition in defs.items()
        }
    return strict


class _Writer:
    def __init__(self, source: str | None) -> None:
        self.source = source

    def fail(self, message: str, pointer: str) -> SchemaError:
        return SchemaError(f"no strict variant: {message}", source=self.source, pointer=pointer)

    def node(self, node: Any, pointer: str, *, depth: int) -> dict[str, Any]:
        if not isinstance(node, dict):
            raise self.fail("a boolean schema has no strict form; give it a type", pointer)
        annotations = {key: node[key] for key in _ANNOTATIONS if key in node}  # not title
        if "$ref" in node:
            # What resolution kept: a reference to a recursive definition.
            target = {"$ref": node["$ref"]}
            return {"anyOf": [target], **annotations} if annotations else target
        if "allOf" in node:
            raise self.fail("allOf has no strict form", pointer)
        if "anyOf" in node and "oneOf" in node:
            raise self.fail("anyOf beside oneOf has no strict form", pointer)
        out: dict[str, Any] = dict(annotations)
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list):
                out["anyOf"] = [
                    self.node(branch, f"{pointer}/{key}/{index}", depth=depth)
                    for index, branch in enumerate(branches)
                ]
        if "const" in node:
            out["const"] = copy.deepcopy(node["const"])
        if isinstance(node.get("enum"), list):
            out["enum"] = copy.deepcopy(node["enum"])
        declared = node.get("type")
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list):
            if "anyOf" in out or "const" in out or "enum" in out:
                return out
            raise self.fail("a value without a type has no strict form", pointer)
        if "object" in types and is_map(node):
            if types != ["object"]:
                raise self.fail(f"a map that may also be {types} has no strict form", pointer)
            return self.pairs(node, pointer, depth=depth)
        out["type"] = types[0] if len(types) == 1 else list(types)
        for kind in types:
            for key in _KEPT_BY_TYPE.get(kind, ()):
                if key in node:
                    out[key] = node[key]
        if "string" in types:
            pattern = node.get("pattern")
            if isinstance(pattern, str) and not any(token in pattern for token in _LOOKAROUND):
                out["pattern"] = pattern
            if node.get("format") in STRICT_FORMATS:
                out["format"] = node["format"]
        if "object" in types:
            out.update(self.object(node, pointer, depth=depth + 1))
        if "array" in types:
            if "prefixItems" in node or isinstance(node.get("items"), list):
                raise self.fail("a tuple (prefixItems) has no strict form", pointer)
            if "items" not in node:
                raise self.fail("an array without items has no strict form", pointer)
            out["items"] = self.node(node["items"], f"{pointer}/items", depth=depth)
        return out

    def object(self, node: dict[str, Any], pointer: str, *, depth: int) -> dict[str, Any]:
        if depth > MAX_OBJECT_DEPTH:
            raise self.fail(f"objects nested deeper than {MAX_OBJECT_DEPTH} levels", pointer)
        properties = node.get("properties")
        if not isinstance(properties, dict):
            if node.get("additionalProperties") is not False:
                raise self.fail(
                    "an object with free keys and untyped values has no strict form", pointer
                )
            properties = {}
        required = node.get("required")
        required = set(required) if isinstance(required, list) else set()
        strict_properties = {}
        for key, schema in properties.items():
            child = self.node(schema, f"{pointer}/properties/{escape_pointer(key)}", depth=depth)
            strict_properties[key] = child if key in required else _nullable(child)
        # Keys beyond the declared ones (additionalProperties, patternProperties) cannot be
        # sent in strict mode; the variant offers the declared ones.
        return {
            "properties": strict_properties,
            "required": list(strict_properties),
            "additionalProperties": False,
        }

    def pairs(self, node: dict[str, Any], pointer: str, *, depth: int) -> dict[str, Any]:
        if depth + 1 > MAX_OBJECT_DEPTH:
            raise self.fail(f"objects nested deeper than {MAX_OBJECT_DEPTH} levels", pointer)
        name: dict[str, Any] = {"type": "string"}
        names = node.get("propertyNames")
        pattern = names.get("pattern") if isinstance(names, dict) else None
        if isinstance(pattern, str) and not any(token in pattern for token in _LOOKAROUND):
            name["pattern"] = pattern
        value = self.node(
            node["additionalProperties"], f"{pointer}/additionalProperties", depth=depth + 1
        )
        description = node.get("description")
        return {
            "description": f"{description} {PAIRS_NOTE}" if description else PAIRS_NOTE,
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": name, "value": value},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
        }


def _admits_null(node: dict[str, Any]) -> bool:
    """Whether every assertion of a strict node (type, enum, const, anyOf) lets null through."""
    if "$ref" in node or not _VALUE_KEYWORDS & node.keys():
        return False
    declared = node.get("type")
    if declared not in (None, "null") and not (isinstance(declared, list) and "null" in declared):
        return False
    if "enum" in node and None not in node["enum"]:
        return False
    if "const" in node and node["const"] is not None:
        return False
    branches = node.get("anyOf")
    return not isinstance(branches, list) or any(_admits_null(branch) for branch in branches)


def _nullable(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` that also admits null: how the variant writes an optional property."""
    if _admits_null(node):
        return node
    if "const" in node or not _VALUE_KEYWORDS & node.keys():
        annotations = {key: node[key] for key in _ANNOTATIONS if key in node}
        inner = {key: value for key, value in node.items() if key not in _ANNOTATIONS}
        return {"anyOf": [inner, {"type": "null"}], **annotations}
    nullable = dict(node)
    declared = node.get("type")
    if declared is not None:
        listed = declared if isinstance(declared, list) else [declared]
        nullable["type"] = listed if "null" in listed else [*listed, "null"]
    if "enum" in node and None not in node["enum"]:
        nullable["enum"] = [*node["enum"], None]
    branches = node.get("anyOf")
    if isinstance(branches, list) and not any(_admits_null(branch) for branch in branches):
        nullable["anyOf"] = [*branches, {"type": "null"}]
    return nullable
