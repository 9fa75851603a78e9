"""Argument values written as bare text (GLM-4.5's ``<arg_value>``, Qwen3-Coder's ``<parameter=...>``).

Such a value has no quotes, so ``5`` may be the string ``"5"`` or the
number 5; the tool's schema decides, as vLLM's and SGLang's parsers do:

* a parameter whose schema allows a string keeps the text as it is (``"007"``
  stays ``"007"``, never ``7``: a value that already validates is not
  changed, and the schema layer coerces what fails);
* a parameter whose schema allows only other types takes the first reading
  that fits, in vLLM's order: null, integer, number, boolean, object/array
  (JSON); text that fits none stays text, for the schema layer to reject
  with a message the model can act on;
* a parameter without a schema: GLM-4.5 text that is JSON is JSON (its
  template writes non-strings with ``tojson``), other text a string;
  Qwen3-Coder keeps the text (vLLM's rule for undeclared parameters).

Booleans and null are also read as the templates' Python spellings
(``True``, ``None``): Qwen3-Coder's template writes scalars with ``| string``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_backend.schema.parse import json_type_name
from agent_backend.tools.formats._base import ToolSchemas, load_json

__all__ = ["TypeCache", "convert", "property_types", "schema_types", "tool_types"]

#: Parameter types by tool name, worked out once per parse.
TypeCache = dict[str, dict[str, "set[str] | None"]]

_NOTHING = object()


def schema_types(schema: object) -> set[str] | None:
    """The JSON types ``schema`` allows (``type``, ``enum``, ``anyOf``/``oneOf``/``allOf``), or None."""
    if not isinstance(schema, Mapping):
        return None
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("enum", "const"):
        values = schema.get(key) if key == "enum" else [schema[key]] if key in schema else None
        if isinstance(values, list):
            types.update(json_type_name(v) for v in values)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                types.update(schema_types(branch) or ())
    if not types and ("properties" in schema):
        types.add("object")
    if not types and ("items" in schema):
        types.add("array")
    return types or None


def _json(text: str) -> Any:
    try:
        return load_json(text)
    except (ValueError, RecursionError):
        return _NOTHING


def _read_as(text: str, kind: str) -> Any:
    stripped = text.strip()
    if kind == "null":
        return None if stripped in ("null", "None") else _NOTHING
    if kind == "boolean":
        lowered = stripped.lower()
        return True if lowered == "true" else False if lowered == "false" else _NOTHING
    value = _json(stripped)
    if kind == "integer":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and "." not in stripped:
            return int(value)  # 1e3
        return _NOTHING
    if kind == "number":
        return (
            value if isinstance(value, (int, float)) and not isinstance(value, bool) else _NOTHING
        )
    if kind == "object":
        return value if isinstance(value, dict) else _NOTHING
    if kind == "array":
        return value if isinstance(value, list) else _NOTHING
    return _NOTHING


_ORDER = ("null", "integer", "number", "boolean", "object", "array")


def property_types(properties: Mapping[str, Any] | None) -> dict[str, set[str] | None]:
    """The types of each parameter of a tool's ``properties`` (see :func:`schema_types`)."""
    return {key: schema_types(schema) for key, schema in (properties or {}).items()}


def convert(text: str, types: set[str] | None, *, untyped: str) -> Any:
    """The value of bare ``text`` for a parameter of ``types`` (None: no schema for it).

    ``untyped`` is what a parameter without a schema gets: ``"json"`` (JSON
    when the text is JSON) or ``"string"``.
    """
    if types is None:
        if untyped == "json":
            value = _json(text.strip())
            return text if value is _NOTHING else value
        return text
    if "string" in types:
        return text
    for kind in _ORDER:
        if kind in types:
            value = _read_as(text, kind)
            if value is not _NOTHING:
                return value
    return text


def tool_types(
    tools: ToolSchemas | None, name: str, cache: TypeCache
) -> dict[str, set[str] | None]:
    """The types each parameter of tool ``name`` allows (from ``tools``), cached in ``cache``."""
    types = cache.get(name)
    if types is None:
        schema = tools.get(name) if tools else None
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        types = cache[name] = property_types(
            properties if isinstance(properties, Mapping) else None
        )
    return types
