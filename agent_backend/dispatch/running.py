"""Run one prepared call where its route says, and turn what it gave into a :class:`ToolResult`.

The steps of :class:`~agent_backend.dispatch.Dispatcher` that do not depend
on its sessions or pools, each given a :class:`Job` (one call, checked and
bounded): a Python function in this process (:func:`run_function`, through
the tools layer's one function runner), a built-in or a command on a host
(:func:`run_on_host`), a tool a pool's workers host (:func:`run_hosted`);
and a batch of calls run concurrently (:func:`gather`). What the model
caused is a result; what the infrastructure caused is raised.

``exec`` and command tools take one path: their
:class:`~agent_backend.dispatch.backend.Command` (``exec``'s read from its
arguments, a command tool's from its spec, the arguments as JSON on stdin),
run on the host, and one :func:`~agent_backend.dispatch.result.command_result`.

This module must never run arguments that did not pass the tool's schema
(the caller prepares them), nor write a non-finite number into JSON.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import orjson
import pydantic_core

from agent_backend.dispatch.backend import Backend, Command, Host, HostedResult
from agent_backend.dispatch.builtin import FileToolContext, exec_command, run_file_tool
from agent_backend.dispatch.output import head_tail
from agent_backend.dispatch.result import ToolResult, command_result
from agent_backend.dispatch.spec import ExecutionSpec
from agent_backend.errors import (
    AgentBackendError,
    ModelFacingError,
    ToolArgumentError,
    ToolFailed,
    ToolTimeout,
    clip,
)
from agent_backend.tools import Tool, ToolCall, run_prepared

__all__ = [
    "CallLike",
    "Job",
    "as_tool_call",
    "gather",
    "run_function",
    "run_hosted",
    "run_on_host",
]

logger = logging.getLogger("agent_backend.dispatch")

#: What :meth:`Dispatcher.call` accepts: a :class:`ToolCall`, a ``(name,
#: arguments)`` pair, or a ``{"name", "arguments"[, "id"]}`` mapping.
CallLike = ToolCall | tuple[str, Any] | Mapping[str, Any]


def as_tool_call(call: CallLike, index: int = 0) -> ToolCall:
    """``call`` as a :class:`ToolCall`; id ``call_<index>`` unless it has one."""
    if isinstance(call, ToolCall):
        return call
    if isinstance(call, tuple) and len(call) == 2 and isinstance(call[0], str):
        name, arguments = call
        return ToolCall(f"call_{index}", name, arguments, "mcp")
    if isinstance(call, Mapping) and isinstance(call.get("name"), str):
        raw_id = call.get("id")
        call_id = raw_id if isinstance(raw_id, str) and raw_id else f"call_{index}"
        return ToolCall(call_id, call["name"], call.get("arguments", {}), "mcp")
    raise TypeError(
        "a call is a ToolCall, a (name, arguments) pair or a {'name', 'arguments'} mapping, "
        f"not {clip(repr(call), 80)}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One call, ready to run: its tool, its arguments and its bounds."""

    call: ToolCall
    tool: Tool
    arguments: Any
    """Passed the tool's schema; a hosted tool's as the call gave them (its worker checks them)."""
    timeout: float
    """Seconds the call may take, enforced where it runs."""
    output_limit: int
    """Bytes of output kept for the model."""

    def failure(self, error: str, error_type: str, *, host: str | None = None) -> ToolResult:
        return ToolResult.failure(
            call_id=self.call.id, tool=self.call.name, error=error, error_type=error_type, host=host
        )

    def stopped(self, *, host: str | None = None) -> ToolResult:
        """The result of a tool stopped at its timeout."""
        return self.failure(
            f"the tool did not finish within {self.timeout:g} s and was stopped",
            "Timeout",
            host=host,
        )


def _jsonable(value: Any) -> bytes:
    # NaN and Infinity become strings: a NaN written into JSON makes readers fail on it.
    return pydantic_core.to_json(value, fallback=repr, inf_nan_mode="strings")


def _command(job: Job, spec: ExecutionSpec, workspace: str | None) -> Command:
    """``exec``'s command from its arguments; a command tool's from its spec."""
    if spec.builtin == "exec":
        return exec_command(
            job.arguments,
            tool=job.call.name,
            cwd=workspace,
            env=spec.env,
            timeout=job.timeout,
            output_limit=job.output_limit,
        )
    assert spec.command is not None
    return Command(
        argv=spec.command,
        cwd=workspace,
        env=dict(spec.env),
        stdin=orjson.dumps(job.arguments),
        timeout=job.timeout,
        output_limit=job.output_limit,
    )


async def run_on_host(
    job: Job, spec: ExecutionSpec, host: Host, workspace: str | None
) -> ToolResult:
    """A built-in or a command tool on ``host``, in ``workspace`` (None: the host's default)."""
    if spec.builtin is not None and spec.builtin != "exec":
        context = FileToolContext(
            call_id=job.call.id,
            tool=job.call.name,
            host=host,
            workspace=workspace,
            timeout=job.timeout,
            output_limit=job.output_limit,
        )
        return await run_file_tool(spec.builtin, job.arguments, context)
    try:
        command = _command(job, spec, workspace)
    except ToolArgumentError as exc:
        return ToolResult.from_error(exc, call_id=job.call.id, tool=job.call.name)
    outcome = await host.run(command)
    return command_result(
        outcome,
        call_id=job.call.id,
        tool=job.call.name,
        timeout=job.timeout,
        limit=job.output_limit,
        captured_limit=job.output_limit,
    )


async def run_hosted(pool: Backend, job: Job) -> ToolResult:
    """Run a tool ``pool``'s workers host; what the tool caused comes back as a result."""
    try:
        hosted: HostedResult = await pool.call_hosted(
            job.tool.name, job.arguments, timeout=job.timeout
        )
    except ModelFacingError as exc:
        return ToolResult.from_error(exc, call_id=job.call.id, tool=job.call.name)
    except ToolFailed as exc:
        return _tool_failed(job, exc)
    except ToolTimeout as exc:  # the backend stopped the tool at its limit: like a kill
        return job.stopped(host=exc.host)
    shown = hosted.value if hosted.summary is None else hosted.summary
    return _value_result(job, shown, host=hosted.worker).with_value(hosted.value)


async def run_function(job: Job) -> ToolResult:
    """A Python-function tool in this process; a sync one that overruns is abandoned."""
    with anyio.move_on_after(job.timeout) as deadline:
        try:
            value = await run_prepared(job.tool, job.arguments)
        except ModelFacingError as exc:
            return ToolResult.from_error(exc, call_id=job.call.id, tool=job.call.name)
        except ToolFailed as exc:  # a tool's own failure, already carried as data
            return _tool_failed(job, exc)
        except AgentBackendError:
            raise  # infrastructure or misuse, not the model's doing
        except Exception as exc:
            # Like a command that exits non-zero: the model sees why, the log the traceback.
            logger.warning("tool %r raised", job.tool.name, exc_info=True)
            return job.failure(f"the tool raised {type(exc).__name__}: {exc}", "ToolFailed")
    if deadline.cancelled_caught:
        return job.stopped()
    return _value_result(job, value).with_value(value)


def _tool_failed(job: Job, exc: ToolFailed) -> ToolResult:
    """The result of a tool that raised: its failure, already carried as data."""
    return job.failure(
        f"the tool raised {exc.error_type or 'an error'}: {exc.message}", "ToolFailed"
    )


def _value_result(job: Job, value: Any, *, host: str | None = None) -> ToolResult:
    """A successful result showing ``value``: a string as is, anything else as JSON."""
    raw = value.encode() if isinstance(value, str) else _jsonable(value)
    bounded = head_tail(raw, job.output_limit)
    return ToolResult(
        call_id=job.call.id,
        tool=job.call.name,
        ok=True,
        output=bounded.text(),
        truncated=bounded.truncated,
        output_bytes=len(raw),
        host=host,
    )


async def gather(jobs: Sequence[Callable[[], Awaitable[ToolResult]]]) -> list[ToolResult]:
    """Run ``jobs`` concurrently; their results in order, or the first error once all ended."""
    results: list[ToolResult | None] = [None] * len(jobs)
    errors: dict[int, Exception] = {}

    async def run(index: int) -> None:
        try:
            results[index] = await jobs[index]()
        except Exception as exc:  # kept, so that one failure cancels nothing
            errors[index] = exc

    async with anyio.create_task_group() as group:
        for index in range(len(jobs)):
            group.start_soon(run, index)
    if errors:
        first = errors[min(errors)]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more call(s) of this batch failed too")
        raise first
    return [result for result in results if result is not None]
