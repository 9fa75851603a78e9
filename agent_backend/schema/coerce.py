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


class Coercer:
    """One coercion pass over one value; cheap to create, holds no per-call caches of its own."""

    def __init__(
        self,
        root: dict[str, Any] | bool,
        *,
        is_valid: IsValid,
        max_depth: int,
        inject_defaults: bool = False,
        ref_cache: dict[str, Any] | None = None,
        pattern_cache: dict[str, re.Pattern[str] | None] | None = None,
    ) -> None:
        self._root = root
        self._is_valid = is_valid
        self._max_depth = max_depth
        self._inject_defaults = inject_defaults
        self._refs = ref_cache if ref_cache is not None else {}
        self._patterns = pattern_cache if pattern_cache is not None else {}

    def coerce(self, value: Any) -> Any:
        return self._coerce(value, self._root, 1)

    # -- one schema node ---------------------------------------------------------------

    def _coerce(self, value: Any, node: Any, depth: int) -> Any:
        if not isinstance(node, dict):
            return value
        if (
            isinstance(value, (dict, list))
            and not self._inject_defaults
            and self._is_valid(node, value)
        ):
            return value
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = self._lookup(ref)
            if target is not None:
                value = self._coerce(value, target, depth)
        value = self._convert_here(value, node, depth)
        for keyword in ("anyOf", "oneOf"):
            branches = node.get(keyword)
            if isinstance(branches, list) and branches:
                value = self._choose_branch(value, branches, depth)
        all_of = node.get("allOf")
        if isinstance(all_of, list):
            for branch in all_of:
                value = self._coerce(value, branch, depth)
        if isinstance(value, dict):
            return self._descend_object(value, node, depth)
        if isinstance(value, list):
            return self._descend_array(value, node, depth)
        return value

    def _choose_branch(self, value: Any, branches: list[Any], depth: int) -> Any:
        if any(self._is_valid(branch, value) for branch in branches):
            return value
        for branch in branches:
            candidate = self._coerce(value, branch, depth)
            if candidate is not value and self._is_valid(branch, candidate):
                return candidate
        return value

    def _convert_here(self, value: Any, node: dict[str, Any], depth: int) -> Any:
        """Apply this node's own ``type``/``enum``/``const`` to a value of the wrong kind."""
        members: list[Any] | None = None
        if "const" in node:
            members = [node["const"]]
        elif isinstance(node.get("enum"), list):
            members = node["enum"]
        if members is not None:
            if any(_json_equal(value, m) for m in members):
                return value
            for kind in dict.fromkeys(json_type_name(m) for m in members):
                candidate = self._convert(value, kind, depth)
                if candidate is not _FAIL and any(_json_equal(candidate, m) for m in members):
                    return candidate
            return value
        declared = node.get("type")
        if declared is None:
            return value
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list) or _type_allowed(value, types):
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
        if kind == "integer":
            return _to_integer(text)
        if kind == "number":
            return _to_number(text)
        if kind == "boolean":
            return _BOOLEANS.get(text, _FAIL)
        if kind == "null":
            return None if text == "null" else _FAIL
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

    def _descend_object(self, value: dict[str, Any], node: dict[str, Any], depth: int) -> Any:
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        patterns = node.get("patternProperties")
        patterns = patterns if isinstance(patterns, dict) else {}
        additional = node.get("additionalProperties")
        result = value
        for key, child in value.items():
            schemas: list[Any] = []
            if key in properties:
                schemas.append(properties[key])
            for pattern, schema in patterns.items():
                compiled = self._pattern(pattern)
                if compiled is not None and compiled.search(key):
                    schemas.append(schema)
            if not schemas and isinstance(additional, dict):
                schemas.append(additional)
            new = child
            for schema in schemas:
                new = self._coerce(new, schema, depth + 1)
            if new is not child:
                if result is value:
                    result = dict(value)
                result[key] = new
        if self._inject_defaults:
            for key, schema in properties.items():
                if key not in result and isinstance(schema, dict) and "default" in schema:
                    if result is value:
                        result = dict(value)
                    result[key] = copy.deepcopy(schema["default"])
        return result

    def _descend_array(self, value: list[Any], node: dict[str, Any], depth: int) -> Any:
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft 7 and earlier: positional items
            prefix, rest = items, node.get("additionalItems")
        else:
            rest = items
        prefix = prefix if isinstance(prefix, list) else []
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

    # -- lookups -----------------------------------------------------------------------

    def _lookup(self, ref: str) -> Any:
        """A ``#/...`` pointer into the resolved root (retained recursive defs); else ``None``."""
        if ref in self._refs:
            return self._refs[ref]
        target: Any = None
        if ref.startswith("#/") or ref == "#":
            target = self._root
            for token in ref[2:].split("/") if ref != "#" else []:
                token = token.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and token in target:
                    target = target[token]
                elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                    target = target[int(token)]
                else:
                    target = None
                    break
        self._refs[ref] = target
        return target

    def _pattern(self, pattern: str) -> re.Pattern[str] | None:
        if pattern not in self._patterns:
            try:
                self._patterns[pattern] = re.compile(pattern)
            except re.error:
                self._patterns[pattern] = None
        return self._patterns[pattern]


def _type_allowed(value: Any, types: list[Any]) -> bool:
    kind = json_type_name(value)
    if kind in types:
        return True
    if kind == "integer" and "number" in types:
        return True
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
