"""What one tool call came to: :class:`ToolResult`, the only thing dispatch hands back for a call.

A result is data, not an exception: it says whether the call succeeded and,
when it did not, why, in words meant for the model (``error``) and as a
stable name meant for code (``error_type``, one of
:data:`agent_backend.dispatch.ERROR_TYPES`). It is a frozen pydantic model so
it crosses process and network boundaries as JSON unchanged.

It lives below dispatch because the daemon's client reads it too, and the
client must not load dispatch (nor the tools, schema and jsonschema under it).
This module must never do I/O nor import anything but pydantic and
:mod:`agent_backend.errors`; ``error`` is cut to
:data:`~agent_backend.errors.MODEL_MESSAGE_LIMIT`.
"""

from __future__ import annotations

from typing import Any

import pydantic

from agent_backend.errors import MODEL_MESSAGE_LIMIT, ModelFacingError, clip

__all__ = ["ToolResult"]


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
