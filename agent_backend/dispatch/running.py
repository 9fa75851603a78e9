"""Run one prepared call where its route says, and turn what it gave into a :class:`ToolResult`.

The steps of :class:`~agent_backend.dispatch.Dispatcher` that do not depend
on its sessions or pools: a Python function in this process (through the
tools layer's one function runner, which abandons a sync function's thread
at the timeout), a built-in or
a command on a host, a tool a pool's workers host; and a batch of calls run
concurrently. What the model caused is a result; what the infrastructure
caused is raised.

This module must never run arguments that did not pass the tool's schema
(the caller prepares them), nor write a non-finite number into JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import orjson
import pydantic_core

from agent_backend.dispatch.backend import Backend, Command, Host, HostedResult
from agent_backend.dispatch.builtin import BuiltinContext, run_builtin
from agent_backend.dispatch.output import head_tail
from agent_backend.dispatch.result import ToolResult, command_result
from agent_backend.dispatch.spec import ExecutionSpec
from agent_backend.errors import AgentBackendError, ModelFacingError, ToolFailed, ToolTimeout
from agent_backend.tools import Tool, ToolCall, run_prepared

__all__ = ["gather", "run_function", "run_hosted", "run_on_host"]

logger = logging.getLogger("agent_backend.dispatch")


def _jsonable(value: Any) -> bytes:
    # NaN and Infinity become strings: a NaN written into JSON makes readers fail on it.
    return pydantic_core.to_json(value, fallback=repr, inf_nan_mode="strings")


async def run_on_host(
    spec: ExecutionSpec,
    arguments: dict[str, Any],
    call: ToolCall,
    host: Host,
    workspace: str | None,
    seconds: float,
    limit: int,
) -> ToolResult:
    if spec.builtin is not None:
        context = BuiltinContext(
            call_id=call.id,
            tool=call.name,
            host=host,
            workspace=workspace,
            timeout=seconds,
            output_limit=limit,
            env=dict(spec.env),
        )
        return await run_builtin(spec.builtin, arguments, context)
    assert spec.command is not None
    command = Command(
        argv=spec.command,
        cwd=workspace,
        env=dict(spec.env),
        stdin=orjson.dumps(arguments),
        timeout=seconds,
        output_limit=limit,
    )
    outcome = await host.run(command)
    return command_result(
        outcome,
        call_id=call.id,
        tool=call.name,
        timeout=seconds,
        limit=limit,
        captured_limit=limit,
    )


async def run_hosted(
    pool: Backend, tool: Tool, arguments: Any, call: ToolCall, seconds: float, limit: int
) -> ToolResult:
    """Run a tool ``pool``'s workers host; what the tool caused comes back as a result."""
    try:
        hosted: HostedResult = await pool.call_hosted(tool.name, arguments, timeout=seconds)
    except ModelFacingError as exc:
        return ToolResult.from_error(exc, call_id=call.id, tool=call.name)
    except ToolFailed as exc:
        return _tool_failed(call, exc)
    except ToolTimeout as exc:  # the backend stopped the tool at its limit: like a kill
        return ToolResult.failure(
            call_id=call.id,
            tool=call.name,
            error=f"the tool did not finish within {seconds:g} s and was stopped",
            error_type="Timeout",
            host=exc.host,
        )
    shown = hosted.value if hosted.summary is None else hosted.summary
    return _value_result(call, shown, limit, host=hosted.worker).with_value(hosted.value)


async def run_function(
    tool: Tool, arguments: dict[str, Any], call: ToolCall, seconds: float, limit: int
) -> ToolResult:
    with anyio.move_on_after(seconds) as deadline:
        try:
            value = await run_prepared(tool, arguments)
        except ModelFacingError as exc:
            return ToolResult.from_error(exc, call_id=call.id, tool=call.name)
        except ToolFailed as exc:  # a tool's own failure, already carried as data
            return _tool_failed(call, exc)
        except AgentBackendError:
            raise  # infrastructure or misuse, not the model's doing
        except Exception as exc:
            # Like a command that exits non-zero: the model sees why, the log the traceback.
            logger.warning("tool %r raised", tool.name, exc_info=True)
            return ToolResult.failure(
                call_id=call.id,
                tool=call.name,
                error=f"the tool raised {type(exc).__name__}: {exc}",
                error_type="ToolFailed",
            )
    if deadline.cancelled_caught:
        return ToolResult.failure(
            call_id=call.id,
            tool=call.name,
            error=f"the tool did not finish within {seconds:g} s and was stopped",
            error_type="Timeout",
        )
    return _value_result(call, value, limit).with_value(value)


def _tool_failed(call: ToolCall, exc: ToolFailed) -> ToolResult:
    """The result of a tool that raised: its failure, already carried as data."""
    return ToolResult.failure(
        call_id=call.id,
        tool=call.name,
        error=f"the tool raised {exc.error_type or 'an error'}: {exc.message}",
        error_type="ToolFailed",
    )


def _value_result(call: ToolCall, value: Any, limit: int, *, host: str | None = None) -> ToolResult:
    """A successful result showing ``value``: a string as is, anything else as JSON."""
    raw = value.encode() if isinstance(value, str) else _jsonable(value)
    bounded = head_tail(raw, limit)
    return ToolResult(
        call_id=call.id,
        tool=call.name,
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
