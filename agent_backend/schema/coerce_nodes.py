"""The shapes of compiled repair functions: one per common kind of schema node.

Pure: no I/O. ``coerce.py`` compiles each schema node into a :data:`Fix`;
for the common shapes it picks a function from here that short-cuts the
generic path for the values those nodes see most (an ``integer`` node given a
numeric string, an object node given an object) and hands every other value
to the generic path, so the result is always the same. These run on every
repair: closure variables, no attribute lookups, no work a node does not need.

With the C extension built, the most common (:func:`type_fix`,
:func:`object_fix`, :func:`array_fix`, :func:`null_left_out`, :func:`member_fix`,
and the JSON parser :func:`json_parse`) return
its objects (``_repair.c``), each standing for the Python function built here:
they handle the common values without a Python frame and hand every other
value to that function, so the results are the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Final

import orjson

from agent_backend.schema import plain
from agent_backend.schema.coerce_rules import (
    FAIL,
    MAX_NUMBER_TEXT,
    TEXT_RULES,
    type_plan,
)

__all__ = [
    "LEAVE_OUT",
    "Accepts",
    "AcceptsOf",
    "Fix",
    "IsValid",
    "Step",
    "array_fix",
    "container_fix",
    "json_parse",
    "keep",
    "member_fix",
    "null_left_out",
    "object_descend",
    "object_fix",
    "properties_descend",
    "type_fix",
    "union_fix",
]

IsValid = Callable[[Any, Any], bool]
AcceptsOf = Callable[[Any], Callable[[Any], bool]]
"""``accepts_of(node)``: the function that tells whether ``node`` accepts a value (its
validator's ``is_valid``), asked for once per node, on its first check."""
Fix = Callable[[Any, int, bool], Any]
"""A compiled node: ``fix(value, depth, check)`` is ``value`` repaired (the same object if
nothing changed); ``check`` first keeps a container that the node already accepts."""
Step = Callable[[Any, int], Any]
"""One part of a node's repair: ``step(value, depth)``."""
Accepts = Callable[[Any], bool]

_CONTAINERS: Final = (dict, list)
Parse = Callable[[str, str, type, int], Any]
"""``parse(text, opener, wanted, depth)``: JSON text as a ``wanted`` container, or ``FAIL``."""


#: Fewer integer digits than this keep ``float()`` finite (the largest double is about 1.8e308).
_FINITE_DIGITS: Final = 300

LEAVE_OUT: Final = object()
"""What a property's function returns when the property is to be left out of its object."""

# The C nodes, or None (not built; tests set them to None to compare both).
_NumericFix = plain.NumericFix
_ScalarFix = plain.ScalarFix
_ObjectFix = plain.ObjectFix
_ArrayFix = plain.ArrayFix
_NullLeftOut = plain.NullLeftOut
_TypedFix = plain.TypedFix
_MemberFix = plain.MemberFix
_JsonParse = plain.JsonParse
if plain.set_sentinels is not None:
    plain.set_sentinels(LEAVE_OUT, FAIL)


def keep(value: Any, depth: int, check: bool) -> Any:
    """The compiled form of a node that repairs nothing; parents leave such children out."""
    return value


def null_left_out(fix: Fix) -> Fix:
    """An optional property whose schema refuses null: null means the property is absent.

    Strict clients must send every property, so they send null for the ones they mean to
    leave out (strict.py); the object is repaired by leaving the property out.
    """

    def fix_or_leave_out(value: Any, depth: int, check: bool) -> Any:
        return LEAVE_OUT if value is None else fix(value, depth, check)

    if _NullLeftOut is not None:
        return _NullLeftOut(fix, fix_or_leave_out)
    return fix_or_leave_out


def type_fix(types: tuple[str, ...], convert: Step, parse: Parse | None = None) -> Fix:
    """A node whose only repair is its own ``type`` (``convert``): no children, no unions.

    ``parse`` is the parser ``convert`` reads JSON-encoded containers with (the C node
    calls it itself)."""
    allowed, _, rules, openers = type_plan(types)
    if "object" in types or "array" in types:
        # Nothing inside to repair: a container of an allowed type is kept, valid or not.

        def fix_typed(value: Any, depth: int, check: bool) -> Any:
            return value if type(value) in allowed else convert(value, depth)

        if _TypedFix is not None and parse is not None:
            wrap = "array" in types
            return _TypedFix(tuple(allowed), rules, openers, wrap, parse, fix_typed)
        return fix_typed
    if len(rules) == 1 and (rules[0] is TEXT_RULES["integer"] or rules[0] is TEXT_RULES["number"]):
        as_number = rules[0] is TEXT_RULES["number"]
        numeric_rule = rules[0]

        def fix_numeric(value: Any, depth: int, check: bool) -> Any:
            kind = type(value)
            if kind in allowed:
                return value
            if kind is not str:
                return convert(value, depth)
            text = value.strip()
            # The numeric rules' common cases, without the call: ``"12"``, and ``"9.5"`` for
            # a number (unsigned digits around one dot: finite within the length bound).
            if len(text) <= MAX_NUMBER_TEXT:
                if text.isdecimal():
                    return int(text)
                if as_number:
                    whole, _, fraction = text.partition(".")
                    if whole.isdecimal() and fraction.isdecimal() and len(whole) < _FINITE_DIGITS:
                        return float(text)
            new = numeric_rule(text)
            return value if new is FAIL else new

        if _NumericFix is not None:
            return _NumericFix(tuple(allowed), as_number, MAX_NUMBER_TEXT, fix_numeric)
        return fix_numeric
    if len(rules) == 1:
        (rule,) = rules

        def fix_one(value: Any, depth: int, check: bool) -> Any:
            kind = type(value)
            if kind in allowed:
                return value
            if kind is str:
                new = rule(value.strip())
                return value if new is FAIL else new
            return convert(value, depth)

        if _ScalarFix is not None:
            return _ScalarFix(tuple(allowed), rules, fix_one)
        return fix_one

    def fix_scalar(value: Any, depth: int, check: bool) -> Any:
        kind = type(value)
        if kind in allowed:
            return value
        if kind is str:
            text = value.strip()
            for rule in rules:
                new = rule(text)
                if new is not FAIL:
                    return new
            return value
        return convert(value, depth)

    if _ScalarFix is not None:
        return _ScalarFix(tuple(allowed), rules, fix_scalar)
    return fix_scalar


def member_fix(members: list[Any], rules: tuple[Callable[[str], Any], ...], convert: Step) -> Fix:
    """An ``enum`` or ``const`` node with nothing else to repair (``convert`` is its members
    step): only a string converts, to a member; every other value is kept as it is.

    ``rules`` are the text rules ``convert`` tries, in its order (the C node tries them
    itself when every member is a scalar and no rule reads a container).
    """

    def fix(value: Any, depth: int, check: bool) -> Any:
        return convert(value, depth) if isinstance(value, str) else value

    scalar = (str, int, float, bool, type(None))
    if _MemberFix is None or not all(type(member) in scalar for member in members):
        return fix
    return _MemberFix(
        frozenset(m for m in members if type(m) is str),
        frozenset(m for m in members if type(m) in (int, float) and m == m),
        frozenset(m for m in members if type(m) is bool),
        any(m is None for m in members),
        rules,
        fix,
    )


def json_parse(max_depth: int, slow: Parse) -> Parse:
    """``slow`` (``Coercer._parse_text``), in C for the common text when the extension is built."""
    if _JsonParse is None:
        return slow
    return _JsonParse(orjson.loads, max_depth, slow)


def union_fix(accepts: Accepts, choose: Step) -> Fix:
    """A node whose only repairing keyword is one ``anyOf`` or ``oneOf``."""

    def fix(value: Any, depth: int, check: bool) -> Any:
        if check and isinstance(value, _CONTAINERS) and accepts(value):
            return value
        return choose(value, depth)

    return fix


def container_fix(
    node: dict[str, Any],
    kind: type,
    descend: Step,
    parse: Parse | None,
    generic: Fix,
    is_valid: IsValid,
) -> Fix:
    """An object (array) node given an object (array): keep it if valid, else descend.

    With ``parse`` (``type`` is that container alone), a string is read as JSON
    text here; text that is not becomes nothing (object) or is wrapped (array),
    as the generic path would.
    """
    opener = "{" if kind is dict else "["

    def fix(value: Any, depth: int, check: bool) -> Any:
        given = type(value)
        if given is kind:
            if check and is_valid(node, value):
                return value
            return descend(value, depth)
        if given is str and parse is not None:
            parsed = parse(value.strip(), opener, kind, depth)
            if parsed is not FAIL:
                return descend(parsed, depth)
            return value if kind is dict else descend([value], depth)
        return generic(value, depth, check)

    return fix


def object_fix(
    node: dict[str, Any],
    fixes: dict[str, Fix],
    parse: Parse | None,
    generic: Fix,
    accepts_of: AcceptsOf,
    check_children: bool,
) -> Fix:
    """:func:`container_fix` for an object node whose only repairing keyword is ``properties``,
    with :func:`properties_descend` inlined (the most common node of all)."""

    fix_of = fixes.get
    accepts: Callable[[Any], bool] | None = None

    def fix(value: Any, depth: int, check: bool) -> Any:
        nonlocal accepts
        if type(value) is not dict:
            if type(value) is not str or parse is None:
                return generic(value, depth, check)
            parsed = parse(value.strip(), "{", dict, depth)
            if parsed is FAIL:
                return value  # as the generic path: no other conversion, nothing to descend
            value = parsed
        elif check:
            if accepts is None:
                accepts = accepts_of(node)
            if accepts(value):
                return value
        result = value
        depth += 1
        for key, child in value.items():
            child_fix = fix_of(key)
            if child_fix is not None:
                new = child_fix(child, depth, check_children)
                if new is not child:
                    if result is value:
                        result = value.copy()
                    if new is LEAVE_OUT:
                        del result[key]
                    else:
                        result[key] = new
        return result

    if _ObjectFix is not None:
        return _ObjectFix(node, fixes, parse, generic, accepts_of, check_children, fix)
    return fix


def array_fix(
    node: dict[str, Any],
    each: Fix,
    parse: Parse | None,
    generic: Fix,
    accepts_of: AcceptsOf,
    check_items: bool,
) -> Fix:
    """:func:`container_fix` for an array node whose only repairing keyword is one ``items``
    schema for every item, with the loop over the items inlined."""

    accepts: Callable[[Any], bool] | None = None

    def fix(value: Any, depth: int, check: bool) -> Any:
        nonlocal accepts
        given = type(value)
        if given is list:
            if check:
                if accepts is None:
                    accepts = accepts_of(node)
                if accepts(value):
                    return value
        elif given is str and parse is not None:
            parsed = parse(value.strip(), "[", list, depth)
            value = [value] if parsed is FAIL else parsed
        else:
            return generic(value, depth, check)
        result = value
        depth += 1
        for index, child in enumerate(value):
            new = each(child, depth, check_items)
            if new is not child:
                if result is value:
                    result = value.copy()
                result[index] = new
        return result

    if _ArrayFix is not None:
        return _ArrayFix(node, each, parse, generic, accepts_of, check_items, fix)
    return fix


def properties_descend(fixes: dict[str, Fix], check: bool) -> Step:
    """Children of an object whose only repairing keyword is ``properties``."""

    def descend(value: dict[str, Any], depth: int) -> Any:
        result = value
        depth += 1
        for key, child in value.items():
            fix = fixes.get(key)
            if fix is not None:
                new = fix(child, depth, check)
                if new is not child:
                    if result is value:
                        result = dict(value)
                    if new is LEAVE_OUT:
                        del result[key]
                    else:
                        result[key] = new
        return result

    return descend


def object_descend(
    fixes: dict[str, Fix],
    by_pattern: list[tuple[Any, Fix]],
    extra: Fix,
    defaults: tuple[tuple[str, Any], ...],
    check: bool,
) -> Step:
    """Children of an object through ``properties``, ``patternProperties`` and
    ``additionalProperties``; then defaults, when injecting them."""

    def descend(value: dict[str, Any], depth: int) -> Any:
        result = value
        depth += 1
        for key, child in value.items():
            fix = fixes.get(key)
            matched = fix is not None
            new = child if fix is None else fix(child, depth, check)
            if new is LEAVE_OUT:
                if result is value:
                    result = dict(value)
                del result[key]
                continue
            for pattern, pattern_fix in by_pattern:
                if pattern.search(key):
                    new = pattern_fix(new, depth, check)
                    matched = True
            if not matched:
                new = extra(new, depth, check)
            if new is not child:
                if result is value:
                    result = dict(value)
                result[key] = new
        for key, default in defaults:
            if key not in result:
                if result is value:
                    result = dict(value)
                result[key] = copy.deepcopy(default)
        return result

    return descend
