"""Which pool runs each tool: :func:`route`, a pure function of the tool and the pools' shapes.

A :class:`~agent_backend.dispatch.Dispatcher` may drive several named pools
(``Dispatcher(registry, pools={"cmd": ssh, "gpu": ray}, default="cmd")``).
Each tool of its registry gets a :class:`Route` once, before its first call:

1. a tool a pool *hosts* (its workers run it: a Ray pool's Python tools)
   goes to that pool;
2. a tool whose ``x-agent-backend`` block names a pool (``pool = "gpu"``,
   ``@registry.tool(pool="gpu")``) goes there: a built-in or a command to a
   pool with hosts, a Python function to a pool whose workers run a tool of
   that name (the registry's tool, a Python function or a bare definition,
   is then the declaration of the hosted one);
3. otherwise by execution kind: a Python function runs in this process (no
   pool); a built-in or a command goes to the default pool when it has hosts,
   else to the first pool with hosts; ``x-agent-backend.backend = "ssh"``
   narrows that to pools of that kind.

A tool that no pool can run is a :class:`~agent_backend.errors.ConfigError`
naming its file and the key. The ``pool`` key is not part of
:class:`~agent_backend.dispatch.spec.ExecutionSpec`: that spec says *how* a
tool runs, a route says *where*.

A :class:`Router` keeps one dispatcher's routes: the tools its pools host
(added to the registry), and each tool's :class:`Plan` (route and spec),
made once, at the tool's first call or when the dispatcher is made.

Pure: no I/O, no pool is touched; the dispatcher passes a
:class:`PoolShape` per pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from agent_backend.dispatch.spec import (
    META_KEY,
    POOL_KEY,
    ExecutionKind,
    ExecutionSpec,
    execution_kind,
    read_spec,
)
from agent_backend.errors import ConfigError
from agent_backend.tools import Tool, ToolRegistry

__all__ = [
    "DEFAULT_POOL_NAME",
    "Plan",
    "PoolShape",
    "Route",
    "Router",
    "execution_block_schema",
    "route",
]

#: The name of the one pool of ``Dispatcher(registry, backend)``.
DEFAULT_POOL_NAME = "default"


@dataclasses.dataclass(frozen=True, slots=True)
class PoolShape:
    """What routing needs to know of one pool."""

    name: str
    kind: str
    """The backend's kind: ``local``, ``ssh``, ``ray``."""
    has_hosts: bool
    """It runs commands and built-ins."""
    hosted: frozenset[str] | None = frozenset()
    """Names of the tools its workers run; None: not known yet (the pool is not open)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where one tool runs: ``pool`` (None: in this process), as ``kind``."""

    pool: str | None
    kind: ExecutionKind


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """How and where one tool runs: its :class:`Route` and its :class:`ExecutionSpec`."""

    route: Route
    spec: ExecutionSpec


class Router:
    """The routes of one dispatcher: its pools' shapes, the tools they host, each tool's plan.

    :meth:`add_pool` for every pool first (a pool's hosted tools join
    ``registry``), then :meth:`plan` per tool, found once and kept.
    """

    def __init__(self, registry: ToolRegistry, default: str) -> None:
        self.registry = registry
        self.default = default
        self.shapes: dict[str, PoolShape] = {}
        self._hosted: dict[str, tuple[str, Tool]] = {}
        self._plans: dict[Tool, Plan] = {}

    def add_pool(self, shape: PoolShape, hosted: Iterable[Tool]) -> None:
        """Route to pool ``shape.name``; the tools its workers run join the registry."""
        self.shapes[shape.name] = shape
        for tool in hosted:
            self._adopt(shape, tool)

    def _adopt(self, shape: PoolShape, tool: Tool) -> None:
        """Add a tool the pool hosts to the registry (the same object on a second look).

        A registry tool of that name stays if it routes itself there
        (``x-agent-backend.pool``): it declares the hosted tool.
        """
        other = self._hosted.get(tool.name)
        if other is not None and other[0] != shape.name:
            raise ConfigError(
                f"{tool.source or 'a pool'}: tool {tool.name!r} is hosted by pools "
                f"{other[0]!r} and {shape.name!r}; rename one",
                file=tool.source,
                key="name",
                expected="a name one pool hosts",
            )
        if tool.name in self.registry:
            existing = self.registry.get(tool.name)
            if existing is not tool and read_spec(existing)[1] != shape.name:
                raise ConfigError(
                    f"{existing.source or 'the registry'}: tool {tool.name!r} is also hosted by "
                    f"the {shape.kind} pool {shape.name!r} ({tool.source or 'its workers'}); "
                    f"rename one, or route it there (x-agent-backend.pool = {shape.name!r})",
                    file=existing.source,
                    key="name",
                    expected=f"a name the {shape.kind} pool's tools do not use",
                )
        else:
            self.registry.add(tool)
        self._hosted[tool.name] = (shape.name, tool)

    def plan(self, tool: Tool) -> Plan:
        """``tool``'s plan; :class:`ConfigError` naming its file when no pool can run it."""
        plan = self._plans.get(tool)
        if plan is None:
            hosted = self._hosted.get(tool.name)
            hosted_by = hosted[0] if hosted is not None and hosted[1] is tool else None
            where = route(tool, self.shapes, self.default, hosted_by=hosted_by)
            plan = Plan(where, read_spec(tool)[0])
            self._plans[tool] = plan
        return plan


def execution_block_schema() -> dict[str, Any]:
    """The JSON Schema of a tool file's ``x-agent-backend`` block: how (the spec) and where
    (``pool``) the tool runs. ``schemas/x-agent-backend.schema.json`` is this, kept in sync."""
    schema = ExecutionSpec.model_json_schema()
    schema["properties"][POOL_KEY] = {
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
        "default": None,
        "description": "The name of the dispatcher's pool that runs this tool "
        "(Dispatcher(pools=...)); absent: routed by execution kind (docs/dispatch.md, Routes).",
        "title": "Pool",
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": META_KEY,
    }


def route(
    tool: Tool,
    pools: Mapping[str, PoolShape],
    default: str,
    *,
    hosted_by: str | None = None,
) -> Route:
    """Where ``tool`` runs among ``pools`` (``default`` first for host tools).

    ``hosted_by`` names the pool whose :meth:`~agent_backend.dispatch.Backend.hosted_tools`
    gave this very tool object.
    """
    if hosted_by is not None:
        return Route(hosted_by, "hosted")
    spec, named = read_spec(tool)
    if (
        named is not None
        and tool.function is None
        and spec.builtin is None
        and spec.command is None
    ):
        kind: ExecutionKind = "function"  # a bare definition: the named pool's workers run it
    else:
        kind = execution_kind(tool, spec)
    where = tool.source or tool.name
    key = f"{META_KEY}.{POOL_KEY}"
    if named is not None:
        shape = pools.get(named)
        if shape is None:
            names = ", ".join(repr(name) for name in pools)
            raise ConfigError(
                f"{where}: tool {tool.name!r} names pool {named!r}; this dispatcher has {names}",
                file=tool.source,
                key=key,
                expected=f"one of {names}",
            )
        if kind == "function":
            if shape.hosted is None or tool.name in shape.hosted:
                return Route(named, "hosted")
            raise ConfigError(
                f"{where}: tool {tool.name!r} is a Python function routed to pool {named!r}, "
                f"whose workers run no tool of that name (they run: "
                f"{', '.join(sorted(shape.hosted)) or 'none'}); list it in the pool's tools, "
                "or drop the pool to run it in this process",
                file=tool.source,
                key=key,
                expected=f"a pool whose workers run {tool.name!r}",
            )
        if not shape.has_hosts:
            raise ConfigError(
                f"{where}: tool {tool.name!r} runs a {kind} on a host, and pool {named!r} "
                f"({shape.kind}) has no hosts",
                file=tool.source,
                key=key,
                expected="a pool with hosts (local or ssh)",
            )
        _check_backend(tool, spec, shape)
        return Route(named, kind)
    if kind == "function":
        return Route(None, "function")
    candidates = [
        shape
        for shape in (pools[default], *pools.values())
        if shape.has_hosts and spec.backend in (None, shape.kind)
    ]
    if not candidates:
        if spec.backend is not None and any(s.kind != spec.backend for s in pools.values()):
            _check_backend(tool, spec, pools[default])
        hosted = ", ".join(sorted(name for s in pools.values() for name in (s.hosted or ())))
        which = (
            f"the {pools[default].kind} pool has no hosts (it runs its own tools"
            if len(pools) == 1
            else f"none of the pools {_describe(pools)} has hosts (they run their own tools"
        )
        raise ConfigError(
            f"{where}: tool {tool.name!r} runs a {kind} on a host, and {which}: "
            f"{hosted or 'none'}); give this dispatcher a registry without it, or a local "
            "or ssh pool",
            file=tool.source,
            key=META_KEY,
            expected="a tool one of the pools can run",
        )
    return Route(candidates[0].name, kind)


def _check_backend(tool: Tool, spec: ExecutionSpec, shape: PoolShape) -> None:
    if spec.backend not in (None, shape.kind):
        raise ConfigError(
            f"{tool.source or tool.name}: tool {tool.name!r} must run on a "
            f"{spec.backend!r} pool, and this one is {shape.kind!r}",
            file=tool.source,
            key=f"{META_KEY}.backend",
            expected=repr(shape.kind),
        )


def _describe(pools: Mapping[str, PoolShape]) -> str:
    return ", ".join(f"{name}: {shape.kind}" for name, shape in pools.items())
