"""Compiled JSON Schema validators that never touch the network, and their errors as issues.

Pure: the validator is jsonschema-rs (chosen by measurement, see
docs/validator.md), built with a retriever that refuses
every URI, so an external ``$ref`` can never become a request (in a daemon, a fetched
``$ref`` is a server-side request forgery hole).
A validator is compiled once per schema and reused; nothing here compiles per
call. Errors are rendered from their kind and a clipped rendering of the
offending value, never by repeating the whole input (once per nested error,
that turned 10 KB of arguments into 200 KB of feedback).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jsonschema_rs
import orjson

from agent_backend.errors import ArgumentIssue, SchemaError, clip
from agent_backend.schema.parse import json_type_name

__all__ = ["Validator", "compile_validator", "issues_of", "render_value"]


class Validator(Protocol):
    def is_valid(self, instance: Any) -> bool: ...

    def iter_errors(self, instance: Any) -> Iterator[Any]: ...


def _refuse_retrieval(uri: str) -> Any:
    raise ValueError(f"external reference {uri!r} is not fetched")


def compile_validator(schema: Any, *, source: str | None = None) -> Validator:
    """A compiled validator for ``schema``; remote retrieval is impossible."""
    try:
        validator: Validator = jsonschema_rs.validator_for(schema, retriever=_refuse_retrieval)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        message = getattr(exc, "message", None) or str(exc).split("\n", 1)[0]
        path = getattr(exc, "instance_path", None) or []
        raise SchemaError(
            f"cannot compile schema: {clip(message, 300)}",
            source=source,
            pointer=pointer_of(path),
        ) from None
    return validator


def pointer_of(path: Any) -> str:
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def render_value(value: Any, limit: int = 60) -> str:
    """A short JSON rendering of ``value`` for a message."""
    try:
        text = orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        text = repr(value)
    return clip(text, limit)


def _describe(value: Any) -> str:
    """``string "abc"``, ``integer 5``; just ``null``/``true``/``false`` where the value says it all."""
    if value is None or isinstance(value, bool):
        return render_value(value)
    return f"{json_type_name(value)} {render_value(value)}"


def _options(values: Any, limit: int = 120) -> str:
    return clip(", ".join(render_value(v, 40) for v in values), limit)


def _branch_types(context: Any) -> str:
    """What each failed anyOf/oneOf branch wanted, from its first error."""
    wanted: list[str] = []
    for branch in context or ():
        for error in branch[:1]:
            kind = error.kind
            if kind.name == "type":
                types = kind.as_dict().get("types", [])
                wanted.append(" or ".join(str(t) for t in types))
            else:
                wanted.append(kind.name)
    return clip("; ".join(dict.fromkeys(wanted)), 120)


def _render_not(details: dict[str, Any], value: Any) -> tuple[str, str]:
    """A ``not``: ``{"not": {"required": [...]}}`` says which properties must be left out
    (how a schema says "this or that, not both" without a top-level ``oneOf``)."""
    excluded = details.get("schema")
    names = excluded.get("required") if isinstance(excluded, dict) else None
    if isinstance(excluded, dict) and excluded.keys() == {"required"} and isinstance(names, list):
        listed = _options(names)
        message = f"{listed} must be left out here (not allowed with the other arguments given)"
        return message, f"no {listed}"
    return f"got {_describe(value)}, a form the schema excludes here", "another form"


_RENDERERS: dict[str, Callable[[dict[str, Any], Any], tuple[str, str]]] = {
    "not": _render_not,
    "type": lambda d, v: (
        f"expected {' or '.join(d.get('types', []))}, got {_describe(v)}",
        " or ".join(d.get("types", [])),
    ),
    "required": lambda d, v: (f"missing required property {d.get('property')!r}", "present"),
    "additionalProperties": lambda d, v: (
        f"unexpected properties {_options(d.get('unexpected', []))}; remove them",
        "no other properties",
    ),
    "enum": lambda d, v: (
        f"got {render_value(v)}, must be one of {_options(d.get('options', []))}",
        "one of " + _options(d.get("options", [])),
    ),
    "const": lambda d, v: (
        f"got {render_value(v)}, must be {render_value(d.get('expected_value'))}",
        render_value(d.get("expected_value")),
    ),
}


def issues_of(validator: Validator, instance: Any, *, limit: int) -> list[ArgumentIssue]:
    """At most ``limit`` issues describing why ``instance`` fails ``validator``."""
    issues: list[ArgumentIssue] = []
    for error in validator.iter_errors(instance):
        if len(issues) >= limit:
            break
        issues.append(_issue(error))
    return issues


def _issue(error: Any) -> ArgumentIssue:
    kind = error.kind
    name = kind.name
    details = kind.as_dict() if name not in ("anyOf", "oneOf") else {}
    value = error.instance
    pointer = pointer_of(error.instance_path)
    got = render_value(value)
    if name in _RENDERERS:
        message, expected = _RENDERERS[name](details, value)
    elif name in ("anyOf", "oneOf", "oneOfNotValid"):
        wanted = _branch_types(getattr(kind, "context", None))
        message = f"got {_describe(value)}, which matches none of the allowed forms ({wanted})"
        expected = wanted
    elif name == "oneOfMultipleValid":
        message = f"got {got}, which matches more than one allowed form; make it unambiguous"
        expected = "exactly one form"
    else:
        message = _message_without_instance(error.message, value)
        expected = name
    return ArgumentIssue(pointer, clip(message, 240), expected=clip(expected, 120), got=got)


def _message_without_instance(message: str, value: Any) -> str:
    """jsonschema-rs messages start with the whole instance; keep only a short rendering."""
    try:
        full = orjson.dumps(value).decode()
    except (TypeError, orjson.JSONEncodeError):
        return clip(message, 240)
    if message.startswith(full):
        return render_value(value) + message[len(full) :]
    return clip(message, 240)
