"""Make a :class:`Tool` from a typed Python function: schema from hints, text from the docstring.

The arguments schema is pydantic's JSON Schema of a model built over the
signature (defaults make a parameter optional; pydantic models, ``Literal``,
``Optional``, ``list[...]`` and nested models with ``$defs`` all work). The
description is the docstring's first paragraph; parameter descriptions come
from its Google (``Args:``), Sphinx (``:param x:``) or NumPy
(``Parameters``) section. On invoke, the prepared arguments are validated into
that same model, so a parameter typed as a pydantic model receives the model.
When every parameter is a bare ``str``, ``int``, ``float``, ``bool`` or ``Any``
(or one of them ``| None``) and every value already has its parameter's exact
type, the model would hand back the very values: they are passed as they are.

It must never guess: ``*args``, ``**kwargs``, positional-only parameters and
parameters without a type annotation are refused with a
:class:`~agent_backend.errors.SchemaError` naming the function and parameter.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import pydantic
import pydantic.json_schema
from pydantic.errors import PydanticUserError

from agent_backend.errors import ArgumentIssue, SchemaError, ToolArgumentError
from agent_backend.tools.tool import Tool

__all__ = ["parse_docstring", "tool_from_function"]


class _ToolSchemaGenerator(pydantic.json_schema.GenerateJsonSchema):
    """pydantic's generator without per-field titles (noise to a model)."""

    # An unserializable default is left out of the schema, not a warning.
    ignored_warning_kinds = frozenset({"non-serializable-default"})  # type: ignore[assignment]

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _source_of(fn: Callable[..., Any]) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"python:{module}.{qualname}"


def _default_name(fn: Callable[..., Any]) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", None)
    return name if isinstance(name, str) else type(target).__name__


def tool_from_function(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> Tool:
    """A :class:`Tool` running ``fn`` (sync or async), its schema derived from the signature.

    ``name`` defaults to ``fn.__name__`` and ``description`` to the first
    paragraph of the docstring. Raises :class:`SchemaError` for a signature
    that cannot be described (see the module docstring).
    """
    if not callable(fn):
        raise TypeError(f"expected a callable, got {type(fn).__name__}")
    source = _source_of(fn)
    tool_name = name or _default_name(fn)
    try:
        signature = inspect.signature(fn, eval_str=True)
    except (NameError, TypeError, ValueError) as exc:
        raise SchemaError(f"cannot read the signature: {exc}", source=source) from None
    summary, parameter_docs = parse_docstring(inspect.getdoc(fn))
    fields: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for index, (parameter_name, parameter) in enumerate(signature.parameters.items()):
        _check_parameter(parameter, source)
        # Fields get neutral names and the parameter name as alias, so a
        # parameter called ``json`` or ``schema`` cannot shadow BaseModel.
        field_name = f"p{index}"
        aliases[field_name] = parameter_name
        extra: dict[str, Any] = {}
        if parameter_name in parameter_docs:
            extra["description"] = parameter_docs[parameter_name]
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[field_name] = (
            parameter.annotation,
            pydantic.Field(default, alias=parameter_name, **extra),
        )
    try:
        model: type[pydantic.BaseModel] = pydantic.create_model(
            "Arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
        parameters = model.model_json_schema(schema_generator=_ToolSchemaGenerator)
    except (PydanticUserError, TypeError, ValueError) as exc:
        raise SchemaError(f"cannot describe the parameters: {exc}", source=source) from None
    parameters.pop("title", None)
    parameters.setdefault("properties", {})
    return Tool(
        name=tool_name,
        description=summary if description is None else description,
        parameters=parameters,
        function=fn,
        source=source,
        bind_arguments=functools.partial(
            _bind, model, aliases, tool_name, _exact_types(signature.parameters)
        ),
    )


#: Annotations whose pydantic validation returns a value of exactly this type unchanged.
_SCALARS: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (float,), bool: (bool,)}


def _exact_types(
    parameters: Mapping[str, inspect.Parameter],
) -> dict[str, tuple[type, ...]] | None:
    """Per parameter, the value types the model passes through unchanged (``()``: any, for
    ``Any``); None when some parameter's annotation is anything else (a model, a
    constrained or annotated type, a container): then every call is validated."""
    exact: dict[str, tuple[type, ...]] = {}
    for name, parameter in parameters.items():
        annotation = parameter.annotation
        if annotation is Any:
            exact[name] = ()
            continue
        members = (
            typing.get_args(annotation)
            if typing.get_origin(annotation) in (typing.Union, types.UnionType)
            else (annotation,)
        )
        allowed: list[type] = []
        for member in members:
            if member is type(None):
                allowed.append(type(None))
            elif member in _SCALARS:
                allowed.extend(_SCALARS[member])
            else:
                return None
        exact[name] = tuple(allowed)
    return exact


def _check_parameter(parameter: inspect.Parameter, source: str) -> None:
    kind = parameter.kind
    what = f"parameter {parameter.name!r}"
    if kind is inspect.Parameter.VAR_POSITIONAL:
        raise SchemaError(
            f"*{parameter.name} cannot be described to a model; name each parameter", source=source
        )
    if kind is inspect.Parameter.VAR_KEYWORD:
        raise SchemaError(
            f"**{parameter.name} cannot be described to a model; name each parameter", source=source
        )
    if kind is inspect.Parameter.POSITIONAL_ONLY:
        raise SchemaError(
            f"{what} is positional-only; tools are called with keyword arguments", source=source
        )
    if parameter.annotation is inspect.Parameter.empty:
        raise SchemaError(f"{what} has no type annotation", source=source)


def _bind(
    model: type[pydantic.BaseModel],
    aliases: dict[str, str],
    tool: str,
    exact: dict[str, tuple[type, ...]] | None,
    arguments: dict[str, Any],
) -> dict[str, Any]:
    """Keyword arguments for the function: ``arguments`` validated into the signature's model.

    Only the parameters the call gave are passed, so the function's own
    defaults apply to the rest. With ``exact`` (:func:`_exact_types`), values
    that already have their parameter's exact type are passed as they are:
    the model would return them unchanged.
    """
    if exact is not None:
        for key, value in arguments.items():
            allowed = exact.get(key)
            if allowed is None or (allowed and type(value) not in allowed):
                break
        else:
            return arguments
    try:
        validated = model.model_validate(arguments)
    except pydantic.ValidationError as exc:
        issues = [
            ArgumentIssue(
                "".join(
                    f"/{str(part).replace('~', '~0').replace('/', '~1')}" for part in error["loc"]
                ),
                error["msg"],
            )
            for error in exc.errors(include_url=False, include_input=False)
        ]
        noun = "problem" if len(issues) == 1 else "problems"
        raise ToolArgumentError(
            f"{len(issues)} {noun} with the arguments", issues=issues, tool=tool
        ) from None
    return {aliases[field]: getattr(validated, field) for field in validated.model_fields_set}


# -- docstrings -----------------------------------------------------------------------------------

_GOOGLE_HEADERS = frozenset(
    {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"}
)
_HEADER = re.compile(r"([A-Za-z][A-Za-z ]*):\s*")
_GOOGLE_ENTRY = re.compile(r"\**(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")
_SPHINX_FIELD = re.compile(
    r":(?:param|parameter|arg|argument|key|keyword)\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)"
)
_NUMPY_RULE = re.compile(r"-{3,}\s*")
_NUMPY_ENTRY = re.compile(r"(\w+)\s*(?::.*)?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _is_section_start(lines: list[str], i: int) -> bool:
    line = lines[i].strip()
    if line.startswith(":"):
        return True
    if _HEADER.fullmatch(line) and line[:-1].strip().lower() in _GOOGLE_HEADERS | {
        "returns",
        "raises",
        "yields",
        "examples",
        "example",
        "note",
        "notes",
    }:
        return True
    return i + 1 < len(lines) and bool(_NUMPY_RULE.fullmatch(lines[i + 1].strip())) and bool(line)


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(summary, {parameter: description})`` from a Google, Sphinx or NumPy docstring.

    ``doc`` should be cleaned (``inspect.getdoc``). The summary is the first
    paragraph, lines joined by spaces; it is empty when the docstring starts
    with a section.
    """
    if not doc:
        return "", {}
    lines = doc.expandtabs().splitlines()
    summary_lines: list[str] = []
    for i, line in enumerate(lines):
        if not line.strip() or _is_section_start(lines, i):
            break
        summary_lines.append(line.strip())
    params: dict[str, str] = {}
    _google(lines, params)
    _sphinx(lines, params)
    _numpy(lines, params)
    return " ".join(summary_lines), params


def _collect(entries: list[tuple[str, list[str]]], params: dict[str, str]) -> None:
    for name, parts in entries:
        text = " ".join(part for part in parts if part)
        if text:
            params.setdefault(name, text)


def _google(lines: list[str], params: dict[str, str]) -> None:
    i = 0
    while i < len(lines):
        header = _HEADER.fullmatch(lines[i].strip())
        if not header or header.group(1).strip().lower() not in _GOOGLE_HEADERS:
            i += 1
            continue
        base = _indent(lines[i])
        i += 1
        entries: list[tuple[str, list[str]]] = []
        entry_indent: int | None = None
        while i < len(lines):
            line = lines[i]
            if line.strip() and _indent(line) <= base:
                break
            if line.strip():
                if entry_indent is None:
                    entry_indent = _indent(line)
                entry = _GOOGLE_ENTRY.fullmatch(line.strip())
                if _indent(line) <= entry_indent and entry:
                    entries.append((entry.group(1), [entry.group(2).strip()]))
                elif entries:
                    entries[-1][1].append(line.strip())
            i += 1
        _collect(entries, params)


def _sphinx(lines: list[str], params: dict[str, str]) -> None:
    entries: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    current_indent = 0
    for line in lines:
        stripped = line.strip()
        field = _SPHINX_FIELD.fullmatch(stripped)
        if field:
            current = [field.group(2).strip()]
            current_indent = _indent(line)
            entries.append((field.group(1), current))
        elif (
            current is not None
            and stripped
            and not stripped.startswith(":")
            and _indent(line) > current_indent
        ):
            current.append(stripped)
        else:
            current = None
    _collect(entries, params)


def _numpy(lines: list[str], params: dict[str, str]) -> None:
    i = 0
    while i + 1 < len(lines):
        if lines[i].strip().lower() not in {
            "parameters",
            "other parameters",
        } or not _NUMPY_RULE.fullmatch(lines[i + 1].strip()):
            i += 1
            continue
        base = _indent(lines[i])
        i += 2
        entries: list[tuple[str, list[str]]] = []
        while i < len(lines):
            line = lines[i]
            if i + 1 < len(lines) and _NUMPY_RULE.fullmatch(lines[i + 1].strip()) and line.strip():
                break  # the next section's header
            if line.strip():
                entry = _NUMPY_ENTRY.fullmatch(line.strip())
                if _indent(line) <= base and entry:
                    entries.append((entry.group(1), []))
                elif _indent(line) <= base:
                    break
                elif entries:
                    entries[-1][1].append(line.strip())
            i += 1
        _collect(entries, params)
