"""The one description of a tool every other layer uses: :class:`Tool`.

A tool is a name, a description, the JSON Schema of its arguments object,
that schema compiled once, and optionally a Python function that runs it
in-process. Backends read ``meta`` for how to run a tool elsewhere.

A :class:`Tool` is immutable and compiles its schema exactly once, at
construction (a validator built per call costs milliseconds, most of it
re-checking the schema); it must never compile per call, never run a
function with arguments that have not passed :meth:`Tool.prepare`, and never
block the event loop with a synchronous function (:mod:`~agent_backend.tools.invoke`
runs them).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import types
from collections.abc import Callable, Mapping
from typing import Any

from agent_backend.errors import SchemaError
from agent_backend.schema import CompiledSchema, check_json_shape, compile_schema
from agent_backend.tools.invoke import is_async_callable, run_prepared

__all__ = [
    "EXECUTION_BLOCK",
    "POOL_KEY",
    "TOOL_NAME_PATTERN",
    "Tool",
    "check_tool_name",
    "with_pool",
]

#: The block of a tool definition that says how and where the tool runs (read by dispatch).
EXECUTION_BLOCK = "x-agent-backend"
#: The key of :data:`EXECUTION_BLOCK` that names the dispatcher's pool running the tool.
POOL_KEY = "pool"

#: Names a tool may have: OpenAI's alphabet plus ``.`` (BFCL names such as
#: ``math.factorial``). Exports that forbid ``.`` map it to ``_``.
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")

Arguments = str | bytes | Mapping[str, Any]
#: Turns prepared arguments into the keyword arguments of ``Tool.function``.
ArgumentBinder = Callable[[dict[str, Any]], dict[str, Any]]


def check_tool_name(name: object, *, source: str | None = None, pointer: str = "/name") -> str:
    """``name`` if it is a valid tool name, else :class:`SchemaError`."""
    if not isinstance(name, str):
        raise SchemaError(
            f"a tool name must be a string, not {type(name).__name__}",
            source=source,
            pointer=pointer,
        )
    if TOOL_NAME_PATTERN.fullmatch(name) is None:
        raise SchemaError(
            f"invalid tool name {name[:80]!r}: use 1-64 characters from A-Z a-z 0-9 _ . -",
            source=source,
            pointer=pointer,
        )
    return name


def _check_parameters(parameters: object, source: str | None) -> dict[str, Any]:
    if not isinstance(parameters, Mapping):
        raise SchemaError(
            f"the parameters schema must be an object, not {type(parameters).__name__}",
            source=source,
        )
    declared = parameters.get("type", "object")
    if declared != "object" and not (isinstance(declared, list) and "object" in declared):
        # Every call format sends arguments as one JSON object.
        raise SchemaError(
            f"the parameters schema must describe an object, not type {declared!r}",
            source=source,
            pointer="/type",
        )
    check_json_shape(parameters, source=source)  # before the recursive copy
    return copy.deepcopy(dict(parameters))


@dataclasses.dataclass(frozen=True, eq=False)
class Tool:
    """A callable tool: what the model sees, and how its arguments are checked.

    ``parameters`` is the JSON Schema of the arguments object as exported
    (after any legacy normalization, which ``normalizations`` lists by JSON
    pointer). ``compiled`` is built from it once, here. Schema errors raised
    at construction carry pointers relative to ``parameters``.
    """

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    function: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    """In-process implementation, sync or async; called with keyword arguments."""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    """Extra keys of the definition (``x-agent-backend``, MCP ``annotations``...), verbatim."""
    source: str | None = None
    """Where the tool came from: a file path, or ``python:module.qualname``."""
    normalizations: tuple[str, ...] = ()
    """JSON pointers into ``parameters`` rewritten by legacy type normalization."""
    bind_arguments: ArgumentBinder | None = dataclasses.field(default=None, repr=False)
    """Turns prepared arguments into ``function``'s keyword arguments (default: as they are)."""
    compiled: CompiledSchema = dataclasses.field(init=False, repr=False)
    is_async: bool = dataclasses.field(init=False, repr=False)
    """Whether calling ``function`` gives a coroutine (known once, not per call)."""

    def __post_init__(self) -> None:
        check_tool_name(self.name, source=self.source)
        if not isinstance(self.description, str):
            raise SchemaError("a tool description must be a string", source=self.source)
        if self.function is not None and not callable(self.function):
            raise TypeError(f"tool {self.name!r}: function must be callable")
        parameters = _check_parameters(self.parameters, self.source)
        set_field = functools.partial(object.__setattr__, self)
        set_field("parameters", parameters)
        set_field("meta", types.MappingProxyType(copy.deepcopy(dict(self.meta))))
        set_field("normalizations", tuple(self.normalizations))
        set_field("compiled", compile_schema(parameters, source=self.source))
        set_field("is_async", self.function is not None and is_async_callable(self.function))

    def __reduce__(self) -> tuple[Any, ...]:
        # The compiled validator cannot cross a process boundary; the
        # definition can, and is compiled once again on arrival.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        fields["meta"] = dict(self.meta)
        return (_rebuild, (fields,))

    def prepare(self, arguments: Arguments) -> dict[str, Any]:
        """Arguments this tool may run with; raises :class:`~agent_backend.errors.ToolArgumentError`."""
        return self.compiled.prepare(arguments, self.name)  # positional: the hot path

    async def invoke(self, arguments: Arguments) -> Any:
        """Prepare ``arguments`` and run :attr:`function` with them.

        Coroutine functions are awaited; synchronous ones run in a worker
        thread so they cannot block the event loop, abandoned if the caller
        is cancelled (:func:`~agent_backend.tools.invoke.run_prepared`).
        """
        return await run_prepared(self, self.prepare(arguments))


def with_pool(tool: Tool, pool: str) -> Tool:
    """``tool`` routed to the dispatcher's pool named ``pool`` (its ``x-agent-backend.pool``)."""
    if not isinstance(pool, str) or not pool:
        raise SchemaError(
            f"tool {tool.name!r}: a pool name is a non-empty string",
            source=tool.source,
            pointer=f"/{EXECUTION_BLOCK}/{POOL_KEY}",
        )
    block = tool.meta.get(EXECUTION_BLOCK)
    meta = {
        **tool.meta,
        EXECUTION_BLOCK: {**(block if isinstance(block, Mapping) else {}), POOL_KEY: pool},
    }
    return dataclasses.replace(tool, meta=meta)


def _rebuild(fields: dict[str, Any]) -> Tool:
    return Tool(**fields)
