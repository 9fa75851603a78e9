"""What one tool call came to: :class:`ToolResult`, the only thing dispatch hands back for a call.

A result is data, not an exception: it says whether the call succeeded and,
when it did not, why, in words meant for the model (``error``) and as a
stable name meant for code (``error_type``). It is a frozen pydantic model so
it crosses process and network boundaries as JSON unchanged.

This module must never do I/O and never hold anything unbounded: ``output``
is already cut to the dispatcher's bound when a result is built, and
``error`` to :data:`~agent_backend.errors.MODEL_MESSAGE_LIMIT`.
"""

from __future__ import annotations

from typing import Final

from agent_backend.dispatch.backend import CommandResult, Output
from agent_backend.dispatch.output import OutputBuffer, head_tail
from agent_backend.result import ToolResult

__all__ = [
    "ERROR_TYPES",
    "STDERR_LABEL",
    "ToolResult",
    "combine_streams",
    "command_result",
    "rebound",
]

#: Every ``error_type`` dispatch produces, with what it means. The names are
#: stable (code may branch on them); the ``error`` text is not.
ERROR_TYPES: Final[dict[str, str]] = {
    "ToolArgumentError": "the arguments could not be read or do not match the tool's schema",
    "UnknownToolError": "no tool of that name",
    "PathOutsideWorkspace": "a file tool's path leaves the session workspace",
    "NoWorkspace": "a file tool was called outside a session, so there is no workspace",
    "FileError": "a file tool's path does not exist, is of the wrong kind, or cannot be used",
    "NonZeroExit": "the command ran and exited with a non-zero status",
    "Signal": "the command was killed by a signal it did not get from dispatch",
    "Timeout": "the call did not finish within its timeout; its processes were killed",
    "ToolFailed": "a Python-function tool raised an exception",
}


#: The line put before a command's stderr in ``ToolResult.output``.
STDERR_LABEL = "[stderr]\n"


# -- building results from captured output ----------------------------------------------------------


def _rebuild(head: bytes, gap: int, tail: bytes, limit: int) -> Output:
    """The bounded :class:`Output` of a stream known as head + ``gap`` unseen bytes + tail.

    Uses :class:`OutputBuffer` itself, so the marker is the one every backend writes.
    """
    buffer = OutputBuffer(limit)
    buffer.feed(head)
    buffer.total += gap
    buffer.feed(tail)
    return buffer.result()


def _parts(output: Output, captured_limit: int) -> tuple[bytes, int, bytes]:
    """``(head, gap, tail)`` of an :class:`Output` captured with ``OutputBuffer(captured_limit)``."""
    if not output.truncated:
        return output.data, 0, b""
    head_len = captured_limit - captured_limit // 2
    tail_len = captured_limit // 2
    data = output.data
    head, tail = data[:head_len], data[len(data) - tail_len :] if tail_len else b""
    gap = output.total_bytes - len(head) - len(tail)
    if gap > 0 and _rebuild(head, gap, tail, captured_limit).data == data:
        return head, gap, tail
    # Captured some other way: keep what is there, and count the rest as unseen.
    return data, max(0, output.total_bytes - len(data)), b""


def rebound(output: Output, limit: int, *, captured_limit: int) -> Output:
    """``output`` cut to ``limit`` bytes (head and tail), keeping its full size and one marker."""
    if len(output.data) <= limit and not output.truncated:
        return output
    head, gap, tail = _parts(output, captured_limit)
    if gap == 0:
        return head_tail(head + tail, limit)
    keep_head = limit - limit // 2
    keep_tail = limit // 2
    new_head = head[:keep_head]
    new_tail = tail[len(tail) - keep_tail :] if keep_tail else b""
    dropped = output.total_bytes - len(new_head) - len(new_tail)
    return _rebuild(new_head, dropped, new_tail, limit)


def combine_streams(
    stdout: Output, stderr: Output, *, limit: int, captured_limit: int
) -> tuple[str, bool, int]:
    """``(text, truncated, total_bytes)``: stdout, then stderr after a ``[stderr]`` line.

    Both together keep at most ``limit`` bytes: stderr gets what stdout leaves,
    and at least half the bound when both are long.
    """
    total = stdout.total_bytes + stderr.total_bytes
    if stderr.total_bytes == 0:
        out = rebound(stdout, limit, captured_limit=captured_limit)
        return out.text(), out.truncated, total
    err_budget = min(len(stderr.data), max(limit // 2, limit - len(stdout.data)))
    out = rebound(stdout, limit - err_budget, captured_limit=captured_limit)
    err = rebound(stderr, err_budget, captured_limit=captured_limit)
    text = out.text()
    if text and not text.endswith("\n"):
        text += "\n"
    return f"{text}{STDERR_LABEL}{err.text()}", out.truncated or err.truncated, total


def command_result(
    result: CommandResult,
    *,
    call_id: str,
    tool: str,
    timeout: float,
    limit: int,
    captured_limit: int,
) -> ToolResult:
    """The :class:`ToolResult` of a command that ran: ok on exit 0, else why not."""
    text, truncated, total = combine_streams(
        result.stdout, result.stderr, limit=limit, captured_limit=captured_limit
    )
    error: str | None = None
    error_type: str | None = None
    if result.timed_out:
        error_type = "Timeout"
        error = (
            f"the command timed out after {timeout:g} s and was killed, "
            "with every process it started"
        )
    elif result.exit_status is None:
        error_type = "Signal"
        error = f"the command was killed by {result.signal or 'a signal'}"
    elif result.exit_status != 0:
        error_type = "NonZeroExit"
        error = f"the command exited with status {result.exit_status}"
    return ToolResult(
        call_id=call_id,
        tool=tool,
        ok=error is None,
        output=text,
        exit_status=result.exit_status,
        duration=result.duration,
        truncated=truncated,
        output_bytes=total,
        error=error,
        error_type=error_type,
        host=result.host or None,
    )
