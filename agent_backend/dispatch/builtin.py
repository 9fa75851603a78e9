"""The built-in tools: ``exec``, ``read_file``, ``write_file`` and ``list_dir``.

Their definitions are their schema files, ``agent_backend/data/tools/<name>.json``
(``schemas/tools/`` in a checkout), shipped inside the package: this module
reads them once, into :data:`BUILTIN_DEFINITIONS`.

File tools are confined to the session workspace by the kernel, on the host:
the path is handed to the host relative to the workspace, and the host opens
it beneath a descriptor of the workspace with ``openat2(2)``
(``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``), so ``..`` that climbs out,
absolute paths elsewhere, absolute symlinks and symlinks pointing out are
refused with :class:`~agent_backend.errors.PathOutsideWorkspace` however the
tree changes during the call, while ``a/../b``, symlinks that stay inside and
the workspace's own absolute path are fine. A file with more than one hard
link is refused (it may be a name of a file outside). ``list_dir`` escapes
control characters and backslashes in names, so one entry is one line. Outside
a session there is no workspace, and file tools answer with a ``NoWorkspace``
error result.

``exec`` is a command like a command tool's: :func:`exec_command` reads its
arguments into the :class:`~agent_backend.dispatch.backend.Command`, and the
dispatcher runs it and builds its result the one way it does for every
command (:func:`agent_backend.dispatch.running.run_on_host`). The file tools
run here (:func:`run_file_tool`).

This module must never resolve or check a model's path itself (the host's
kernel does, beneath the workspace), never run a command for a file tool, and
never return more than the output bound.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson

from agent_backend.data import BUILTIN_TOOLS_DIR
from agent_backend.dispatch.backend import Command, DirEntry, Host
from agent_backend.dispatch.output import head_tail
from agent_backend.dispatch.result import ToolResult
from agent_backend.dispatch.spec import BUILTIN_NAMES
from agent_backend.errors import AgentBackendError, PathOutsideWorkspace, ToolArgumentError, clip
from agent_backend.tools import Tool, tool_from_definition

__all__ = [
    "BUILTIN_DEFINITIONS",
    "FileToolContext",
    "builtin_tools",
    "escape_name",
    "exec_command",
    "run_file_tool",
    "workspace_relative",
]


def _read_definitions() -> dict[str, dict[str, Any]]:
    return {
        name: orjson.loads((BUILTIN_TOOLS_DIR / f"{name}.json").read_bytes())
        for name in BUILTIN_NAMES
    }


#: The built-in tool definitions, read from their schema files (:mod:`agent_backend.data`).
BUILTIN_DEFINITIONS: dict[str, dict[str, Any]] = _read_definitions()


def builtin_tools() -> list[Tool]:
    """Fresh :class:`Tool` objects for the four built-in tools."""
    return [
        tool_from_definition(copy.deepcopy(definition), source=f"builtin:{name}")
        for name, definition in BUILTIN_DEFINITIONS.items()
    ]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FileToolContext:
    """Where and how a file tool runs: decided by the dispatcher for one call."""

    call_id: str
    tool: str
    host: Host
    workspace: str | None
    """The session workspace's real path; None outside a session."""
    timeout: float
    """Seconds the call may take."""
    output_limit: int


def _failure(ctx: FileToolContext, error: str, error_type: str) -> ToolResult:
    return ToolResult.failure(
        call_id=ctx.call_id, tool=ctx.tool, error=error, error_type=error_type, host=ctx.host.name
    )


def _success(ctx: FileToolContext, output: str, *, truncated: bool, size: int) -> ToolResult:
    return ToolResult(
        call_id=ctx.call_id,
        tool=ctx.tool,
        ok=True,
        output=output,
        truncated=truncated,
        output_bytes=size,
        host=ctx.host.name,
    )


def workspace_relative(workspace: str, path: str) -> str:
    """``path`` as the host's file methods take it: relative to ``workspace``.

    A model often passes the workspace's absolute path: an absolute path that
    names the workspace or something under it becomes relative. Any other path
    is passed on as it is, for the host's kernel to resolve beneath the
    workspace (or refuse). :class:`ToolArgumentError` for a NUL character.
    """
    if "\x00" in path:
        raise ToolArgumentError("a path must not contain NUL characters")
    root = workspace.rstrip("/")
    if path == root or path.startswith(root + "/"):
        return path[len(root) :].lstrip("/") or "."
    return path


def exec_command(
    arguments: dict[str, Any],
    *,
    tool: str,
    cwd: str | None,
    env: Mapping[str, str],
    timeout: float,
    output_limit: int,
) -> Command:
    """The :class:`Command` of a call of ``exec`` (named ``tool``) with prepared ``arguments``.

    ``env`` is the tool's, under the call's own. :class:`ToolArgumentError`
    unless exactly one of ``command`` and ``argv`` is given.
    """
    command_line = arguments.get("command")
    argv = arguments.get("argv")
    if (command_line is None) == (argv is None):
        raise ToolArgumentError(
            "give exactly one of 'command' (a shell command line) and 'argv' (a list)",
            tool=tool,
        )
    stdin = arguments.get("stdin")
    return Command(
        argv=tuple(argv) if argv is not None else None,
        shell=command_line,
        cwd=cwd,
        env={**env, **arguments.get("env", {})},
        stdin=stdin.encode() if stdin is not None else None,
        timeout=timeout,
        output_limit=output_limit,
    )


async def run_file_tool(name: str, arguments: dict[str, Any], ctx: FileToolContext) -> ToolResult:
    """Run file tool ``name`` with prepared ``arguments``; model-caused problems are results.

    Raises only what the host raises for infrastructure failures.
    """
    if ctx.workspace is None:
        return _failure(
            ctx,
            f"{name} works only inside a session workspace, and this call runs outside any "
            "session; use the exec tool to work with files here",
            "NoWorkspace",
        )
    try:
        path = workspace_relative(ctx.workspace, arguments.get("path", "."))
        if name == "read_file":
            return await _read_file(ctx.workspace, path, arguments, ctx)
        if name == "write_file":
            return await _write_file(ctx.workspace, path, arguments, ctx)
        if name == "list_dir":
            return await _list_dir(ctx.workspace, path, ctx)
    except (PathOutsideWorkspace, ToolArgumentError) as exc:
        return ToolResult.from_error(exc, call_id=ctx.call_id, tool=ctx.tool, host=ctx.host.name)
    except AgentBackendError:
        raise  # infrastructure (ToolTimeout is an OSError too): not the model's doing
    except OSError as exc:
        shown = arguments.get("path", ".")
        reason = exc.strerror or str(exc)
        return _failure(ctx, f"{clip(shown, 200)}: {reason}", "FileError")
    raise ValueError(f"no file tool {name!r}")


async def _read_file(
    workspace: str, path: str, arguments: dict[str, Any], ctx: FileToolContext
) -> ToolResult:
    offset: int = arguments.get("offset", 0)
    limit = min(arguments.get("limit", ctx.output_limit), ctx.output_limit)
    data = await ctx.host.read_file(workspace, path, limit=offset + limit)
    shown = data.data[offset : offset + limit]
    end = offset + len(shown)
    text = shown.decode("utf-8", errors="replace")
    partial = offset > 0 or end < data.size
    if end < data.size:
        text += (
            f"\n[showing bytes {offset}-{end} of {data.size}; "
            f"read_file with offset={end} to read on]"
        )
    elif offset > 0 and not shown:
        text = f"[the file has {data.size} bytes; offset {offset} is past its end]"
    return _success(ctx, text, truncated=partial, size=data.size)


async def _write_file(
    workspace: str, path: str, arguments: dict[str, Any], ctx: FileToolContext
) -> ToolResult:
    content: str = arguments["content"]
    data = content.encode()
    await ctx.host.write_file(workspace, path, data, make_parents=True)
    shown = arguments["path"]
    return _success(ctx, f"wrote {len(data)} bytes to {shown}", truncated=False, size=len(data))


_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(char: str) -> str:
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8 (os.fsdecode's surrogate escape)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape_name(name: str) -> str:
    r"""``name`` with what could forge or hide a line shown escaped, the way Python writes them.

    A backslash, every control character (C0, DEL, C1), line and paragraph
    separators and every other character Python does not call printable
    (format characters such as bidi overrides, surrogate escapes of bytes that
    are not UTF-8) become ``\\``, ``\n``, ``\r``, ``\t``, ``\xNN``, ``\uNNNN``
    or ``\UNNNNNNNN``; the space stays a space. So one entry is always one line.
    """
    if name.isprintable() and "\\" not in name:
        return name
    return "".join(
        char if char.isprintable() and char != "\\" else _escape_char(char) for char in name
    )


def _render_entry(entry: DirEntry) -> str:
    name = escape_name(entry.name)
    if entry.kind == "dir":
        return f"{name}/"
    if entry.kind == "symlink":
        return f"{name}@"
    if entry.kind == "file":
        return f"{name}  {entry.size}"
    return f"{name}?"


async def _list_dir(workspace: str, path: str, ctx: FileToolContext) -> ToolResult:
    entries = await ctx.host.list_dir(workspace, path)
    text = "\n".join(_render_entry(entry) for entry in entries) if entries else "(empty)"
    raw = text.encode()
    bounded = head_tail(raw, ctx.output_limit)
    return _success(ctx, bounded.text(), truncated=bounded.truncated, size=len(raw))
