"""Tool definitions on the wire: the plain, OpenAI, Anthropic and MCP shapes, both ways.

:func:`tool_from_definition` reads one definition in any of the shapes (and
applies legacy type normalization, warning once per tool); ``to_openai``
(optionally with the strict variant of the schema), ``to_anthropic`` and
``to_mcp`` write one. OpenAI and Anthropic forbid ``.``
in names, so those exports use :func:`wire_name` (``math.factorial`` ->
``math_factorial``); the registry keeps the mapping back.

Pure apart from logging: no file or network I/O. It must never accept a
definition it cannot read fully (an unknown key is an error, not ignored),
and never hand out a tool's own dicts (exports are deep copies).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from agent_backend.errors import SchemaError
from agent_backend.schema import strict_schema
from agent_backend.tools.legacy import normalize_legacy_types
from agent_backend.tools.tool import Tool, check_tool_name

__all__ = [
    "EXTRA_KEYS",
    "relocate_schema_error",
    "to_anthropic",
    "to_mcp",
    "to_openai",
    "tool_from_definition",
    "wire_name",
]

logger = logging.getLogger("agent_backend.tools")

#: Keys a definition may carry besides name/description/schema; kept in
#: ``Tool.meta``. Any ``x-...`` key is allowed too; other keys are refused,
#: so a typo such as ``"parameter"`` fails at load instead of going unseen.
EXTRA_KEYS = frozenset(
    {
        # OpenAI
        "strict",
        # MCP
        "title",
        "annotations",
        "outputSchema",
        "_meta",
        "icons",
        # Anthropic
        "cache_control",
        "input_examples",
        "type",
    }
)

_SCHEMA_KEYS = ("parameters", "inputSchema", "input_schema")
_EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


def wire_name(name: str) -> str:
    """``name`` in the alphabet OpenAI and Anthropic accept (``^[a-zA-Z0-9_-]{1,64}$``)."""
    return name.replace(".", "_")


def relocate_schema_error(err: SchemaError, *, source: str | None, prefix: str) -> SchemaError:
    """A copy of ``err`` naming ``source`` and with ``prefix`` put before its pointer.

    Schemas are compiled on their own, so their errors point into the schema;
    a loader knows where that schema sits in its file.
    """
    old_where = f"{err.source or '<schema>'}{'#' + err.pointer if err.pointer else ''}: "
    detail = err.message.removeprefix(old_where)
    moved = copy.copy(err)
    moved.source = source
    moved.pointer = prefix + err.pointer
    moved.message = (
        f"{source or '<schema>'}{'#' + moved.pointer if moved.pointer else ''}: {detail}"
    )
    moved.args = (moved.message,)
    return moved


def _fields(
    definition: Mapping[str, Any], *, source: str | None, pointer: str
) -> tuple[Mapping[str, Any], str, dict[str, Any]]:
    """The mapping holding name/description/schema, its pointer, and the extra keys."""
    inner: Mapping[str, Any] = definition
    inner_pointer = pointer
    meta: dict[str, Any] = {}
    if "function" in definition:
        # OpenAI: {"type": "function", "function": {...}}; outer extras go to meta too.
        inner = definition["function"]
        inner_pointer = f"{pointer}/function"
        if definition.get("type", "function") != "function":
            raise SchemaError(
                "an OpenAI tool must have type 'function'", source=source, pointer=f"{pointer}/type"
            )
        if not isinstance(inner, Mapping):
            raise SchemaError("'function' must be an object", source=source, pointer=inner_pointer)
        meta.update(_extras(definition, {"type", "function"}, source=source, pointer=pointer))
    meta.update(
        _extras(inner, {"name", "description", *_SCHEMA_KEYS}, source=source, pointer=inner_pointer)
    )
    return inner, inner_pointer, meta


def _extras(
    mapping: Mapping[str, Any], known: set[str], *, source: str | None, pointer: str
) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in known:
            continue
        if not (key in EXTRA_KEYS or (isinstance(key, str) and key.startswith("x-"))):
            raise SchemaError(
                f"unknown key {key!r} in a tool definition (extension keys must start with 'x-')",
                source=source,
                pointer=f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}",
            )
        extras[key] = value
    return extras


def tool_from_definition(
    definition: object, *, source: str | None = None, pointer: str = ""
) -> Tool:
    """The :class:`Tool` a JSON definition describes, in any accepted shape.

    Shapes: plain ``{"name", "description", "parameters"}``, OpenAI
    ``{"type": "function", "function": {...}}``, MCP ``{"name",
    "description", "inputSchema"}`` and Anthropic ``{..., "input_schema"}``.
    ``pointer`` is where the definition sits in ``source``; every
    :class:`SchemaError` names the file and the pointer within it. Legacy
    type names are normalized, logged once per tool at WARNING, and recorded
    in ``Tool.normalizations``.
    """
    if not isinstance(definition, Mapping):
        raise SchemaError(
            f"a tool definition must be an object, not {type(definition).__name__}",
            source=source,
            pointer=pointer,
        )
    inner, inner_pointer, meta = _fields(definition, source=source, pointer=pointer)
    name = check_tool_name(inner.get("name"), source=source, pointer=f"{inner_pointer}/name")
    description = inner.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise SchemaError(
            "a tool description must be a string",
            source=source,
            pointer=f"{inner_pointer}/description",
        )
    present = [key for key in _SCHEMA_KEYS if key in inner]
    if len(present) > 1:
        raise SchemaError(
            f"a tool definition has both {present[0]!r} and {present[1]!r}",
            source=source,
            pointer=f"{inner_pointer}/{present[1]}",
        )
    schema_pointer = f"{inner_pointer}/{present[0]}" if present else inner_pointer
    raw_parameters = inner[present[0]] if present else _EMPTY_PARAMETERS
    try:
        parameters, changed = normalize_legacy_types(raw_parameters)
        if changed:
            logger.warning(
                "tool %r (%s): legacy type names normalized at %s",
                name,
                source or "<definition>",
                ", ".join(schema_pointer + p for p in changed),
            )
        return Tool(
            name=name,
            description=description,
            parameters=parameters,
            meta=meta,
            source=source,
            normalizations=changed,
        )
    except SchemaError as err:
        raise relocate_schema_error(err, source=source, prefix=schema_pointer) from None


def to_openai(tool: Tool, *, name: str | None = None, strict: bool = False) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"}}``.

    ``strict=True``: the strict variant of the parameters
    (:func:`~agent_backend.schema.strict_schema`) and ``"strict": true``, for
    OpenAI's strict mode; calls written against it are prepared like any other
    and mean the same. Raises :class:`SchemaError` when the schema has no strict form.
    """
    function: dict[str, Any] = {
        "name": name or wire_name(tool.name),
        "description": tool.description,
    }
    if strict:
        function["parameters"] = strict_schema(tool.parameters, source=tool.source)
        function["strict"] = True
    else:
        function["parameters"] = copy.deepcopy(dict(tool.parameters))
    return {"type": "function", "function": function}


def to_anthropic(tool: Tool, *, name: str | None = None) -> dict[str, Any]:
    """``{"name", "description", "input_schema"}`` (Anthropic Messages API)."""
    return {
        "name": name or wire_name(tool.name),
        "description": tool.description,
        "input_schema": copy.deepcopy(dict(tool.parameters)),
    }


def to_mcp(tool: Tool) -> dict[str, Any]:
    """``{"name", "description", "inputSchema"}`` (MCP ``tools/list``); MCP allows ``.``."""
    return {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": copy.deepcopy(dict(tool.parameters)),
    }
