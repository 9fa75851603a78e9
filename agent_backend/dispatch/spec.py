"""How a tool runs: the ``x-agent-backend`` block of a tool file, read into :class:`ExecutionSpec`.

Three execution kinds, decided per tool by its definition (docs/dispatch.md),
and a fourth decided by the pool (``hosted``: the pool's own workers run the
tool, e.g. a Ray pool's Python tools; see ``Backend.hosted_tools``):

* **function**: the :class:`~agent_backend.tools.Tool` has a Python
  ``function``; it runs in this process.
* **builtin**: ``{"builtin": "exec" | "read_file" | "write_file" | "list_dir"}``;
  dispatch implements it on the chosen host (:mod:`agent_backend.dispatch.builtin`).
* **command**: ``{"command": ["python3", "/opt/tools/search.py"]}``; that argv
  runs on the host, in the session workspace, with the prepared arguments as
  one JSON object on standard input (``"arguments": "stdin-json"``, the only
  mode). Its stdout and stderr are the result; exit 0 is success.

Keys common to every kind: ``timeout`` (seconds), ``output_limit`` (bytes),
``env`` (extra environment, command and builtin ``exec`` only) and
``backend`` (the pool kind the tool must run on). The block's ``pool`` key
(*where* the tool runs, :mod:`agent_backend.dispatch.routes`) is read beside
the spec by :func:`read_spec`, not into it.

Also home to :func:`config_error`, which turns a pydantic ``ValidationError``
into the one :class:`~agent_backend.errors.ConfigError` (file, dotted key,
what was expected) that every config reader here raises. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import pydantic

from agent_backend.config import ConfigModel
from agent_backend.errors import ConfigError, clip
from agent_backend.tools import EXECUTION_BLOCK, POOL_KEY, Tool

__all__ = [
    "BUILTIN_NAMES",
    "META_KEY",
    "POOL_KEY",
    "ExecutionKind",
    "ExecutionSpec",
    "config_error",
    "execution_kind",
    "execution_spec",
    "read_spec",
]

#: The key of a tool definition (``Tool.meta``) that says how the tool runs; the tools
#: layer's name for it is ``EXECUTION_BLOCK``.
META_KEY = EXECUTION_BLOCK

BuiltinName = Literal["exec", "read_file", "write_file", "list_dir"]
BUILTIN_NAMES: tuple[BuiltinName, ...] = ("exec", "read_file", "write_file", "list_dir")

ExecutionKind = Literal["function", "builtin", "command", "hosted"]

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
"""The one rule for environment variable names, everywhere a tool, a call or a pool sets one:
what every POSIX shell accepts in ``export NAME=...`` (the SSH backend exports them so)."""

EnvName = Annotated[str, pydantic.StringConstraints(pattern=ENV_NAME_PATTERN)]
"""A str that follows :data:`ENV_NAME_PATTERN`, as a pydantic field type."""


class ExecutionSpec(ConfigModel):
    """The ``x-agent-backend`` block of a tool definition. Every key is optional."""

    builtin: BuiltinName | None = None
    """Run one of dispatch's built-in tools."""
    command: tuple[Annotated[str, pydantic.StringConstraints(min_length=1)], ...] | None = (
        pydantic.Field(default=None, min_length=1)
    )
    """Run this argv on the host (no shell), in the session workspace when there is one."""
    arguments: Literal["stdin-json"] = "stdin-json"
    """How a command receives its arguments: one JSON object on standard input."""
    env: dict[EnvName, str] = pydantic.Field(default_factory=dict)
    """Extra environment variables for the command."""
    timeout: float | None = pydantic.Field(default=None, gt=0)
    """Seconds a call may take before it is killed; default: the dispatcher's ``default_timeout``."""
    output_limit: int | None = pydantic.Field(default=None, ge=64)
    """Bytes of output kept for the model; default: the dispatcher's ``output_limit``."""
    backend: str | None = None
    """The pool kind (``local``, ``ssh``) this tool must run on; None: any."""

    @pydantic.model_validator(mode="after")
    def _one_way_to_run(self) -> ExecutionSpec:
        if self.builtin is not None and self.command is not None:
            raise ValueError("give either 'builtin' or 'command', not both")
        return self


def config_error(
    exc: pydantic.ValidationError,
    *,
    file: str | None,
    prefix: str = "",
    tags: frozenset[str] = frozenset(),
    tag_key: str = "type",
) -> ConfigError:
    """One :class:`ConfigError` for a pydantic validation failure.

    ``key`` is the dotted path of the first problem (``prefix`` first; a
    leading discriminator tag in ``tags`` left out, and a bad or missing tag
    reported at ``tag_key``), ``expected`` what pydantic says it wanted; the
    message names the file and lists every problem.
    """
    problems: list[tuple[str, str]] = []
    for error in exc.errors(include_url=False):
        parts = [str(part) for part in error["loc"]]
        if parts and parts[0] in tags:
            parts = parts[1:]
        if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
            parts = [*parts, tag_key]
        key = ".".join([prefix, *parts] if prefix else parts)
        problems.append((key, _expected(error)))
    if not problems:  # pragma: no cover - pydantic always reports at least one
        problems.append((prefix, str(exc)))
    where = file or "<config>"
    lines = [f"{where}: {key or '(top level)'}: {expected}" for key, expected in problems[:10]]
    if len(problems) > 10:
        lines.append(f"... and {len(problems) - 10} more")
    key, expected = problems[0]
    return ConfigError("\n".join(lines), file=file, key=key, expected=expected)


def _expected(error: Any) -> str:
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return "no such key (unknown keys are refused)"
    if kind in ("missing", "union_tag_not_found"):
        return "a value (this key is required)"
    if kind == "union_tag_invalid":
        context = error.get("ctx") or {}
        got = clip(repr(context.get("tag", "?")), 60)
        return f"one of {context.get('expected_tags', '?')} (got {got})"
    message = str(error.get("msg", "invalid"))
    for prefix in ("Input should be ", "Value error, "):
        message = message.removeprefix(prefix)
    got = error.get("input")
    if isinstance(got, (str, int, float, bool)):
        return f"{message} (got {clip(repr(got), 60)})"
    return message


def read_spec(tool: Tool) -> tuple[ExecutionSpec, str | None]:
    """``tool``'s :class:`ExecutionSpec` and the pool its block names (None: none).

    :class:`ConfigError` naming the tool's file for a malformed block.
    """
    where = tool.source or f"tool {tool.name!r}"
    raw: Any = tool.meta.get(META_KEY)
    if raw is None:
        return ExecutionSpec(), None
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where}: {META_KEY}: expected an object",
            file=tool.source,
            key=META_KEY,
            expected="an object",
        )
    block = dict(raw)
    pool = block.pop(POOL_KEY, None)
    if pool is not None and (not isinstance(pool, str) or not pool):
        raise ConfigError(
            f"{where}: {META_KEY}.{POOL_KEY}: expected a pool name (got {clip(repr(pool), 60)})",
            file=tool.source,
            key=f"{META_KEY}.{POOL_KEY}",
            expected="a non-empty string naming one of the dispatcher's pools",
        )
    try:
        spec = ExecutionSpec.model_validate(block)
    except pydantic.ValidationError as exc:
        raise config_error(exc, file=where, prefix=META_KEY) from None
    return spec, pool


def execution_spec(tool: Tool) -> ExecutionSpec:
    """The :class:`ExecutionSpec` of ``tool``; :class:`ConfigError` naming its file if malformed."""
    return read_spec(tool)[0]


def execution_kind(tool: Tool, spec: ExecutionSpec) -> ExecutionKind:
    """How ``tool`` runs; :class:`ConfigError` when it has no way to run, or two."""
    ways: list[ExecutionKind] = []
    if tool.function is not None:
        ways.append("function")
    if spec.builtin is not None:
        ways.append("builtin")
    if spec.command is not None:
        ways.append("command")
    where = tool.source or f"tool {tool.name!r}"
    if not ways:
        raise ConfigError(
            f"{where}: tool {tool.name!r} has no way to run: give it a Python function, "
            f"or {META_KEY}.command (an argv) or {META_KEY}.builtin",
            file=tool.source,
            key=META_KEY,
            expected="'command' or 'builtin' (or a Python function)",
        )
    if len(ways) > 1:
        raise ConfigError(
            f"{where}: tool {tool.name!r} has more than one way to run ({', '.join(ways)})",
            file=tool.source,
            key=META_KEY,
            expected="exactly one of a Python function, 'command' and 'builtin'",
        )
    return ways[0]
