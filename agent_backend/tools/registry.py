"""The set of tools a run offers: lookup, loading from files, exports, and call preparation.

:class:`ToolRegistry` maps names to :class:`Tool`\\ s, loads tool files
(``*.json``, one tool or an array of tools per file, in any shape
:func:`tool_from_definition` reads), exports the tool list for OpenAI,
Anthropic and MCP, and turns a located :class:`ToolCall` into a
:class:`PreparedCall` with checked arguments.

Names with ``.`` are exported under an alias without dots (OpenAI and
Anthropic forbid them) and every lookup accepts the alias too, so a model's
``math_factorial`` finds ``math.factorial``.

It fails closed: a bad file fails the whole load (file and JSON pointer in the
error, nothing half-added); an unknown name or a call whose arguments could
not be read raises the model-facing error, never runs anything with ``{}``.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

import orjson

from agent_backend.errors import SchemaError, ToolArgumentError, UnknownToolError, clip
from agent_backend.tools import export
from agent_backend.tools.calls import ToolCall
from agent_backend.tools.functions import tool_from_function
from agent_backend.tools.tool import Tool, with_pool

__all__ = ["PreparedCall", "ToolRegistry", "load_tool_file"]

F = TypeVar("F", bound=Callable[..., Any])

# Names suggested first in an unknown-tool message when the full list does not fit.
_SUGGESTIONS = 5
# Up to this many names, suggestions compare against every name.
_FULL_SEARCH = 200


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedCall:
    """A call ready to run: its tool and arguments that passed the tool's schema."""

    call_id: str
    tool: Tool
    arguments: dict[str, Any]


def load_tool_file(path: str | os.PathLike[str]) -> list[Tool]:
    """The tools defined in one JSON file (an object, or an array of objects).

    Raises :class:`SchemaError` naming the file and the JSON pointer of the
    problem for malformed JSON, an unreadable definition or a bad schema.
    """
    source = os.fspath(path)
    try:
        data = orjson.loads(Path(source).read_bytes())
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"invalid JSON: {exc}", source=source) from None
    if isinstance(data, list):
        return [
            export.tool_from_definition(item, source=source, pointer=f"/{i}")
            for i, item in enumerate(data)
        ]
    return [export.tool_from_definition(data, source=source)]


def _fold(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


@dataclasses.dataclass(frozen=True, slots=True)
class _NameIndex:
    """Names as a model sees them: sorted, and sorted by folded form for suggestions."""

    names: tuple[str, ...]
    folded: tuple[str, ...]
    by_folded: tuple[str, ...]
    fits: bool

    @classmethod
    def build(cls, names: Iterable[str]) -> _NameIndex:
        ordered = tuple(sorted(names))
        pairs = sorted((_fold(n), n) for n in ordered)
        return cls(
            names=ordered,
            folded=tuple(f for f, _ in pairs),
            by_folded=tuple(n for _, n in pairs),
            # Small lists go to the model whole; no need to rank them.
            fits=sum(len(n) + 2 for n in ordered) <= 1024,
        )

    def closest(self, name: str) -> list[str]:
        """Up to a few names most like ``name``, in bounded time.

        difflib over every name costs ~0.1 s at 5000 similar names, too much
        for an error path, so a large registry only ranks the names whose
        folded forms sort next to ``name``'s; exact folded matches first.
        """
        if len(self.names) <= _FULL_SEARCH:
            return difflib.get_close_matches(name, self.names, n=_SUGGESTIONS, cutoff=0.6)
        key = _fold(name)
        at = bisect.bisect_left(self.folded, key)
        window = range(max(0, at - _SUGGESTIONS), min(len(self.folded), at + _SUGGESTIONS))
        near = {self.folded[i]: self.by_folded[i] for i in window}
        ranked = difflib.get_close_matches(key, list(near), n=_SUGGESTIONS, cutoff=0.6)
        if key in near and key not in ranked:
            ranked.insert(0, key)
        return [near[f] for f in ranked]


class ToolRegistry:
    """Tools by name, in the order they were added."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        # Export name of every tool whose name is not valid for OpenAI/Anthropic, and back.
        self._alias: dict[str, str] = {}
        self._by_alias: dict[str, str] = {}
        self._index: dict[bool, _NameIndex] = {}
        for tool in tools:
            self.add(tool)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], *, pattern: str = "*.json") -> ToolRegistry:
        registry = cls()
        registry.load_dir(path, pattern=pattern)
        return registry

    def __repr__(self) -> str:
        return f"<ToolRegistry tools={len(self._tools)}>"

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._tools or name in self._by_alias)

    def names(self) -> list[str]:
        """Tool names, in the order the tools were added."""
        return list(self._tools)

    # -- adding -----------------------------------------------------------------------------------

    def add(self, tool: Tool) -> Tool:
        """Add ``tool``; a name already taken (or taken as an export alias) is a :class:`SchemaError`."""
        name = tool.name
        existing = self._tools.get(name)
        if existing is not None:
            raise SchemaError(
                f"duplicate tool name {name!r} (already defined by {existing.source or 'another tool'})",
                source=tool.source,
            )
        # Exclusive cases: a dotted name needs an alias; a name without dots
        # may be another tool's alias, which then moves to a hashed one
        # (a real name wins over an alias, whatever the order of adding).
        alias = self._unique_alias(name, hashed=False) if export.wire_name(name) != name else None
        displaced = self._by_alias.get(name)
        moved = self._unique_alias(displaced, hashed=True) if displaced is not None else None
        self._tools[name] = tool
        if alias is not None:
            self._alias[name] = alias
            self._by_alias[alias] = name
        if displaced is not None and moved is not None:
            del self._by_alias[name]
            self._alias[displaced] = moved
            self._by_alias[moved] = displaced
        self._index.clear()
        return tool

    def _unique_alias(self, name: str, *, hashed: bool) -> str:
        alias = export.wire_name(name)
        if hashed or alias in self._tools or alias in self._by_alias:
            digest = hashlib.sha256(name.encode()).hexdigest()[:8]
            alias = f"{alias[:55]}_{digest}"
            if alias in self._tools or alias in self._by_alias:
                raise SchemaError(f"cannot find a unique export name for tool {name!r}")
        return alias

    def add_function(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        pool: str | None = None,
    ) -> Tool:
        """Add a tool running ``fn``; see :func:`tool_from_function`.

        ``pool`` names the dispatcher's pool whose workers run it (a Ray pool
        that lists the same function): ``x-agent-backend.pool``.
        """
        tool = tool_from_function(fn, name=name, description=description)
        return self.add(tool if pool is None else with_pool(tool, pool))

    @overload
    def tool(self, fn: F) -> F: ...

    @overload
    def tool(
        self, *, name: str | None = None, description: str | None = None, pool: str | None = None
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        pool: str | None = None,
    ) -> F | Callable[[F], F]:
        """Decorator form of :meth:`add_function`; the function itself is returned unchanged."""

        def register(function: F) -> F:
            self.add_function(function, name=name, description=description, pool=pool)
            return function

        return register if fn is None else register(fn)

    def load_file(self, path: str | os.PathLike[str]) -> list[Tool]:
        """Add the tools of one file, all or none."""
        return self._add_all(load_tool_file(path))

    def load_dir(self, path: str | os.PathLike[str], *, pattern: str = "*.json") -> list[Tool]:
        """Add the tools of every ``pattern`` file directly in ``path`` (sorted; not recursive).

        All or none: if any file fails, nothing is added.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise SchemaError("not a directory", source=os.fspath(path))
        tools: list[Tool] = []
        for file in sorted(directory.glob(pattern)):
            if file.is_file():
                tools.extend(load_tool_file(file))
        return self._add_all(tools)

    def _add_all(self, tools: list[Tool]) -> list[Tool]:
        saved = (dict(self._tools), dict(self._alias), dict(self._by_alias))
        try:
            for tool in tools:
                self.add(tool)
        except BaseException:
            self._tools, self._alias, self._by_alias = saved
            self._index.clear()
            raise
        return tools

    # -- lookup -----------------------------------------------------------------------------------

    def export_name(self, name: str) -> str:
        """The name tool ``name`` has in OpenAI and Anthropic exports."""
        return self._alias.get(self.get(name).name, name)

    def get(self, name: str) -> Tool:
        """The tool called ``name`` (or exported as ``name``); :class:`UnknownToolError` if none."""
        tool = self._find(name)
        if tool is None:
            raise UnknownToolError(name, available=self._available(name, exported=False))
        return tool

    def _find(self, name: str) -> Tool | None:
        tool = self._tools.get(name)
        if tool is None and name in self._by_alias:
            tool = self._tools[self._by_alias[name]]
        return tool

    def _available(self, name: str, *, exported: bool) -> list[str]:
        """Sorted names to show a model; when they do not all fit, the closest come first."""
        index = self._index.get(exported)
        if index is None:
            index = _NameIndex.build(self._alias.get(n, n) if exported else n for n in self._tools)
            self._index[exported] = index
        if index.fits:
            return list(index.names)
        close = index.closest(clip(name, 64))
        return close + [n for n in index.names if n not in close]

    # -- calls ------------------------------------------------------------------------------------

    def prepare_call(self, call: ToolCall) -> PreparedCall:
        """The tool and checked arguments for ``call``.

        Raises :class:`UnknownToolError` (listing names as the call's format
        knows them) or :class:`ToolArgumentError` (arguments invalid, or the
        call could not be read at all). Never returns unchecked arguments.
        """
        tool = self.resolve(call)
        return PreparedCall(call.id, tool, tool.prepare(call.arguments))

    def resolve(self, call: ToolCall) -> Tool:
        """The tool ``call`` names, its arguments not yet checked.

        Raises as :meth:`prepare_call` does for an unknown name or a call
        that could not be read; for whoever checks the arguments elsewhere
        (a tool hosted by a Ray pool is checked where it runs).
        """
        if call.error is not None and not call.name:
            raise ToolArgumentError(f"could not read the tool call: {call.error}")
        tool = self._find(call.name)
        if tool is None:
            exported = call.format in ("openai", "anthropic", "hermes")
            raise UnknownToolError(
                call.name, available=self._available(call.name, exported=exported)
            )
        if call.error is not None:
            raise ToolArgumentError(call.error, tool=tool.name)
        return tool

    # -- exports ----------------------------------------------------------------------------------

    def to_openai(self, *, strict: bool = False) -> list[dict[str, Any]]:
        """``[{"type": "function", "function": {...}}]`` for the OpenAI ``tools`` parameter.

        ``strict=True``: each tool whose schema has a strict variant is exported with it
        and ``"strict": true`` (:func:`~agent_backend.tools.to_openai`); the others as
        they are, without ``strict``, the way OpenAI's SDKs fall back.
        """
        exported = []
        for tool in self._tools.values():
            name = self._alias.get(tool.name, tool.name)
            try:
                exported.append(export.to_openai(tool, name=name, strict=strict))
            except SchemaError:
                exported.append(export.to_openai(tool, name=name))
        return exported

    def to_anthropic(self) -> list[dict[str, Any]]:
        """``[{"name", "description", "input_schema"}]`` for the Anthropic ``tools`` parameter."""
        return [
            export.to_anthropic(t, name=self._alias.get(t.name, t.name))
            for t in self._tools.values()
        ]

    def to_mcp(self) -> list[dict[str, Any]]:
        """``[{"name", "description", "inputSchema"}]`` for an MCP ``tools/list`` result."""
        return [export.to_mcp(t) for t in self._tools.values()]
