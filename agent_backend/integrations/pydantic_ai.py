"""pydantic-ai over agent_backend: :class:`AgentBackendToolset`, a toolset with sessions.

::

    async with Dispatcher(ToolRegistry(builtin_tools()), load_pool()) as dispatcher:
        agent = Agent(model, toolsets=[AgentBackendToolset(dispatcher)])
        result = await agent.run("Write hello.py, then run it")

Each agent run gets its own agent_backend session, so its own workspace:
pydantic-ai calls :meth:`~AgentBackendToolset.for_run` once per run, which
hands back a fresh toolset; the run enters it (the session opens) and exits
it at the end (the workspace is removed, on error and cancellation too).
Entered by hand (``async with toolset`` or ``async with agent``), the toolset
holds one session for as long as it is entered, and every run inside shares
that workspace, the way pydantic-ai's MCP toolsets keep their server. Pass
``session=`` to use a session opened elsewhere (never closed here). The runner
may be a :class:`~agent_backend.Dispatcher` or a daemon's
:class:`~agent_backend.Client`.

Calls go through the dispatcher, so arguments are repaired and checked by the
tool's schema exactly as everywhere else (pydantic-ai's own check only reads
the JSON into an object). What comes back:

* success: the output as the model sees it (``ToolResult.to_model_message``),
  with the whole :class:`~agent_backend.ToolResult` as the part's metadata;
* a failure the model fixes by changing the call (``retry_on``: bad
  arguments, an unknown tool, a path outside the workspace):
  :class:`~pydantic_ai.exceptions.ModelRetry` with our short error, counted
  against pydantic-ai's retry budget for the tool;
* a failure of what the call did (a non-zero exit, a timeout, a missing file,
  a tool that raised): :class:`~pydantic_ai.exceptions.ToolFailed`, so the
  model sees the error and the output and adapts, and a failing test suite
  run twice does not end the run. Add ``"NonZeroExit"`` to ``retry_on`` to
  count those against the budget too;
* an infrastructure failure (``BackendUnavailable``, ``ToolTimeout``,
  ``PoolClosed``...): raised, as the exception it is.

This module never checks arguments itself and never turns an infrastructure
error into something the model sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Self

import anyio
import pydantic_core
from pydantic_ai import RunContext
from pydantic_ai.exceptions import ModelRetry, ToolFailed, UserError
from pydantic_ai.messages import ToolReturn
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, ToolsetTool

from agent_backend.integrations._sessions import (
    Runner,
    SessionLike,
    ToolSpec,
    open_session,
    run_call,
    tool_specs,
)

__all__ = ["RETRY_ON", "AgentBackendToolset"]

#: The ``error_type``\ s turned into ``ModelRetry`` by default: the call itself was wrong.
RETRY_ON: Final = frozenset({"ToolArgumentError", "UnknownToolError", "PathOutsideWorkspace"})

# Reads the model's arguments into an object and nothing more: the tool's schema is the
# dispatcher's to check (and to repair against), as for every other caller.
_ANY_OBJECT = pydantic_core.SchemaValidator(
    pydantic_core.core_schema.dict_schema(
        pydantic_core.core_schema.str_schema(), pydantic_core.core_schema.any_schema()
    )
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Options:
    id: str | None
    max_retries: int | None
    timeout: float | None
    retry_on: frozenset[str]


class AgentBackendToolset(AbstractToolset[Any]):
    """agent_backend's tools as a pydantic-ai toolset; calls run in a session (a workspace).

    Args:
        runner: a :class:`~agent_backend.Dispatcher` (opened) or a :class:`~agent_backend.Client`.
        session: a session of ``runner`` opened by the caller: every run uses it, and it
            is left open. Default: a session per run, or per ``async with toolset``.
        id: the toolset's id (pydantic-ai needs one for durable execution).
        max_retries: retries per tool; default: the agent's ``retries``.
        timeout: seconds a call may take; default: the tool's own timeout.
        retry_on: the ``error_type``\\ s that become ``ModelRetry`` (see the module).
    """

    def __init__(
        self,
        runner: Runner,
        *,
        session: SessionLike | None = None,
        id: str | None = None,
        max_retries: int | None = None,
        timeout: float | None = None,
        retry_on: Collection[str] = RETRY_ON,
    ) -> None:
        self.runner = runner
        self._options = _Options(id, max_retries, timeout, frozenset(retry_on))
        self._given = session
        self._session = session
        self._opened: AbstractAsyncContextManager[SessionLike] | None = None
        self._entered = 0
        self._lock = anyio.Lock()
        self._specs: list[ToolSpec] | None = None

    def __repr__(self) -> str:
        state = "session open" if self._session is not None else "no session"
        return f"<AgentBackendToolset {self.runner!r} [{state}, entered {self._entered}x]>"

    @property
    def id(self) -> str | None:
        return self._options.id

    @property
    def session(self) -> SessionLike | None:
        """The session calls run in now; None until the toolset is entered (or given one)."""
        return self._session

    def _copy(self) -> AgentBackendToolset:
        options = self._options
        return AgentBackendToolset(
            self.runner,
            id=options.id,
            max_retries=options.max_retries,
            timeout=options.timeout,
            retry_on=options.retry_on,
        )

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        # A session already here (entered by hand, or given) is shared by the runs inside it;
        # otherwise the run gets a toolset of its own, so a session (a workspace) of its own.
        return self if self._session is not None else self._copy()

    async def __aenter__(self) -> Self:
        async with self._lock:
            if self._entered == 0 and self._given is None:
                opened = open_session(self.runner)
                self._session = await opened.__aenter__()
                self._opened = opened
            self._entered += 1
        return self

    async def __aexit__(self, *args: Any) -> bool | None:
        # Shielded whole, the lock included: a cancelled run must still remove its workspace.
        with anyio.CancelScope(shield=True):
            async with self._lock:
                self._entered -= 1
                if self._entered == 0:
                    opened, self._opened = self._opened, None
                    self._specs = None
                    if opened is not None:
                        self._session = None
                        await opened.__aexit__(*args)
        return None

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        if self._specs is None:
            self._specs = await tool_specs(self.runner)
        max_retries = self._options.max_retries
        return {
            spec.name: ToolsetTool(
                toolset=self,
                tool_def=ToolDefinition(
                    name=spec.name,
                    description=spec.description,
                    parameters_json_schema=spec.parameters,
                ),
                max_retries=ctx.max_retries if max_retries is None else max_retries,
                args_validator=_ANY_OBJECT,
            )
            for spec in self._specs
        }

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        session = self._session
        if session is None:
            raise UserError(
                "AgentBackendToolset has no session: an agent run enters it, or use "
                "`async with toolset:` (or pass session=) before calling its tools directly"
            )
        result = await run_call(
            session, name, tool_args, call_id=ctx.tool_call_id, timeout=self._options.timeout
        )
        message = result.to_model_message()
        if result.ok:
            return ToolReturn(return_value=message, metadata=result.model_dump(mode="json"))
        if result.error_type in self._options.retry_on:
            raise ModelRetry(message)
        raise ToolFailed(message)
