"""Rewrite the legacy type names real tool schemas use into JSON Schema ones.

Function-calling datasets (BFCL among them) write ``"type": "dict"``,
``"float"``, ``"tuple"`` or ``"any"``; a JSON Schema validator rejects those
or, worse, ignores them. :func:`normalize_legacy_types` maps them to the
standard names and reports every place it changed, so the loader can warn and
record what it did.

Pure and conservative: it only looks at ``type`` in *schema positions* (the
root and every subschema reached through a schema keyword) and never inside
``enum``, ``const``, ``default``, ``examples`` or property names, where
``"dict"`` is data. It never mutates its input, never guesses at a name it
does not know (that is a :class:`~agent_backend.errors.SchemaError` naming the
pointer), and never recurses deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_backend.errors import SchemaError
from agent_backend.schema.keywords import MAX_DEPTH, map_schema

__all__ = ["JSON_TYPES", "LEGACY_TYPES", "MAX_DEPTH", "normalize_legacy_types"]

#: The seven type names of JSON Schema.
JSON_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})

#: Legacy name -> JSON Schema name; ``None`` means "no type constraint".
#: Matching is case-sensitive: every BFCL schema writes these in lower case.
LEGACY_TYPES: Mapping[str, str | None] = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "bool": "boolean",
    "int": "integer",
    "str": "string",
    "any": None,
}


class _Walker:
    def __init__(self) -> None:
        self.changed: list[str] = []

    def rewrite(self, node: dict[str, Any], pointer: str) -> dict[str, Any]:
        if "type" not in node:
            return node
        here = f"{pointer}/type"
        kept, changed = self.type_value(node["type"], here)
        if changed:
            self.changed.append(here)
        if kept is None:
            del node["type"]
        else:
            node["type"] = kept
        return node

    def type_value(self, value: Any, pointer: str) -> tuple[Any, bool]:
        """The normalized ``type`` value (``None``: drop it) and whether it changed."""
        if isinstance(value, str):
            name = _standard_name(value, pointer)
            return name, name != value
        if isinstance(value, list):
            names: list[str] = []
            unconstrained = False
            for i, item in enumerate(value):
                if not isinstance(item, str):
                    raise SchemaError(
                        f"type names must be strings, got {type(item).__name__}",
                        pointer=f"{pointer}/{i}",
                    )
                name = _standard_name(item, f"{pointer}/{i}")
                if name is None:
                    unconstrained = True
                elif name not in names:
                    names.append(name)
            if unconstrained:
                return None, True
            return names, names != value
        raise SchemaError(
            f"'type' must be a string or an array of strings, got {type(value).__name__}",
            pointer=pointer,
        )


def _standard_name(name: str, pointer: str) -> str | None:
    if name in JSON_TYPES:
        return name
    if name in LEGACY_TYPES:
        return LEGACY_TYPES[name]
    known = ", ".join(sorted(JSON_TYPES | LEGACY_TYPES.keys()))
    raise SchemaError(f"unknown type name {name!r} (known: {known})", pointer=pointer)


def normalize_legacy_types(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """Return ``(new_schema, pointers)``: ``schema`` with legacy type names mapped.

    ``pointers`` are the JSON pointers (relative to ``schema``) of every
    ``type`` keyword that was rewritten or, for ``any``, removed. The input is
    never mutated; the result shares nothing with it. An unknown type name
    raises :class:`~agent_backend.errors.SchemaError` with its pointer.
    """
    walker = _Walker()
    result = map_schema(schema, walker.rewrite, max_depth=MAX_DEPTH)
    return result, tuple(walker.changed)
