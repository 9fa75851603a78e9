"""The quick check of the fast path: a common subset of JSON Schema, decided in C, never looser.

Pure: no I/O. Most tool arguments are valid as they come, and a valid dict's
cost was jsonschema-rs plus the copy (docs/validator.md). :func:`quick_valid`
builds, once per schema, a tree of C nodes (``_plain.QuickNode``, in
``_quick.c``) for the keywords most tool schemas use, and wraps the compiled
validator in ``_plain.QuickValid``: a value the tree surely accepts is valid
at once; anything else goes to the validator, which decides.

A node answers "surely valid" or "not sure", never "invalid", so the check can
only be stricter than the validator, never looser. What each keyword means
here, for the resolved schema (``refs.py``: local refs inlined, accepting
exactly what the original accepts):

* ``type``: each JSON type, with ``integer`` meaning a Python ``int`` (a whole
  float, which JSON Schema counts as an integer, is "not sure");
* ``properties``, ``required``, ``additionalProperties`` (a schema or a
  boolean), ``items`` (one schema), ``allOf``, ``anyOf``;
* ``enum``/``const``: a string, an integer, a boolean or null found among the
  members (anything else, floats included, is "not sure");
* ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``: compared
  exactly by CPython; an integer beyond 2**53 against a float bound, or an
  integer bound beyond it, is "not sure";
* ``minLength``/``maxLength`` (code points, as the validator counts),
  ``minItems``/``maxItems``, ``minProperties``/``maxProperties``;
* annotations and keywords no draft defines are ignored, as the validator
  ignores them; ``format`` is ignored where the draft makes it an annotation
  (2019-09 and later) and is "not sure" before it.

A schema whose root names a meta-schema other than its dialect's, or with a
``$schema`` anywhere below its root (a subschema the validator reads in
another draft), gets no quick check; nor does a ``required`` that names a
property twice make anything sure (jsonschema-rs's ``is_valid`` refuses what
it lists once).

Every other keyword the drafts define (``pattern``, ``oneOf``, ``not``,
``if``, ``uniqueItems``, ``multipleOf``, ``patternProperties``, a ``$ref``
kept for recursion, ...) makes its node "not sure" for every value. Deeper
than :data:`MAX_DEPTH` levels of schema a node is "not sure" too, which bounds
the C recursion; a schema of more than :data:`MAX_NODES` nodes gets no quick
check at all. ``tests/test_schema_quick.py`` holds the check to the validator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from agent_backend.schema.dialect import Dialect
from agent_backend.schema.plain import QuickNode, QuickValid

__all__ = ["MAX_DEPTH", "MAX_NODES", "quick_valid"]

#: Levels of schema the check descends; a node below is "not sure".
MAX_DEPTH = 32
#: Nodes a schema's check may have; a larger schema has none.
MAX_NODES = 4096

_NULL, _BOOL, _INT, _FLOAT, _STR, _ARRAY, _OBJECT = 1, 2, 4, 8, 16, 32, 64
_ALL = 127
_TYPES = {
    "null": _NULL,
    "boolean": _BOOL,
    "integer": _INT,
    "number": _INT | _FLOAT,
    "string": _STR,
    "array": _ARRAY,
    "object": _OBJECT,
}
_TRUE, _FALSE, _NONE = 1, 2, 4
_EXACT_INT = 2**53
_COUNT_LIMIT = 2**62

#: Keywords some draft defines that the check does not decide: their node is "not sure".
_UNDECIDED = frozenset(
    {
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "additionalItems",
        "contains",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "else",
        "if",
        "maxContains",
        "minContains",
        "multipleOf",
        "not",
        "oneOf",
        "pattern",
        "patternProperties",
        "prefixItems",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
        "uniqueItems",
    }
)
_COUNTS = (
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class _Undecided(Exception):
    """A node the check leaves to the validator."""


class _TooLarge(Exception):
    """More nodes than MAX_NODES."""


def quick_valid(
    original: Any, resolved: Any, dialect: Dialect, validator_is_valid: Callable[[Any], bool]
) -> Callable[[Any], bool]:
    """``validator_is_valid`` with the quick check in front, where the C extension is built
    and the schema has something to check quickly; else ``validator_is_valid`` itself.

    ``original`` is the schema as given, ``resolved`` and ``dialect`` its resolution
    (``refs.resolve_schema``), from which the check is built.
    """
    if QuickNode is None or QuickValid is None or not isinstance(resolved, dict):
        return validator_is_valid
    if _names_a_draft_below_its_root(original):
        return validator_is_valid
    declared = resolved.get("$schema")
    if declared is not None and (
        not isinstance(declared, str) or declared.rstrip("#") != dialect.meta_schema_uri.rstrip("#")
    ):
        return validator_is_valid  # a meta-schema the validator may read another way
    builder = _Builder(dialect)
    try:
        root = builder.node(resolved, 0)
    except _TooLarge:
        return validator_is_valid
    if root is builder.never:
        return validator_is_valid
    wrapped: Callable[[Any], bool] = QuickValid(root, validator_is_valid)
    return wrapped


def _names_a_draft_below_its_root(schema: Any) -> bool:
    """Whether a subschema names a ``$schema`` of its own. jsonschema-rs then reads that
    subschema in that draft (``format`` asserts in draft 7, ``$ref`` siblings apply in
    2019-09), which the resolved schema, in the root's draft, does not say."""
    stack: list[Iterable[Any]] = [schema.values()] if isinstance(schema, dict) else []
    while stack:
        for node in stack.pop():
            if isinstance(node, dict):
                if "$schema" in node:
                    return True
                stack.append(node.values())
            elif isinstance(node, list):
                stack.append(node)
    return False


def _node(
    *,
    trivial: bool = False,
    types: int = _ALL,
    names: tuple[str, ...] = (),
    nodes: tuple[Any, ...] = (),
    needed: bytes = b"",
    others: tuple[str, ...] = (),
    extra: Any = None,
    items: Any = None,
    has_enum: bool = False,
    enum_strs: frozenset[str] = frozenset(),
    enum_ints: frozenset[int] = frozenset(),
    enum_flags: int = 0,
    bounds: tuple[Any, Any, Any, Any] = (None, None, None, None),
    counts: tuple[int, int, int, int, int, int] = (0, -1, 0, -1, 0, -1),
    any_of: tuple[Any, ...] | None = None,
    all_of: tuple[Any, ...] | None = None,
) -> Any:
    assert QuickNode is not None
    return QuickNode(
        trivial,
        types,
        names,
        nodes,
        needed,
        others,
        frozenset(names),
        extra,
        items,
        has_enum,
        enum_strs,
        enum_ints,
        enum_flags,
        *bounds,
        *counts,
        any_of,
        all_of,
    )


class _Builder:
    def __init__(self, dialect: Dialect) -> None:
        self.format_is_annotation = dialect in (Dialect.DRAFT2019_09, Dialect.DRAFT2020_12)
        self.items_may_be_array = dialect is not Dialect.DRAFT2020_12
        self.trivial = _node(trivial=True)
        self.never = _node(types=0)
        self.count = 0
        self.built: dict[int, Any] = {}  # id(subschema) -> its node (refs copy subschemas)

    def node(self, schema: Any, depth: int) -> Any:
        if schema is True:
            return self.trivial
        if not isinstance(schema, dict) or depth >= MAX_DEPTH:
            return self.never
        known = self.built.get(id(schema))
        if known is not None:
            return known
        self.count += 1
        if self.count > MAX_NODES:
            raise _TooLarge
        try:
            made = self._build(schema, depth + 1)
        except _Undecided:
            made = self.never
        self.built[id(schema)] = made
        return made

    def _build(self, schema: dict[str, Any], depth: int) -> Any:
        if any(keyword in _UNDECIDED for keyword in schema):
            raise _Undecided
        if "format" in schema and not self.format_is_annotation:
            raise _Undecided
        fields: dict[str, Any] = {}
        types = self._types(schema)
        if "enum" in schema or "const" in schema:
            self._members(schema, fields)
        bounds = tuple(_bound(schema.get(name)) for name in _BOUNDS)
        if any(isinstance(b, int) and abs(b) > _EXACT_INT for b in bounds):
            types &= ~(_INT | _FLOAT)  # numbers here are the validator's to compare
        if any(b is not None for b in bounds):
            fields["bounds"] = bounds
        counts = tuple(c for low, high in _COUNTS for c in _counts(schema, low, high))
        if counts != (0, -1, 0, -1, 0, -1):
            fields["counts"] = counts
        self._object(schema, depth, fields)
        if "items" in schema:
            items = schema["items"]
            if isinstance(items, list) and self.items_may_be_array:
                raise _Undecided
            node = self.node(items, depth)
            if node is not self.trivial:
                fields["items"] = node
        for keyword, field in (("allOf", "all_of"), ("anyOf", "any_of")):
            if keyword in schema:
                branches = schema[keyword]
                if not isinstance(branches, list) or not branches:
                    raise _Undecided
                fields[field] = tuple(self.node(branch, depth) for branch in branches)
        if types == _ALL and not fields:
            return self.trivial
        return _node(types=types, **fields)

    def _types(self, schema: dict[str, Any]) -> int:
        if "type" not in schema:
            return _ALL
        declared = schema["type"]
        names = declared if isinstance(declared, list) else [declared]
        types = 0
        for name in names:
            if not isinstance(name, str) or name not in _TYPES:
                raise _Undecided
            types |= _TYPES[name]
        return types

    def _members(self, schema: dict[str, Any], fields: dict[str, Any]) -> None:
        """``enum`` and ``const``; with both, a value must be a member and the constant."""
        if "enum" in schema and not isinstance(schema["enum"], list):
            raise _Undecided
        lists = [
            schema[k] if k == "enum" else [schema[k]] for k in ("enum", "const") if k in schema
        ]
        strings, ints, flags = _member_sets(lists[0])
        for members in lists[1:]:
            more_strings, more_ints, more_flags = _member_sets(members)
            strings, ints, flags = strings & more_strings, ints & more_ints, flags & more_flags
        fields.update(has_enum=True, enum_strs=strings, enum_ints=ints, enum_flags=flags)

    def _object(self, schema: dict[str, Any], depth: int, fields: dict[str, Any]) -> None:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise _Undecided
        if any(type(name) is not str for name in (*properties, *required)):
            raise _Undecided
        if len(set(required)) != len(required):
            # jsonschema-rs's is_valid refuses {"a": 1} for "required": ["a", "a"] (where a
            # meta-schema check let the duplicate through); its verdict is the one that counts.
            raise _Undecided
        wanted = set(required)
        names = tuple(properties)
        if names:
            fields["names"] = names
            fields["nodes"] = tuple(self.node(properties[name], depth) for name in names)
            fields["needed"] = bytes(name in wanted for name in names)
        others = tuple(sorted(wanted.difference(properties)))
        if others:
            fields["others"] = others
        if "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            if extra is False:
                fields["extra"] = False
            elif extra is not True:
                node = self.node(extra, depth)
                if node is not self.trivial:
                    fields["extra"] = node


def _member_sets(members: list[Any]) -> tuple[frozenset[str], frozenset[int], int]:
    """The string members, the integer members and the flags of true, false and null that a
    node looks values up in (any other member is the validator's to compare)."""
    flags = 0
    for member, flag in ((True, _TRUE), (False, _FALSE), (None, _NONE)):
        if any(m is member for m in members):
            flags |= flag
    return (
        frozenset(m for m in members if type(m) is str),
        frozenset(m for m in members if type(m) is int),
        flags,
    )


def _bound(value: Any) -> int | float | None:
    if value is None:
        return None
    if type(value) not in (int, float):  # draft 4's boolean exclusiveMinimum, say
        raise _Undecided
    return value  # type: ignore[no-any-return]


def _counts(schema: dict[str, Any], low: str, high: str) -> tuple[int, int]:
    return _count(schema.get(low), 0), _count(schema.get(high), -1)


def _count(value: Any, absent: int) -> int:
    if value is None:
        return absent
    if type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= _COUNT_LIMIT:
        raise _Undecided
    return value
