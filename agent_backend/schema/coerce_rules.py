"""The value-level rules of repair: string-to-scalar conversions, JSON type tests, JSON equality.

Pure: no I/O, no schema walking (``coerce.py`` compiles schema nodes into
repair functions that call these). A rule takes stripped text and returns the
converted value or :data:`FAIL`; it never converts lossily (``"1.5"`` is not
an integer) and never yields NaN or an infinity.
"""

from __future__ import annotations

import decimal
import functools
import math
import re
from collections.abc import Callable, Collection
from typing import Any, Final, NamedTuple

from agent_backend.schema.parse import json_type_name

__all__ = [
    "CONVERSION_ORDER",
    "FAIL",
    "MAX_NUMBER_TEXT",
    "PAIR_KEYS",
    "PYTHON_TYPES",
    "TEXT_RULES",
    "TYPE_ONLY_KEYS",
    "TypePlan",
    "compile_patterns",
    "from_pairs",
    "is_map",
    "json_equal",
    "member_test",
    "to_boolean",
    "to_integer",
    "to_null",
    "to_number",
    "type_allowed",
    "type_plan",
]

FAIL: Final = object()
"""What a rule returns when the text is not a value of its kind."""

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
MAX_NUMBER_TEXT: Final = 400  # far below int()'s digit limit, so int() of matched text cannot fail
_BOOLEANS = {"true": True, "false": False, "True": True, "False": False}

#: The kinds a string converts to (a type list tries them in its own order; an enum, in its members' order).
CONVERSION_ORDER: Final = ("integer", "number", "boolean", "null", "object", "array")

PYTHON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}
_PLAIN_TYPES: Final = (str, int, float, bool, type(None), dict, list)
_OPENERS: Final = (("object", "{", dict), ("array", "[", list))

#: Keys of a node whose only assertion is ``type`` (the rest are annotations).
TYPE_ONLY_KEYS: Final = frozenset(
    ("type", "title", "description", "default", "examples", "$comment", "deprecated")
)


class TypePlan(NamedTuple):
    """What a ``type`` keyword means for repair, worked out once per distinct list of types."""

    allowed: frozenset[type]
    """The plain Python types whose every value the types allow."""
    refused: frozenset[type]
    """The plain Python types none of whose values they allow. A float is in neither set for
    ``integer`` without ``number`` (``1.0`` is an integer, ``1.5`` is not); subclasses
    (``IntEnum``) are in neither: both take :func:`type_allowed`."""
    rules: tuple[Callable[[str], Any], ...]
    """The string-to-scalar rules the types ask for, in the order the types are listed (only
    ``integer`` and ``number`` ever both convert one text: ``"4.0"`` is ``4`` or ``4.0``)."""
    openers: tuple[tuple[str, type], ...]
    """The containers the types ask for, in the order listed: (first character, type)."""


@functools.lru_cache(maxsize=256)  # schemas share a few distinct type lists
def type_plan(types: tuple[str, ...]) -> TypePlan:
    """The plan of a ``type`` keyword; ``types`` in the order the schema lists them."""
    allowed = frozenset(python for name in types for python in PYTHON_TYPES.get(name, ()))
    refused = frozenset(
        python
        for python in _PLAIN_TYPES
        if python not in allowed and not (python is float and "integer" in types)
    )
    rules = tuple(TEXT_RULES[kind] for kind in types if kind in TEXT_RULES)
    openers = tuple(
        (opener, wanted) for kind in types for name, opener, wanted in _OPENERS if name == kind
    )
    return TypePlan(allowed, refused, rules, openers)


def type_allowed(value: Any, types: Collection[str]) -> bool:
    """Whether a JSON value is of one of ``types`` (an integral float is an integer)."""
    kind = json_type_name(value)
    if kind in types:
        return True
    if kind == "integer":
        return "number" in types
    return kind == "number" and "integer" in types and float(value).is_integer()


# ``str.isdecimal`` is exactly the regex ``\d`` (Unicode category Nd), and ``int()`` and
# ``float()`` read every such digit: the common forms below take no regex.
_SIGNS: Final = ("-", "+")


def to_integer(text: str) -> Any:
    if len(text) > MAX_NUMBER_TEXT:
        return FAIL
    if text.isdecimal() or (text[:1] in _SIGNS and text[1:].isdecimal()):
        return int(text)
    if not _NUMBER.fullmatch(text):
        return FAIL
    try:
        exact = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return FAIL
    if abs(exact.adjusted()) > MAX_NUMBER_TEXT or exact != exact.to_integral_value():
        return FAIL
    return int(exact)


def to_number(text: str) -> Any:
    if len(text) > MAX_NUMBER_TEXT:
        return FAIL
    whole, dot, fraction = text.partition(".")
    if whole.isdecimal() or (whole[:1] in _SIGNS and whole[1:].isdecimal()):
        if not dot:
            return int(text)
        if not fraction.isdecimal() and not _NUMBER.fullmatch(text):
            return FAIL
    elif not _NUMBER.fullmatch(text):
        return FAIL
    number = float(text)
    return number if math.isfinite(number) else FAIL


def to_boolean(text: str) -> Any:
    return _BOOLEANS.get(text, FAIL)


def to_null(text: str) -> Any:
    return None if text == "null" else FAIL


#: The string-to-scalar rules, in :data:`CONVERSION_ORDER` (containers are parsed apart).
TEXT_RULES: Final[dict[str, Callable[[str], Any]]] = {
    "integer": to_integer,
    "number": to_number,
    "boolean": to_boolean,
    "null": to_null,
}


def compile_patterns(patterns: dict[str, Any]) -> list[tuple[re.Pattern[str], Any]]:
    compiled = []
    for pattern, schema in patterns.items():
        try:
            compiled.append((re.compile(pattern), schema))
        except re.error:  # an ECMA-only construct: repair skips it, validation still applies it
            continue
    return compiled


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema means it: ``1 == 1.0`` but ``true != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


_KEY_KINDS: Final = {bool: 0, int: 1, float: 1, str: 2, type(None): 3}


def _member_key(value: Any) -> tuple[int, Any] | None:
    """A hashable key equal for two scalars exactly when :func:`json_equal` says they are
    equal (exact scalar types only; NaN has none: it equals nothing)."""
    kind = _KEY_KINDS.get(type(value))
    if kind is None or value != value:
        return None
    return kind, value


def member_test(members: list[Any]) -> Callable[[Any], bool]:
    """``lambda value: any(json_equal(value, m) for m in members)``, by a set lookup for the
    scalar members (an ``enum`` of a few strings or numbers is checked on every repair)."""
    keys = set()
    others = []
    for member in members:
        key = _member_key(member)
        if key is None:
            others.append(member)
        else:
            keys.add(key)

    def is_member(value: Any) -> bool:
        key = _member_key(value)
        if key is None:  # a container, a subclass, NaN: compared with every member
            return any(json_equal(value, member) for member in members)
        return key in keys or any(json_equal(value, member) for member in others)

    return is_member


#: The keys of one entry of a map written as a list of pairs (the strict variant's form, strict.py).
PAIR_KEYS: Final = frozenset(("name", "value"))


def is_map(node: Any) -> bool:
    """Whether ``node`` is a map: an object with free keys whose values one schema describes.

    That is ``type`` naming object, no ``properties`` or ``patternProperties``, and an
    ``additionalProperties`` schema. Strict clients cannot send such an object; the strict
    variant writes it as a list of ``{"name", "value"}`` pairs (:func:`from_pairs` reads them).
    """
    if not isinstance(node, dict) or not isinstance(node.get("additionalProperties"), dict):
        return False
    declared = node.get("type")
    types = declared if isinstance(declared, list) else (declared,)
    return "object" in types and not node.get("properties") and not node.get("patternProperties")


def from_pairs(value: Any) -> Any:
    """The object a list of ``{"name": ..., "value": ...}`` pairs spells, or :data:`FAIL`.

    Every entry must have exactly those two keys and a string name, and no name may repeat
    (which value was meant would be a guess).
    """
    if type(value) is not list:
        return FAIL
    mapping: dict[str, Any] = {}
    for entry in value:
        if type(entry) is not dict or entry.keys() != PAIR_KEYS:
            return FAIL
        name = entry["name"]
        if type(name) is not str or name in mapping:
            return FAIL
        mapping[name] = entry["value"]
    return mapping
