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

from typing import Any, Final

import pydantic

from agent_backend.dispatch.backend import CommandResult, Output
from agent_backend.dispatch.output import OutputBuffer, head_tail
from agent_backend.errors import MODEL_MESSAGE_LIMIT, ModelFacingError, clip

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


class ToolResult(pydantic.BaseModel):
    """The outcome of one tool call, ready to hand back to the model (:meth:`to_model_message`)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    call_id: str
    """The id of the call this answers (the model's, or ``call_<n>``)."""
    tool: str
    """The tool's name as the call gave it."""
    ok: bool
    """True when the call ran and succeeded (exit status 0, function returned)."""
    output: str = ""
    """Text for the model: stdout then stderr, a file's content, or a function's JSON result.
    Cut to the dispatcher's ``output_limit`` bytes, keeping head and tail."""
    exit_status: int | None = None
    """The command's exit status; None when it was killed, or the tool is not a command."""
    duration: float = 0.0
    """Seconds from the start of dispatch (argument checks included) to the result."""
    truncated: bool = False
    """True when ``output`` lost something in the middle to the bound."""
    output_bytes: int = 0
    """The full size of the output before truncation, in bytes (stdout + stderr)."""
    error: str | None = None
    """What went wrong, in words meant for the model; None when ``ok``."""
    error_type: str | None = None
    """A stable name for what went wrong (a key of :data:`ERROR_TYPES`); None when ``ok``."""
    host: str | None = None
    """The host that ran the call (``local``, ``user@host:port``); None when nothing ran."""

    _value: Any = pydantic.PrivateAttr(default=None)

    @property
    def value(self) -> Any:
        """The Python value a function or pool-hosted tool returned; None for a command.

        For a Ray tool whose result stayed in the object store, the
        ``PayloadRef`` (``output`` then describes it: size, dtype, shape,
        checksum). In this process only: never serialized, so None after a
        trip through JSON or the daemon; not part of equality.
        """
        return self._value

    def with_value(self, value: Any) -> ToolResult:
        """This result carrying ``value`` (see :attr:`value`)."""
        self._value = value  # a private attribute: the frozen fields are untouched
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolResult):
            return NotImplemented
        return self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(tuple(self.__dict__.values()))

    @classmethod
    def failure(
        cls,
        *,
        call_id: str,
        tool: str,
        error: str,
        error_type: str,
        duration: float = 0.0,
        host: str | None = None,
        output: str = "",
        output_bytes: int = 0,
        truncated: bool = False,
        exit_status: int | None = None,
    ) -> ToolResult:
        """A result for a call that did not succeed; ``error`` is clipped to the message bound."""
        return cls(
            call_id=call_id,
            tool=tool,
            ok=False,
            output=output,
            exit_status=exit_status,
            duration=duration,
            truncated=truncated,
            output_bytes=output_bytes,
            error=clip(error, MODEL_MESSAGE_LIMIT),
            error_type=error_type,
            host=host,
        )

    @classmethod
    def from_error(
        cls,
        exc: ModelFacingError,
        *,
        call_id: str,
        tool: str,
        duration: float = 0.0,
        host: str | None = None,
    ) -> ToolResult:
        """The result for a model-facing error; ``error_type`` is the error's class name."""
        return cls.failure(
            call_id=call_id,
            tool=tool,
            error=exc.to_model_message(),
            error_type=type(exc).__name__,
            duration=duration,
            host=host,
        )

    def to_model_message(self) -> str:
        """The text to send back to the model as this call's result.

        A success is its output (or ``(no output)``); a failure starts with
        ``Error: <error>`` followed by whatever output there was, so the model
        sees both why the call failed and what it printed.
        """
        if self.ok:
            return self.output if self.output else "(no output)"
        message = f"Error: {self.error or 'the tool call failed'}"
        return f"{message}\n{self.output}" if self.output else message


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
