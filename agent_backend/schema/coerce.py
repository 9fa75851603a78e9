"""Repair the small type mistakes models make in tool arguments, guided by a resolved schema.

Pure: no I/O. The rules (docs/tool-calls.md has an example of each):

* a numeric string becomes an integer or a number, never lossily (``"1.5"``
  is not an integer; NaN and infinities are refused);
* ``"true"``/``"false"`` become booleans, ``"null"`` becomes null;
* a JSON-encoded string becomes the object or array the schema wants;
* a lone value becomes a one-element array where an array is wanted;
* ``enum``/``const`` members are matched after the same conversions.

What already validates is kept as it is (PITFALLS 4): a container that a
subschema accepts is not entered, a scalar whose type the schema allows is
never converted (``"007"`` stays a string for ``["string", "integer"]``, a
JSON-looking string stays a string for ``string | null``), and a union
branch that already accepts the value wins over any conversion. Branches
are tried in declared order. Input is never mutated: changed containers are
copied on write. This module never validates the final result: the caller
does that against the original schema.
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import math
import re
from collections.abc import Callable
from typing import Any, Final

from agent_backend.schema.parse import check_depth, json_type_name, load_json_value

__all__ = ["Coercer"]

_FAIL: Final = object()
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_MAX_NUMBER_TEXT = 400
_BOOLEANS = {"true": True, "false": False, "True": True, "False": False}
_CONVERSION_ORDER = ("integer", "number", "boolean", "null", "object", "array")

IsValid = Callable[[Any, Any], bool]
_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}


@dataclasses.dataclass(slots=True)
class _Plan:
    """What repair needs from one schema node, read once per node instead of on every visit."""

    ref: Any
    members: list[Any] | None
    member_kinds: tuple[str, ...]
    types: frozenset[Any] | None
    unions: tuple[list[Any], ...]
    all_of: list[Any]
    properties: dict[str, Any]
    patterns: tuple[tuple[re.Pattern[str], Any], ...]
    additional: dict[str, Any] | None
    prefix: list[Any]
    rest: Any
    defaults: tuple[tuple[str, Any], ...]
    only_types: bool
    """Nothing but ``type`` matters for a scalar here (no ref, enum, const or combinators)."""
    python_types: frozenset[type]
    """Python types that certainly satisfy ``types`` (a fast check before ``_type_allowed``)."""
    text_rules: tuple[Callable[[str], Any], ...]
    """The string-to-scalar rules ``types`` asks for, in conversion order (stripped text in)."""
    type_is_all: bool
    """``type`` is this node's only assertion: a value of a type in ``python_types`` is valid."""


class Coercer:
    """Repair for one resolved schema; built once and reused (it keeps only per-node plans)."""

    def __init__(
        self,
        root: dict[str, Any] | bool,
        *,
        is_valid: IsValid,
        max_depth: int,
        inject_defaults: bool = False,
    ) -> None:
        self._root = root
        self._is_valid = is_valid
        self._max_depth = max_depth
        self._inject_defaults = inject_defaults
        self._plans: dict[int, tuple[Any, _Plan]] = {}

    def coerce(self, value: Any, *, known_invalid: bool = False) -> Any:
        """``value`` with what fails repaired; ``known_invalid`` skips re-checking the whole value."""
        return self._coerce(value, self._root, 1, known_invalid)

    # -- one schema node ---------------------------------------------------------------

    def _coerce(self, value: Any, node: Any, depth: int, known_invalid: bool = False) -> Any:
        if not isinstance(node, dict):
            return value
        if (
            not known_invalid
            and not self._inject_defaults
            and isinstance(value, (dict, list))
            and self._is_valid(node, value)
        ):
            return value
        entry = self._plans.get(id(node))
        plan = entry[1] if entry is not None else self._plan(node)
        if plan.ref is not None:
            value = self._coerce(value, plan.ref, depth)
        if plan.members is not None or plan.types is not None:
            value = self._convert_here(value, plan, depth)
        for branches in plan.unions:
            value = self._choose_branch(value, branches, depth)
        for branch in plan.all_of:
            value = self._coerce(value, branch, depth)
        if isinstance(value, dict):
            return self._descend_object(value, plan, depth)
        if isinstance(value, list):
            return self._descend_array(value, plan, depth)
        return value

    def _choose_branch(self, value: Any, branches: list[Any], depth: int) -> Any:
        if any(self._accepts(branch, value) for branch in branches):
            return value
        for branch in branches:
            candidate = self._coerce(value, branch, depth)
            if candidate is not value and self._is_valid(branch, candidate):
                return candidate
        return value

    def _accepts(self, node: Any, value: Any) -> bool:
        """``is_valid(node, value)``, answered here when the node asserts nothing but a type."""
        entry = self._plans.get(id(node))
        plan = entry[1] if entry is not None else (self._plan(node) if type(node) is dict else None)
        if plan is not None and plan.type_is_all and type(value) in plan.python_types:
            return True
        return self._is_valid(node, value)

    def _convert_here(self, value: Any, plan: _Plan, depth: int) -> Any:
        """Apply this node's own ``type``/``enum``/``const`` to a value of the wrong kind."""
        members = plan.members
        if members is not None:
            if any(_json_equal(value, m) for m in members):
                return value
            for kind in plan.member_kinds:
                candidate = self._convert(value, kind, depth)
                if candidate is not _FAIL and any(_json_equal(candidate, m) for m in members):
                    return candidate
            return value
        types = plan.types
        if types is None or _type_allowed(value, types):
            return value
        for kind in _CONVERSION_ORDER:
            if kind in types:
                candidate = self._convert(value, kind, depth)
                if candidate is not _FAIL:
                    return candidate
        if "array" in types and not isinstance(value, list):
            return [value]
        return value

    def _convert(self, value: Any, kind: str, depth: int) -> Any:
        """``value`` (a string, for every rule but none) as a ``kind``, or ``_FAIL``."""
        if not isinstance(value, str):
            return _FAIL
        text = value.strip()
        rule = _RULES_BY_KIND.get(kind)
        if rule is not None:
            return rule(text)
        if kind in ("object", "array"):
            opener = "{" if kind == "object" else "["
            if not text.startswith(opener):
                return _FAIL
            try:
                parsed = load_json_value(text)
                check_depth(parsed, self._max_depth, start=depth)
            except ValueError:
                return _FAIL
            wanted = dict if kind == "object" else list
            return parsed if isinstance(parsed, wanted) else _FAIL
        return _FAIL

    # -- children ----------------------------------------------------------------------

    def _descend_object(self, value: dict[str, Any], plan: _Plan, depth: int) -> Any:
        properties = plan.properties
        result = value
        plans = self._plans
        for key, child in value.items():
            schema = properties.get(key)
            if schema is None:
                new = child
            else:
                entry = plans.get(id(schema))
                if entry is not None and entry[1].only_types and type(child) in _SCALAR_TYPES:
                    new = self._repair_scalar(child, entry[1], depth + 1)
                else:
                    new = self._coerce(child, schema, depth + 1)
            matched = schema is not None
            for pattern, pattern_schema in plan.patterns:
                if pattern.search(key):
                    new = self._coerce(new, pattern_schema, depth + 1)
                    matched = True
            if not matched and plan.additional is not None:
                new = self._coerce(new, plan.additional, depth + 1)
            if new is not child:
                if result is value:
                    result = dict(value)
                result[key] = new
        if self._inject_defaults:
            for key, default in plan.defaults:
                if key not in result:
                    if result is value:
                        result = dict(value)
                    result[key] = copy.deepcopy(default)
        return result

    def _repair_scalar(self, value: Any, plan: _Plan, depth: int) -> Any:
        """``_coerce`` for a scalar where only ``type`` matters, without its generic steps."""
        types = plan.types
        if types is None or type(value) in plan.python_types:
            return value
        if type(value) is str:  # the common repair: the plan's string rules, in order
            text = value.strip()
            for rule in plan.text_rules:
                candidate = rule(text)
                if candidate is not _FAIL:
                    return candidate
            if "object" not in types and "array" not in types:
                return value
        elif _type_allowed(value, types):
            return value
        value = self._convert_here(value, plan, depth)
        if isinstance(value, dict):
            return self._descend_object(value, plan, depth)
        if isinstance(value, list):
            return self._descend_array(value, plan, depth)
        return value

    def _descend_array(self, value: list[Any], plan: _Plan, depth: int) -> Any:
        prefix, rest = plan.prefix, plan.rest
        if not prefix and not isinstance(rest, dict):
            return value
        result = value
        for index, child in enumerate(value):
            schema = prefix[index] if index < len(prefix) else rest
            if not isinstance(schema, dict):
                continue
            new = self._coerce(child, schema, depth + 1)
            if new is not child:
                if result is value:
                    result = list(value)
                result[index] = new
        return result

    # -- plans -------------------------------------------------------------------------

    def _plan(self, node: dict[str, Any]) -> _Plan:
        members: list[Any] | None = None
        if "const" in node:
            members = [node["const"]]
        elif isinstance(node.get("enum"), list):
            members = node["enum"]
        declared = node.get("type")
        types = [declared] if isinstance(declared, str) else declared
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft 7 and earlier: positional items
            prefix, rest = items, node.get("additionalItems")
        else:
            rest = items
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        patterns = node.get("patternProperties")
        additional = node.get("additionalProperties")
        ref = node.get("$ref")
        plan = _Plan(
            ref=self._lookup(ref) if isinstance(ref, str) else None,
            members=members,
            member_kinds=tuple(dict.fromkeys(json_type_name(m) for m in members or ())),
            types=frozenset(t for t in types if isinstance(t, str))
            if isinstance(types, list)
            else None,
            unions=tuple(
                branches
                for branches in (node.get("anyOf"), node.get("oneOf"))
                if isinstance(branches, list) and branches
            ),
            all_of=node["allOf"] if isinstance(node.get("allOf"), list) else [],
            properties=properties,
            patterns=_compile_patterns(patterns) if isinstance(patterns, dict) else (),
            additional=additional if isinstance(additional, dict) else None,
            prefix=prefix if isinstance(prefix, list) else [],
            rest=rest,
            defaults=tuple(
                (key, schema["default"])
                for key, schema in properties.items()
                if isinstance(schema, dict) and "default" in schema
            ),
            only_types=False,
            python_types=frozenset(
                python
                for name in (types if isinstance(types, list) else ())
                for python in _PYTHON_TYPES.get(name, ())
            ),
            text_rules=tuple(
                rule for kind, rule in _TEXT_RULES if isinstance(types, list) and kind in types
            ),
            type_is_all=isinstance(types, list) and node.keys() <= _TYPE_ONLY_KEYS,
        )
        plan.only_types = (
            plan.ref is None and members is None and not plan.unions and not plan.all_of
        )
        self._plans[id(node)] = (node, plan)  # holding node keeps its id from being reused
        return plan

    def _lookup(self, ref: str) -> Any:
        """A ``#/...`` pointer into the resolved root (retained recursive defs); else ``None``."""
        if not (ref.startswith("#/") or ref == "#"):
            return None
        target: Any = self._root
        for token in ref[2:].split("/") if ref != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                return None
        return target


def _compile_patterns(patterns: dict[str, Any]) -> tuple[tuple[re.Pattern[str], Any], ...]:
    compiled = []
    for pattern, schema in patterns.items():
        try:
            compiled.append((re.compile(pattern), schema))
        except re.error:  # an ECMA-only construct: repair skips it, validation still applies it
            continue
    return tuple(compiled)


def _type_allowed(value: Any, types: frozenset[Any]) -> bool:
    kind = json_type_name(value)
    if kind in types:
        return True
    if kind == "integer":
        return "number" in types
    return kind == "number" and "integer" in types and float(value).is_integer()


def _to_integer(text: str) -> Any:
    if len(text) > _MAX_NUMBER_TEXT or not _NUMBER.fullmatch(text):
        return _FAIL
    if "." not in text and "e" not in text and "E" not in text:
        try:
            return int(text)
        except ValueError:  # beyond int's digit limit
            return _FAIL
    try:
        exact = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return _FAIL
    if abs(exact.adjusted()) > _MAX_NUMBER_TEXT or exact != exact.to_integral_value():
        return _FAIL
    return int(exact)


def _to_number(text: str) -> Any:
    if len(text) > _MAX_NUMBER_TEXT or not _NUMBER.fullmatch(text):
        return _FAIL
    if "." not in text and "e" not in text and "E" not in text:
        return _to_integer(text)
    number = float(text)
    return number if math.isfinite(number) else _FAIL


def _to_boolean(text: str) -> Any:
    return _BOOLEANS.get(text, _FAIL)


def _to_null(text: str) -> Any:
    return None if text == "null" else _FAIL


#: The string-to-scalar rules, in :data:`_CONVERSION_ORDER` (containers are handled apart).
_TEXT_RULES: Final = (
    ("integer", _to_integer),
    ("number", _to_number),
    ("boolean", _to_boolean),
    ("null", _to_null),
)
_RULES_BY_KIND: Final = dict(_TEXT_RULES)
#: Keys of a node whose only assertion is ``type`` (the rest are annotations).
_TYPE_ONLY_KEYS: Final = frozenset(
    ("type", "title", "description", "default", "examples", "$comment", "deprecated")
)


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema means it: ``1 == 1.0`` but ``true != 1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
