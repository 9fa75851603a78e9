"""LangChain agents (``langchain.agents.create_agent``) on agent_backend's tools, with LangChain's fake model.

The model is LangChain's own ``GenericFakeChatModel`` with ``bind_tools``
added, as LangChain's agent tests add it; its messages come from a generator
that reads the last request the agent sent (the ``ToolMessage``\\ s answering
the previous calls) and answers with the next tool calls, as a model would.
The agent loop is LangGraph's, async (``ainvoke``); the tools run for real on
the local pool, in the test process (a Dispatcher) and through the daemon.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pydantic
import pytest
from support.proc_helpers import none_left, unique_sleep, wait_dead, wait_sleeping
from support.toolset_fixtures import (
    OUTAGE,
    OUTPUT_LIMIT,
    Backend,
    backend_fixture,
    daemon_fixture,
    framework_missing,
    pool_config,
)

from agent_backend import Dispatcher, ToolRegistry, ToolResult
from agent_backend.backends.local import LocalBackend
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import BackendUnavailable, PoolClosed

try:
    from langchain.agents import create_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
    from langchain_core.outputs import ChatResult
    from langchain_core.runnables import Runnable
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from agent_backend.integrations.langchain import (
        AgentBackendTool,
        langchain_tools,
        session_tools,
    )
except ImportError as exc:
    framework_missing(exc, "langchain")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
backend = backend_fixture
toolset_daemon = daemon_fixture


class ToolCallingFakeModel(GenericFakeChatModel):
    """LangChain's fake chat model, plus ``bind_tools``; it records what it was sent."""

    requests: list[list[BaseMessage]] = pydantic.Field(default_factory=list)
    bound: list[dict[str, Any]] = pydantic.Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, Any]:
        self.bound = [convert_to_openai_tool(tool) for tool in tools]
        return self.bind(tools=self.bound, **kwargs)

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        self.requests.append(list(messages))
        return super()._generate(messages, *args, **kwargs)


Step = Callable[[dict[str, ToolMessage]], Any]


class Script:
    """The model: step ``n`` answers the ``n``-th request from the ToolMessages it carries.

    A step returns text (the final answer) or ``(name, arguments)`` pairs for
    tool calls, which get the ids ``call-0``, ``call-1``... in order;
    :meth:`answer` is the ToolMessage the model got back for one of them.
    """

    def __init__(self, *steps: Step) -> None:
        self.steps = steps
        self.calls = 0
        self.answers: dict[str, ToolMessage] = {}
        self.model = ToolCallingFakeModel(messages=self._messages())

    def _messages(self) -> Iterator[AIMessage]:
        for step in self.steps:
            request = self.model.requests[-1]
            fresh = {m.tool_call_id: m for m in request if isinstance(m, ToolMessage)}
            fresh = {k: v for k, v in fresh.items() if k not in self.answers}
            self.answers.update(fresh)
            reply = step(fresh)
            if isinstance(reply, str):
                yield AIMessage(content=reply)
                continue
            calls = []
            for name, arguments in reply:
                calls.append({"name": name, "args": arguments, "id": f"call-{self.calls}"})
                self.calls += 1
            yield AIMessage(content="", tool_calls=calls)

    def answer(self, index: int) -> ToolMessage:
        return self.answers[f"call-{index}"]


def call(name: str, arguments: dict[str, Any]) -> Step:
    return lambda answers: [(name, arguments)]


def done(answers: dict[str, ToolMessage]) -> str:
    return "done"


async def run(tools: Sequence[AgentBackendTool], script: Script) -> dict[str, Any]:
    agent = create_agent(script.model, list(tools))
    state: dict[str, Any] = await agent.ainvoke({"messages": [("user", "go")]})
    return state


# -- the workspace: one per session, every call of the run in it -----------------------------------


async def test_one_run_writes_reads_and_runs_in_one_workspace(backend: Backend) -> None:
    script = Script(
        call("write_file", {"path": "notes/a.txt", "content": "hello\n"}),
        call("read_file", {"path": "notes/a.txt"}),
        call("exec", {"command": "cat notes/a.txt && pwd"}),
        call("list_dir", {}),
        done,
    )
    async with session_tools(backend.runner) as tools:
        (workspace,) = backend.workspaces()
        state = await run(tools, script)
    assert state["messages"][-1].content == "done"
    shown = [script.answer(i).content for i in range(4)]
    assert shown == [
        "wrote 6 bytes to notes/a.txt",
        "hello\n",
        f"hello\n{backend.root.resolve() / workspace}\n",
        "notes/",
    ]
    artifact = script.answer(2).artifact
    assert isinstance(artifact, ToolResult)
    assert (artifact.ok, artifact.exit_status, artifact.host) == (True, 0, "local")
    assert backend.workspaces() == []  # removed with the session


async def test_two_sessions_do_not_share_a_workspace(backend: Backend) -> None:
    listings = []
    for _ in range(2):
        script = Script(call("exec", {"command": "ls; touch was-here"}), done)
        async with session_tools(backend.runner) as tools:
            await run(tools, script)
        listings.append(script.answer(0).content)
    assert listings == ["(no output)", "(no output)"]
    assert backend.workspaces() == []


async def test_tools_bound_to_a_session_given_run_there(backend: Backend) -> None:
    async with backend.runner.session() as session:
        tools = await langchain_tools(backend.runner, session)
        for name in ("one", "two"):
            await run(tools, Script(call("write_file", {"path": name, "content": name}), done))
        assert (await session.call(("exec", {"command": "ls"}))).output == "one\ntwo\n"
    assert backend.workspaces() == []
    with pytest.raises(PoolClosed):
        await tools[0].ainvoke({"command": "true"})


async def test_tools_are_async_only(backend: Backend) -> None:
    async with session_tools(backend.runner) as tools:
        with pytest.raises(NotImplementedError, match="ainvoke"):
            await anyio.to_thread.run_sync(tools[0].invoke, {"command": "true"})


# -- what the model is offered ----------------------------------------------------------------------


async def test_the_model_is_bound_the_registry_s_json_schemas(backend: Backend) -> None:
    script = Script(done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
        for tool in tools:
            assert isinstance(tool.args_schema, dict)
    bound = {entry["function"]["name"]: entry["function"] for entry in script.model.bound}
    assert sorted(bound) == sorted([*(t.name for t in builtin_tools()), "outage"])
    for tool in builtin_tools():
        assert bound[tool.name]["description"] == tool.description
        parameters = bound[tool.name]["parameters"]
        assert parameters["properties"] == tool.parameters["properties"]
        assert parameters.get("required", []) == tool.parameters.get("required", [])


# -- failures: an error ToolMessage the model reads, or an exception for the infrastructure ---------


async def test_bad_arguments_reach_the_model_as_an_error_it_acts_on(backend: Backend) -> None:
    def fix(answers: dict[str, ToolMessage]) -> list[Any]:
        (error,) = answers.values()
        assert error.status == "error"
        assert str(error.content).startswith("Error: Invalid arguments for tool 'exec'")
        assert 'unexpected properties "comand"' in str(error.content)
        return [("exec", {"command": "echo fixed"})]

    script = Script(call("exec", {"comand": "echo fixed"}), fix, done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.answer(1).content == "fixed\n"
    assert script.answer(1).status == "success"


async def test_arguments_are_repaired_as_everywhere_else(backend: Backend) -> None:
    script = Script(call("exec", {"argv": '["echo", "repaired"]', "timeout": "5"}), done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.answer(0).content == "repaired\n"


async def test_a_failing_command_shows_its_error_and_output(backend: Backend) -> None:
    script = Script(call("exec", {"command": "echo out; echo err >&2; exit 3"}), done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    answer = script.answer(0)
    assert answer.status == "error"
    assert answer.content == "Error: the command exited with status 3\nout\n[stderr]\nerr\n"


async def test_an_infrastructure_failure_is_raised_not_shown(backend: Backend) -> None:
    script = Script(call("outage", {}), done)
    async with session_tools(backend.runner) as tools:
        with pytest.raises(BackendUnavailable, match=OUTAGE):
            await run(tools, script)
    assert len(script.model.requests) == 1  # the model never got a second turn
    assert backend.workspaces() == []


# -- bounds: time and size --------------------------------------------------------------------------


async def test_a_call_past_its_timeout_is_killed_and_the_model_told(backend: Backend) -> None:
    marker = unique_sleep()  # found in the host's /proc by its command line
    command = f"echo running > started; exec sleep {marker}"
    script = Script(
        call("exec", {"command": command, "timeout": 0.5}),
        call("read_file", {"path": "started"}),
        done,
    )
    with anyio.fail_after(20):
        async with session_tools(backend.runner) as tools:
            await run(tools, script)
    answer = script.answer(0)
    assert answer.status == "error"
    assert str(answer.content).startswith("Error: the command timed out after 0.5 s and was killed")
    assert str(script.answer(1).content) == "running\n"  # the command ran
    assert await none_left(marker) == []  # and its 600 s sleep was killed


async def test_a_tools_timeout_applies_to_every_call(backend: Backend) -> None:
    script = Script(call("exec", {"command": "sleep 30"}), done)
    with anyio.fail_after(20):
        async with session_tools(backend.runner, timeout=0.3) as tools:
            await run(tools, script)
    assert "timed out after 0.3 s" in str(script.answer(0).content)


async def test_large_output_is_bounded_and_says_so(backend: Backend) -> None:
    script = Script(call("exec", {"command": "head -c 100000 /dev/zero | tr '\\0' x"}), done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    answer = script.answer(0)
    shown = str(answer.content)
    assert len(shown.encode()) <= OUTPUT_LIMIT + 64
    assert shown.startswith("x" * 1000)
    assert shown.endswith("x" * 1000)
    assert "bytes omitted" in shown
    assert answer.artifact.truncated is True
    assert answer.artifact.output_bytes == 100000


async def test_cancelling_a_run_kills_its_command_and_removes_its_workspace(
    tmp_path: Path,
) -> None:
    marker = unique_sleep()
    script = Script(call("exec", {"command": f"exec sleep {marker}"}), done)
    async with (
        LocalBackend(pool_config(tmp_path)) as pool,
        Dispatcher(ToolRegistry(builtin_tools()), pool) as dispatcher,
    ):
        async with anyio.create_task_group() as group, session_tools(dispatcher) as tools:
            group.start_soon(run, tools, script)
            pid = await wait_sleeping(marker)  # the command runs: its host pid
            group.cancel_scope.cancel()
        assert await wait_dead(pid, within=10)  # SIGTERM, or SIGKILL after kill_grace (0.5 s)
        assert dispatcher.statistics().sessions_open == 0
    assert [n for n in os.listdir(tmp_path) if n.startswith("agent-backend-ws-")] == []
