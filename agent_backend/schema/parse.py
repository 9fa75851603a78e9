"""Turn model-produced tool arguments into a bounded JSON object, or fail closed.

Pure: no I/O. Everything that is not exactly one JSON object within the
limits raises :class:`~agent_backend.errors.ToolArgumentError`: unparseable
text, a non-object top level, trailing garbage or concatenated values
(``{"a":1}{"a":1}``), NaN/Infinity, non-JSON Python values, and arguments
over the size or depth bound. It must never substitute ``{}`` for bad input
(the tool would run with empty arguments, and the model would never learn its
JSON was bad) and never recurse on attacker-controlled depth.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import orjson

from agent_backend.errors import ArgumentIssue, ConfigError, ToolArgumentError

__all__ = [
    "DEFAULT_LIMITS",
    "EXACT_ONLY",
    "PLAIN_ONLY",
    "Limits",
    "check_depth",
    "copy_plain_object",
    "has_big_float",
    "has_non_finite",
    "json_type_name",
    "load_json_value",
    "lone_surrogate",
    "may_hold_big_integer",
    "parse_arguments",
    "shallow_enough",
]

# Dataclasses and datetimes are not JSON values: let them fall to the checked copy, which refuses them.
PLAIN_ONLY = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
#: Subclasses of str, int, dict and list go to ``default`` too (there is none, so orjson
#: raises): :func:`copy_plain_object` passes exact types only.
EXACT_ONLY = PLAIN_ONLY | orjson.OPT_PASSTHROUGH_SUBCLASS


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Bounds on arguments; anything beyond them is refused, never truncated."""

    max_bytes: int = 1_000_000
    """Largest argument text accepted (for a mapping: an estimate of its JSON size)."""
    max_depth: int = 64
    """Deepest nesting of objects/arrays accepted (the top-level object is depth 1)."""
    max_issues: int = 20
    """Most validation problems collected into one error."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_issues"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(
                    f"Limits.{name} must be a positive integer, not {value!r}",
                    key=name,
                    expected="a positive integer",
                )


DEFAULT_LIMITS = Limits()


def _fail(
    message: str, *, tool: str | None, pointer: str = "", expected: str = "", got: str = ""
) -> ToolArgumentError:
    return ToolArgumentError(
        message,
        issues=[ArgumentIssue(pointer, message, expected=expected, got=got)],
        tool=tool,
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json_value(text: str | bytes) -> Any:
    """Parse exactly one JSON value; raise ``ValueError`` with a precise reason otherwise.

    orjson is the fast path; when it refuses, the standard library re-parses to
    tell exactly where and why. orjson reads an integer beyond 64 bits as a
    float, silently losing digits: when a float that large comes back, the
    standard library re-reads the text exactly. NaN and Infinity literals are
    refused by both; so are what only orjson refuses, a number too large for a
    double (``1e400``) and a lone surrogate escape (``"\\ud800"``, not Unicode
    text): the standard library reads them, and they are then refused with
    orjson's reason.
    """
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as fast_error:
        fast_reason = str(fast_error)
    else:
        if not has_big_float(value):
            return value
        fast_reason = ""  # orjson read an integer beyond 64 bits as a float: re-read exactly
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            raise ValueError(
                f"more than one JSON value (extra data at line {exc.lineno} column {exc.colno});"
                " send exactly one JSON object"
            ) from None
        raise ValueError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(str(exc) if not isinstance(exc, RecursionError) else fast_reason) from None
    if fast_reason and _orjson_refuses(value):
        raise ValueError(fast_reason)
    return value


def check_depth(value: Any, max_depth: int, start: int = 1) -> int:
    """Return the nesting depth of ``value`` (containers only); raise ``ValueError`` past ``max_depth``.

    Walks level by level without recursion, so hostile depth cannot exhaust the stack.
    """
    if type(value) is not dict and type(value) is not list:
        return 0
    level: list[Any] = [value]
    depth = start
    while True:
        if depth > max_depth:
            raise ValueError(f"nested deeper than {max_depth} levels")
        below: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        if not below:
            return depth
        level = below
        depth += 1


#: Floats at least this large may be integers orjson could not hold exactly.
BIG_FLOAT = float(2**63)


def shallow_enough(text: str | bytes, value: Any, max_depth: int) -> bool:
    """Whether ``value``, read from JSON ``text``, nests no deeper than ``max_depth``.

    Fewer opening brackets than the bound cannot nest deeper (brackets inside
    strings only over-count); otherwise the value itself is walked.
    """
    if isinstance(text, str):
        brackets = text.count("{") + text.count("[")
    else:
        brackets = text.count(b"{") + text.count(b"[")
    if brackets <= max_depth:
        return True
    try:
        check_depth(value, max_depth)
    except ValueError:
        return False
    return True


def has_big_float(value: Any) -> bool:
    """Whether a parsed JSON value holds a float of magnitude >= 2**63 anywhere (iterative)."""
    if type(value) is float:
        return abs(value) >= BIG_FLOAT
    if type(value) is not dict and type(value) is not list:
        return False
    stack = [value]
    while stack:
        node = stack.pop()
        for child in node.values() if type(node) is dict else node:
            kind = type(child)
            if kind is float:
                if abs(child) >= BIG_FLOAT:
                    return True
            elif kind is dict or kind is list:
                stack.append(child)
    return False


#: Every digit to ``0``, every other byte to a space: a run of digits stays a run.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
#: As many digits as 2**63 has: an integer with fewer is one orjson reads exactly.
_BIG_INTEGER_RUN = b"0" * 19


def may_hold_big_integer(text: str | bytes) -> bool:
    """Whether JSON ``text`` may hold an integer orjson cannot read exactly (one beyond
    64 bits): only text with a run of 19 digits can.

    Two passes in C, cheaper than :func:`has_big_float` on what orjson read (a
    Python-level walk of every value); a false positive (a long digit run in a string)
    costs only that walk. A float literal such as ``1e19`` is a float to every reader.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return data.translate(_DIGITS_AS_ZEROS).find(_BIG_INTEGER_RUN) >= 0


def has_non_finite(value: Any) -> bool:
    """Whether a JSON-like Python value holds a NaN or an infinity anywhere (iterative)."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict or (kind is not list and kind is not tuple and isinstance(node, Mapping)):
            children: Any = node.values()
        else:
            children = node
        for child in children:
            kind = type(child)
            if kind is float:
                if child - child != 0.0:  # inf - inf and nan - nan are nan
                    return True
            elif kind is str or kind is int or kind is bool or child is None:
                continue
            elif kind is dict or kind is list or kind is tuple or isinstance(child, Mapping):
                stack.append(child)
            elif isinstance(child, float) and not math.isfinite(child):
                return True
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in ``text`` as ``U+XXXX`` (not Unicode text, no UTF-8 form), or None."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else f"U+{ord(found.group()):04X}"


def _orjson_refuses(value: Any) -> bool:
    """Whether a value the standard library read holds what orjson refuses to read: a non-finite
    float (``1e400``) or a lone surrogate in a string or key (one iterative walk)."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is dict:
            for key, child in node.items():
                if lone_surrogate(key) is not None:
                    return True
                stack.append(child)
        elif kind is list:
            stack.extend(node)
        elif kind is str:
            if lone_surrogate(node) is not None:
                return True
        elif kind is float and node - node != 0.0:  # inf - inf is nan
            return True
    return False


def copy_plain_object(value: Any, max_depth: int, max_bytes: int) -> dict[str, Any] | None:
    """A deep copy of ``value`` if it is a plain JSON object within the bounds, else ``None``.

    Plain: exact ``dict``/``list`` containers, exact ``str`` keys and strings
    (UTF-8 text), ``int`` within 64 bits, finite ``float``, ``bool``, ``None``;
    no deeper than ``max_depth`` levels (the top object is level 1) and no
    larger than ``max_bytes`` as compact JSON. The fast path of ``prepare``
    copies dict arguments with it; on ``None`` the caller takes
    :func:`parse_arguments`, which converts what it can and names what it cannot.

    orjson checks, sizes and copies. Encoding with exact types only refuses
    subclasses of str, int, dict and list, integers beyond 64 bits and strings
    that are not UTF-8. Decoding the bytes back makes the copy, plain by
    construction, and comparing it with the original catches in one C-level
    comparison what orjson converts quietly (NaN and infinities to null, tuples
    to lists, enums and UUIDs to their values): the copy differs, and is refused.
    That is faster than looking at each value's type in Python, even for an object
    with nothing nested (decoding a small object costs less). Compact JSON of
    ``2 * max_depth + 1`` bytes or fewer cannot nest deeper than ``max_depth``
    (two brackets a level); longer, its brackets are counted first
    (:func:`shallow_enough`).
    """
    if type(value) is not dict or max_depth < 1:
        return None
    try:
        encoded = orjson.dumps(value, None, EXACT_ONLY)  # positional: no keyword parsing
    except TypeError:
        return None
    size = len(encoded)
    if size > max_bytes:
        return None
    copied = orjson.loads(encoded)
    if copied != value or (
        size > 2 * max_depth + 1 and not shallow_enough(encoded, copied, max_depth)
    ):
        return None
    return copied  # type: ignore[no-any-return]


class _Refused(Exception):
    def __init__(self, message: str, path: tuple[Any, ...], got: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.got = got


def _plain(value: Any, path: tuple[Any, ...]) -> tuple[Any, int]:
    """A scalar as a plain JSON value and its estimated encoded size; containers are handled by the caller."""
    kind = type(value)
    if kind is int or kind is bool or value is None:
        return value, 8
    if kind is float or isinstance(value, (int, float, str)):
        plain = _plain_scalar(value)
        if type(plain) is float and not math.isfinite(plain):
            raise _Refused("NaN and Infinity are not JSON numbers", path, repr(value))
        if type(plain) is str:
            _check_text(plain, path)
            return plain, len(plain) + 2
        return plain, 8
    raise _Refused(f"{kind.__name__} is not a JSON value", path, repr(value)[:60])


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    surrogate = lone_surrogate(text)
    if surrogate is not None:
        raise _Refused(
            f"a string holds a lone surrogate ({surrogate}), which is not Unicode text",
            path,
            repr(text)[:60],
        )


def _copy_mapping(arguments: Mapping[str, Any], limits: Limits, tool: str | None) -> dict[str, Any]:
    """Deep-copy caller-supplied arguments into plain JSON values, checking every bound."""
    try:
        return _copy_tree(arguments, limits)
    except _Refused as exc:
        pointer = "".join("/" + _escape(str(part)) for part in exc.path)
        raise _fail(exc.message, tool=tool, pointer=pointer, got=exc.got) from None


def _copy_tree(arguments: Mapping[str, Any], limits: Limits) -> dict[str, Any]:
    budget = limits.max_bytes
    root: dict[str, Any] = {}
    # (source container, target container, depth, path of the container)
    stack: list[tuple[Any, Any, int, tuple[Any, ...]]] = [(arguments, root, 1, ())]
    while stack:
        source, target, depth, path = stack.pop()
        if depth > limits.max_depth:
            raise _Refused(f"arguments are nested deeper than {limits.max_depth} levels", path)
        is_object = type(target) is dict
        for key, value in source.items() if is_object else enumerate(source):
            if is_object:
                if type(key) is not str:
                    raise _Refused("object keys must be strings", path, repr(key)[:60])
                _check_text(key, (*path, key))
                budget -= len(key) + 4
            kind = type(value)
            if kind is str:
                _check_text(value, (*path, key))
                copy: Any = value
                budget -= len(value) + 2
            elif kind is int or kind is bool or value is None:
                copy = value
                budget -= 8
            elif kind is dict or (kind is not list and isinstance(value, Mapping)):
                copy = {}
                stack.append((value, copy, depth + 1, (*path, key)))
            elif kind is list or kind is tuple:
                copy = [None] * len(value)
                stack.append((value, copy, depth + 1, (*path, key)))
            else:
                copy, size = _plain(value, (*path, key))
                budget -= size
            if budget < 0:
                raise _Refused(f"arguments are larger than {limits.max_bytes} bytes", ())
            target[key] = copy
    return root


def _plain_scalar(value: str | int | float) -> str | int | float:
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def parse_arguments(
    arguments: str | bytes | bytearray | Mapping[str, Any],
    *,
    limits: Limits = DEFAULT_LIMITS,
    tool: str | None = None,
) -> dict[str, Any]:
    """Exactly one JSON object within ``limits``, as a new ``dict`` the caller does not share."""
    kind = type(arguments)
    if kind is dict or (kind is not str and kind is not bytes and isinstance(arguments, Mapping)):
        # Fast path: orjson copies plain JSON values in C. Whatever it refuses
        # (64-bit overflow, odd types) and anything holding NaN/Infinity
        # (which orjson would quietly write as null) takes the checked copy.
        try:
            encoded = orjson.dumps(arguments, option=PLAIN_ONLY)
        except (TypeError, orjson.JSONEncodeError):
            return _copy_mapping(arguments, limits, tool)  # type: ignore[arg-type]
        if encoded.find(b"null") >= 0 and has_non_finite(arguments):
            return _copy_mapping(arguments, limits, tool)  # type: ignore[arg-type]
        text: str | bytes = encoded
    elif kind is bytearray:
        text = bytes(arguments)  # type: ignore[arg-type]
    elif kind is not str and kind is not bytes:
        raise _fail(
            f"arguments must be a JSON object or its text, not {kind.__name__}",
            tool=tool,
            expected="object",
        )
    else:
        text = arguments  # type: ignore[assignment]
    if len(text) > limits.max_bytes:
        raise _fail(f"arguments are larger than {limits.max_bytes} bytes", tool=tool)
    try:
        value = load_json_value(text)
    except ValueError as exc:
        if not text.strip():
            raise _fail(
                "arguments are empty; send a JSON object ({} when the tool takes no arguments)",
                tool=tool,
                expected="object",
            ) from None
        raise _fail(f"arguments are not valid JSON: {exc}", tool=tool, expected="object") from None
    if type(value) is not dict:
        raise _fail(
            f"arguments must be a JSON object, not {json_type_name(value)}",
            tool=tool,
            expected="object",
            got=json_type_name(value),
        )
    try:
        check_depth(value, limits.max_depth)
    except ValueError as exc:
        raise _fail(f"arguments are {exc}", tool=tool) from None
    return value


_JSON_TYPE_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    type(None): "null",
    dict: "object",
    list: "array",
}


def json_type_name(value: Any) -> str:
    """The JSON Schema type name of a Python JSON value."""
    name = _JSON_TYPE_NAMES.get(type(value))
    if name is not None:
        return name
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__
