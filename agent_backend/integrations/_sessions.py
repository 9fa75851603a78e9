"""What the agent-framework toolsets share: the tool list as a model sees it, and sessions.

The pydantic-ai, OpenAI Agents SDK and LangChain modules are each a thin
shape over the same three things, kept here so they cannot drift apart:

* :func:`tool_specs`: the runner's tools as the model sees them, under their
  export names (``math.factorial`` is ``math_factorial``; the registry maps the
  name back when the call comes in);
* :func:`open_session`: a session of a :class:`~agent_backend.Dispatcher` (in
  this process) or a :class:`~agent_backend.Client` (a daemon), the same way;
* :func:`run_call`: one call through that session, so arguments are repaired
  and checked by the tool's schema exactly as everywhere else, output bounded,
  and the :class:`~agent_backend.ToolResult` handed back as data.

It imports no framework and holds no state; it must never check arguments
itself (that is the dispatcher's job) nor swallow an infrastructure error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeAlias

from agent_backend import Client, Dispatcher, ToolCall, ToolResult
from agent_backend.dispatch import CallLike

__all__ = ["Runner", "SessionLike", "ToolSpec", "open_session", "run_call", "tool_specs"]

#: What runs the calls: a dispatcher in this process, or a daemon through its client.
Runner: TypeAlias = Dispatcher | Client


class SessionLike(Protocol):
    """A :class:`~agent_backend.Session` or a daemon's ``RemoteSession``: one workspace."""

    async def call(
        self,
        call: CallLike,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the tool's limit, as in Session.call
    ) -> ToolResult: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """One tool as the model sees it."""

    name: str
    """The export name (no dots): what the model calls it by."""
    description: str
    parameters: dict[str, Any]
    """The JSON Schema of its arguments object, a copy of the registry's."""


def _spec(definition: Mapping[str, Any]) -> ToolSpec:
    function = definition["function"]
    return ToolSpec(
        name=function["name"],
        description=function.get("description") or "",
        parameters=dict(function["parameters"]),
    )


async def tool_specs(runner: Runner) -> list[ToolSpec]:
    """``runner``'s tools in the order it lists them (a daemon's: one request)."""
    if isinstance(runner, Dispatcher):
        definitions = runner.registry.to_openai()
    else:
        definitions = await runner.tools("openai")
    return [_spec(definition) for definition in definitions]


def open_session(runner: Runner) -> AbstractAsyncContextManager[SessionLike]:
    """A new session of ``runner``, to ``async with``: its own workspace, removed on exit."""
    return runner.session()


async def run_call(
    session: SessionLike,
    name: str,
    arguments: str | Mapping[str, Any],
    *,
    call_id: str | None,
    timeout: float | None,  # noqa: ASYNC109 - the tool's limit, passed on
) -> ToolResult:
    """Run one call of tool ``name`` (its export name) in ``session``.

    ``arguments`` go as the model wrote them (a JSON string, or the dict a
    framework parsed); the dispatcher repairs and checks them. Model-caused
    failures come back as a failed result; infrastructure failures raise.
    """
    call = ToolCall(call_id or "call_0", name, arguments, "openai")
    return await session.call(call, timeout=timeout)
