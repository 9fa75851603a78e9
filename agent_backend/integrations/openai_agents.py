"""The OpenAI Agents SDK over agent_backend: ``FunctionTool``\\ s bound to a session.

::

    async with Dispatcher(ToolRegistry(builtin_tools()), load_pool()) as dispatcher:
        async with session_tools(dispatcher) as tools:  # one session: one workspace
            agent = Agent(name="coder", instructions="...", tools=tools)
            result = await Runner.run(agent, "Write hello.py, then run it")

:func:`session_tools` opens a session of the runner (a
:class:`~agent_backend.Dispatcher`, or a daemon's :class:`~agent_backend.Client`)
and yields one ``FunctionTool`` per tool, every call running in that session's
workspace; leaving the block removes the workspace. Open one per run for runs
that must not see each other's files. :func:`function_tools` binds the tools
to a session opened elsewhere.

Each tool's ``on_invoke_tool`` hands the model's argument string to the
dispatcher as it came, so malformed JSON and bad arguments are read, repaired
and checked exactly as everywhere else. Following the SDK's convention for
failures the model can act on (what its ``failure_error_function`` does), a
failed call comes back to the model as text: ``Error: ...`` with our short
error and whatever the command printed. An infrastructure failure
(``BackendUnavailable``, ``ToolTimeout``, ``PoolClosed``...) is raised; the
SDK ends the run with its ``UserError("Error running tool ...")`` raised from
it (``__cause__`` is ours).

Tools are offered in OpenAI's strict mode (``strict_json_schema=True``) with
the strict variant of their schema (:func:`agent_backend.schema.strict_schema`:
every property required, the optional ones nullable, a map as name/value
pairs); the dispatcher reads a strict call back into the canonical one (a null
leaves the property out), so it means what the canonical call means. A tool
whose schema has no strict form, or whose variant the SDK would still rewrite,
is offered non-strict with its schema as is; ``strict=False`` offers them all
that way.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from agents import FunctionTool
from agents.exceptions import UserError
from agents.strict_schema import ensure_strict_json_schema
from agents.tool_context import ToolContext

from agent_backend.errors import SchemaError
from agent_backend.integrations._sessions import (
    Runner,
    SessionLike,
    ToolSpec,
    open_session,
    run_call,
    tool_specs,
)
from agent_backend.schema import strict_schema

__all__ = ["function_tools", "is_strict_schema", "session_tools"]


def is_strict_schema(parameters: dict[str, Any]) -> bool:
    """True when OpenAI's strict mode takes ``parameters`` as they are (the SDK changes nothing)."""
    try:
        return ensure_strict_json_schema(copy.deepcopy(parameters)) == parameters
    except UserError:
        return False


def _parameters(spec: ToolSpec, strict: bool) -> tuple[dict[str, Any], bool]:
    """The schema to offer for ``spec``, and whether it is strict."""
    if strict:
        try:
            variant = strict_schema(spec.parameters, source=spec.name)
        except SchemaError:  # no strict form (an untyped value, free keys...)
            return spec.parameters, False
        if is_strict_schema(variant):
            return variant, True
    return spec.parameters, False


def _function_tool(
    spec: ToolSpec, session: SessionLike, *, timeout: float | None, strict: bool
) -> FunctionTool:
    async def invoke(context: ToolContext[Any], arguments: str) -> str:
        result = await run_call(
            session,
            spec.name,
            arguments,
            call_id=context.tool_call_id,
            timeout=timeout,
        )
        return result.to_model_message()

    parameters, is_strict = _parameters(spec, strict)
    return FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=parameters,
        on_invoke_tool=invoke,
        strict_json_schema=is_strict,
    )


async def function_tools(
    runner: Runner,
    session: SessionLike,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, not a wait of ours
    strict: bool = True,
) -> list[FunctionTool]:
    """``runner``'s tools as ``FunctionTool``\\ s running in ``session`` (which stays the caller's).

    ``timeout``: seconds a call may take; default: each tool's own timeout.
    ``strict``: offer each tool's strict variant where it has one (see the module).
    """
    specs = await tool_specs(runner)
    return [_function_tool(spec, session, timeout=timeout, strict=strict) for spec in specs]


@asynccontextmanager
async def session_tools(
    runner: Runner,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, not a wait of ours
    strict: bool = True,
) -> AsyncIterator[list[FunctionTool]]:
    """A new session of ``runner`` and its tools; the workspace is removed when the block ends."""
    async with open_session(runner) as session:
        yield await function_tools(runner, session, timeout=timeout, strict=strict)
