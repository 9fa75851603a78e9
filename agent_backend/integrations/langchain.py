"""LangChain over agent_backend: ``BaseTool``\\ s bound to a session, async first.

::

    async with Dispatcher(ToolRegistry(builtin_tools()), load_pool()) as dispatcher:
        async with session_tools(dispatcher) as tools:  # one session: one workspace
            agent = create_agent(model, tools)
            state = await agent.ainvoke({"messages": [("user", "Write hello.py, then run it")]})

:func:`session_tools` opens a session of the runner (a
:class:`~agent_backend.Dispatcher`, or a daemon's :class:`~agent_backend.Client`)
and yields one :class:`AgentBackendTool` per tool, every call running in that
session's workspace; leaving the block removes the workspace. Open one per
agent invocation for runs that must not see each other's files.
:func:`langchain_tools` binds the tools to a session opened elsewhere.

Each tool's ``args_schema`` is the tool's JSON Schema, so LangChain passes the
model's arguments on unvalidated and the dispatcher repairs and checks them,
exactly as everywhere else. A success is a ``ToolMessage`` whose content is
the output as the model sees it and whose ``artifact`` is the whole
:class:`~agent_backend.ToolResult`. A failed call (bad arguments, a non-zero
exit, a timeout...) raises ``ToolException`` inside the tool, which the tool
handles (``handle_tool_error``): the model gets a ``ToolMessage`` with
``status="error"`` and our short error with the output. An infrastructure
failure (``BackendUnavailable``, ``ToolTimeout``, ``PoolClosed``...) is raised.

The tools run on the event loop their session belongs to: call them with
``ainvoke`` (as ``create_agent``'s async path does); ``invoke`` raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import pydantic
from langchain_core.tools import BaseTool, ToolException

from agent_backend import ToolResult
from agent_backend.integrations._sessions import (
    Runner,
    SessionLike,
    ToolSpec,
    open_session,
    run_call,
    tool_specs,
)

__all__ = ["AgentBackendTool", "langchain_tools", "session_tools"]


class AgentBackendTool(BaseTool):
    """One agent_backend tool running in one session; build them with :func:`langchain_tools`."""

    args_schema: dict[str, Any]  # the JSON Schema form, always
    handle_tool_error: bool = True
    response_format: Literal["content", "content_and_artifact"] = "content_and_artifact"

    _session: SessionLike = pydantic.PrivateAttr()
    _timeout: float | None = pydantic.PrivateAttr(default=None)

    @classmethod
    def bound(
        cls, spec: ToolSpec, session: SessionLike, *, timeout: float | None
    ) -> AgentBackendTool:
        tool = cls(name=spec.name, description=spec.description, args_schema=spec.parameters)
        tool._session = session
        tool._timeout = timeout
        return tool

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"tool {self.name!r} runs on its session's event loop: use `await tool.ainvoke(...)`"
        )

    async def _arun(self, *args: Any, **kwargs: Any) -> tuple[str, ToolResult]:
        if args:  # LangChain passes a string input positionally; a JSON-schema tool refuses it
            raise ToolException(f"tool {self.name!r} takes an object of arguments, not text")
        result = await run_call(
            self._session, self.name, kwargs, call_id=None, timeout=self._timeout
        )
        message = result.to_model_message()
        if not result.ok:
            raise ToolException(message)
        return message, result


async def langchain_tools(
    runner: Runner,
    session: SessionLike,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, not a wait of ours
) -> list[AgentBackendTool]:
    """``runner``'s tools as LangChain tools running in ``session`` (which stays the caller's).

    ``timeout``: seconds a call may take; default: each tool's own timeout.
    """
    specs = await tool_specs(runner)
    return [AgentBackendTool.bound(spec, session, timeout=timeout) for spec in specs]


@asynccontextmanager
async def session_tools(
    runner: Runner,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 - the tools' limit, not a wait of ours
) -> AsyncIterator[list[AgentBackendTool]]:
    """A new session of ``runner`` and its tools; the workspace is removed when the block ends."""
    async with open_session(runner) as session:
        yield await langchain_tools(runner, session, timeout=timeout)
