"""pydantic-ai agents on AgentBackendToolset, driven by pydantic-ai's own TestModel and FunctionModel.

The tools run for real on the local pool, in the test process (a Dispatcher)
and through the daemon (a Client); a FunctionModel plays the model and reads
back what the previous calls returned, as a model would. What the model sees
is what ``ToolReturnPart.model_response_str()`` renders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
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

from agent_backend import Dispatcher, ToolRegistry
from agent_backend.backends.local import LocalBackend
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import BackendUnavailable

try:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UserError
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        ModelResponsePart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.models.test import TestModel

    from agent_backend.integrations.pydantic_ai import AgentBackendToolset
except ImportError as exc:
    framework_missing(exc, "pydantic-ai")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
backend = backend_fixture
toolset_daemon = daemon_fixture

Step = Callable[[list[ToolReturnPart]], Sequence[ModelResponsePart]]


class Script:
    """A FunctionModel's function: step ``n`` answers the ``n``-th request from what it returned."""

    def __init__(self, *steps: Step) -> None:
        self.steps = steps
        self.tools: list[Any] = []
        self.returns: list[list[ToolReturnPart]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.tools = info.function_tools
        step = sum(isinstance(message, ModelResponse) for message in messages)
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        returns = [part for part in last.parts if isinstance(part, ToolReturnPart)]
        self.returns.append(returns)
        return ModelResponse(parts=list(self.steps[step](returns)))

    def model(self) -> FunctionModel:
        return FunctionModel(self)


def call(name: str, args: dict[str, Any] | str) -> Callable[[list[ToolReturnPart]], list[Any]]:
    return lambda returns: [ToolCallPart(name, args)]


def done(returns: list[ToolReturnPart]) -> list[Any]:
    return [TextPart("done")]


def seen(returns: list[ToolReturnPart]) -> str:
    """What the model was shown of the one tool result it got."""
    (part,) = returns
    return part.model_response_str()


def error_seen(part: ToolReturnPart) -> str:
    """The error text the model was shown of a failed or retried call (pydantic-ai wraps it)."""
    assert part.outcome in ("failed", "retried")
    shown = json.loads(part.model_response_str())
    assert shown == {"error": part.content}
    return str(shown["error"])


# -- the workspace: one per run, every call of the run in it ---------------------------------------


async def test_one_run_writes_reads_and_runs_in_one_workspace(backend: Backend) -> None:
    during: list[list[str]] = []

    def check_pwd(returns: list[ToolReturnPart]) -> list[Any]:
        during.append(backend.workspaces())
        return [ToolCallPart("list_dir", {})]

    script = Script(
        call("write_file", {"path": "notes/a.txt", "content": "hello\n"}),
        call("read_file", {"path": "notes/a.txt"}),
        call("exec", {"command": "cat notes/a.txt && pwd"}),
        check_pwd,
        done,
    )
    agent = Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)])
    result = await agent.run("take notes")

    assert result.output == "done"
    wrote, read, ran, listed = (seen(returns) for returns in script.returns[1:])
    assert wrote == "wrote 6 bytes to notes/a.txt"
    assert read == "hello\n"
    (workspace,) = during[0]
    assert ran == f"hello\n{backend.root.resolve() / workspace}\n"
    assert listed == "notes/"
    ok = script.returns[3][0].metadata
    assert (ok["ok"], ok["exit_status"], ok["host"]) == (True, 0, "local")
    assert backend.workspaces() == []  # removed when the run ended


async def test_each_run_has_its_own_workspace_unless_the_toolset_is_entered(
    backend: Backend,
) -> None:
    def runs(toolset: AgentBackendToolset) -> tuple[Agent[None, str], Script]:
        script = Script(
            call("exec", {"command": "ls; touch was-here; pwd"}),
            done,
        )
        return Agent(script.model(), toolsets=[toolset]), script

    toolset = AgentBackendToolset(backend.runner)
    outputs = []
    for _ in range(2):
        agent, script = runs(toolset)
        await agent.run("look around")
        outputs.append(seen(script.returns[1]))
    first, second = outputs
    # Each run began empty: a session of its own (under walls the second may be the first's
    # workspace and sandbox made new, at the same path: docs/sandboxes.md).
    assert "was-here" not in first + second
    assert backend.workspaces() == []

    async with toolset:  # entered by hand: one session for every run inside
        assert toolset.session is not None
        outputs = []
        for _ in range(2):
            agent, script = runs(toolset)
            await agent.run("look around")
            outputs.append(seen(script.returns[1]))
        assert len(backend.workspaces()) == 1
    first, second = outputs
    assert "was-here" not in first
    assert "was-here" in second
    assert toolset.session is None
    assert backend.workspaces() == []


async def test_concurrent_runs_do_not_see_each_other(backend: Backend) -> None:
    toolset = AgentBackendToolset(backend.runner)
    listings: dict[str, str] = {}

    async def run(name: str) -> None:
        script = Script(
            call("write_file", {"path": f"{name}.txt", "content": name}),
            call("exec", {"argv": ["ls"]}),
            done,
        )
        await Agent(script.model(), toolsets=[toolset]).run(name)
        listings[name] = seen(script.returns[2])

    async with anyio.create_task_group() as group:
        for name in ("left", "right"):
            group.start_soon(run, name)
    assert listings == {"left": "left.txt\n", "right": "right.txt\n"}
    assert backend.workspaces() == []


async def test_a_session_given_is_used_and_left_open(backend: Backend) -> None:
    async with backend.runner.session() as session:
        toolset = AgentBackendToolset(backend.runner, session=session)
        for content in ("one", "two"):
            script = Script(call("write_file", {"path": content, "content": content}), done)
            await Agent(script.model(), toolsets=[toolset]).run("write")
        result = await session.call(("exec", {"command": "ls"}))
        assert result.output == "one\ntwo\n"
    assert backend.workspaces() == []


# -- what the model is offered ----------------------------------------------------------------------


async def test_the_registry_s_tools_are_offered_with_their_schemas(backend: Backend) -> None:
    script = Script(done)
    await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("hi")
    offered = {tool.name: tool for tool in script.tools}
    expected = {t.name: t for t in builtin_tools()}
    assert sorted(offered) == sorted([*expected, "outage"])
    for name, tool in expected.items():
        assert offered[name].parameters_json_schema == tool.parameters
        assert offered[name].description == tool.description


async def test_dotted_names_are_offered_under_their_export_name(tmp_path: Path) -> None:
    registry = ToolRegistry()

    @registry.tool(name="math.add")
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    script = Script(call("math_add", {"a": "2", "b": 3}), done)  # "2": repaired to 2
    async with (
        LocalBackend(pool_config(tmp_path)) as pool,
        Dispatcher(registry, pool) as dispatcher,
    ):
        await Agent(script.model(), toolsets=[AgentBackendToolset(dispatcher)]).run("add")
    assert [tool.name for tool in script.tools] == ["math_add"]
    assert seen(script.returns[1]) == "5"


async def test_pydantic_ai_s_test_model_calls_every_built_in_tool(tmp_path: Path) -> None:
    """TestModel makes up arguments from each schema: they must pass our checks and run."""
    async with (
        LocalBackend(pool_config(tmp_path)) as pool,
        Dispatcher(ToolRegistry(builtin_tools()), pool) as dispatcher,
    ):
        agent = Agent(TestModel(), toolsets=[AgentBackendToolset(dispatcher)])
        result = await agent.run("use every tool")
    returns = [
        part
        for message in result.all_messages()
        if isinstance(message, ModelRequest)
        for part in message.parts
        if isinstance(part, ToolReturnPart)
    ]
    assert sorted(part.tool_name for part in returns) == sorted(t.name for t in builtin_tools())
    retried = [part.tool_name for part in returns if part.outcome == "retried"]
    assert retried == [], f"TestModel's arguments were refused for {retried}"


async def test_calling_a_tool_outside_a_run_or_session_is_a_usage_error(backend: Backend) -> None:
    toolset = AgentBackendToolset(backend.runner)
    script = Script(done)
    await Agent(script.model(), toolsets=[toolset]).run("hi")
    with pytest.raises(UserError, match="no session"):
        await toolset.call_tool("exec", {"command": "true"}, None, None)  # type: ignore[arg-type]


# -- failures: the model's to fix, the command's to report, the infrastructure's to raise ------------


async def test_bad_arguments_reach_the_model_as_a_retry_it_acts_on(backend: Backend) -> None:
    def fix(returns: list[ToolReturnPart]) -> list[Any]:
        (part,) = returns
        assert part.outcome == "retried"
        assert 'unexpected properties "comand"' in error_seen(part)
        return [ToolCallPart("exec", {"command": "echo fixed"})]

    script = Script(call("exec", {"comand": "echo fixed"}), fix, done)
    await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("echo")
    assert seen(script.returns[2]) == "fixed\n"
    assert script.returns[2][0].outcome == "success"


async def test_arguments_are_repaired_as_everywhere_else(backend: Backend) -> None:
    # A JSON-encoded array where the schema wants an array, a number as a string.
    script = Script(call("exec", {"argv": '["echo", "repaired"]', "timeout": "5"}), done)
    await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("echo")
    assert seen(script.returns[1]) == "repaired\n"


async def test_retries_count_against_pydantic_ai_s_budget(backend: Backend) -> None:
    script = Script(call("read_file", {"path": 7}), call("read_file", {"path": 8}), done)
    toolset = AgentBackendToolset(backend.runner, max_retries=1)
    with pytest.raises(UnexpectedModelBehavior, match="exceeded max retries count of 1"):
        await Agent(script.model(), toolsets=[toolset]).run("read")
    assert "expected string" in error_seen(script.returns[1][0])
    assert backend.workspaces() == []


async def test_a_failing_command_is_shown_to_the_model_without_spending_retries(
    backend: Backend,
) -> None:
    failing = {"command": "echo out; echo err >&2; exit 3"}
    script = Script(*[call("exec", failing)] * 3, done)
    toolset = AgentBackendToolset(backend.runner, max_retries=1)
    result = await Agent(script.model(), toolsets=[toolset]).run("run the tests")
    assert result.output == "done"
    for returns in script.returns[1:]:
        (part,) = returns
        assert part.outcome == "failed"
        assert error_seen(part) == "Error: the command exited with status 3\nout\n[stderr]\nerr\n"


async def test_retry_on_makes_a_failing_command_a_retry(backend: Backend) -> None:
    script = Script(call("exec", {"command": "exit 4"}), done)
    toolset = AgentBackendToolset(backend.runner, retry_on={"ToolArgumentError", "NonZeroExit"})
    await Agent(script.model(), toolsets=[toolset]).run("run")
    (part,) = script.returns[1]
    assert part.outcome == "retried"
    assert "exited with status 4" in error_seen(part)


async def test_a_missing_file_is_reported(backend: Backend) -> None:
    script = Script(call("read_file", {"path": "nope.txt"}), done)
    await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("read")
    (part,) = script.returns[1]
    assert part.outcome == "failed"
    assert "nope.txt" in error_seen(part)


async def test_an_infrastructure_failure_is_raised_not_shown(backend: Backend) -> None:
    script = Script(call("outage", {}), done)
    with pytest.raises(BackendUnavailable, match=OUTAGE):
        await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("search")
    assert len(script.returns) == 1  # the model never got a second turn
    assert backend.workspaces() == []


# -- bounds: time and size --------------------------------------------------------------------------


async def test_a_call_past_its_timeout_is_killed_and_the_model_told(backend: Backend) -> None:
    marker = unique_sleep()  # found in the host's /proc by its command line
    script = Script(
        call("exec", {"command": f"echo running > started; exec sleep {marker}"}),
        call("read_file", {"path": "started"}),
        done,
    )
    toolset = AgentBackendToolset(backend.runner, timeout=0.5)
    with anyio.fail_after(20):
        await Agent(script.model(), toolsets=[toolset]).run("sleep")
    (part,) = script.returns[1]
    assert part.outcome == "failed"
    assert error_seen(part).startswith("Error: the command timed out after 0.5 s and was killed")
    assert seen(script.returns[2]) == "running\n"  # the command ran
    assert await none_left(marker) == []  # and its 600 s sleep was killed


async def test_the_model_s_own_timeout_argument_is_honoured(backend: Backend) -> None:
    script = Script(call("exec", {"command": "sleep 30", "timeout": 0.3}), done)
    with anyio.fail_after(20):
        await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("sleep")
    assert "timed out after 0.3 s" in error_seen(script.returns[1][0])


async def test_large_output_is_bounded_and_says_so(backend: Backend) -> None:
    script = Script(call("exec", {"command": "head -c 100000 /dev/zero | tr '\\0' x"}), done)
    await Agent(script.model(), toolsets=[AgentBackendToolset(backend.runner)]).run("print")
    (part,) = script.returns[1]
    shown = part.model_response_str()
    assert len(shown.encode()) <= OUTPUT_LIMIT + 64
    assert shown.startswith("x" * 1000)
    assert shown.endswith("x" * 1000)
    assert "bytes omitted" in shown
    assert part.metadata["truncated"] is True
    assert part.metadata["output_bytes"] == 100000


async def test_cancelling_a_run_kills_its_command_and_removes_its_workspace(
    tmp_path: Path,
) -> None:
    marker = unique_sleep()
    script = Script(call("exec", {"command": f"exec sleep {marker}"}), done)
    async with (
        LocalBackend(pool_config(tmp_path)) as pool,
        Dispatcher(ToolRegistry(builtin_tools()), pool) as dispatcher,
    ):
        agent = Agent(script.model(), toolsets=[AgentBackendToolset(dispatcher)])
        async with anyio.create_task_group() as group:
            group.start_soon(agent.run, "sleep")
            pid = await wait_sleeping(marker)  # the command runs: its host pid
            group.cancel_scope.cancel()
        assert await wait_dead(pid, within=10)  # SIGTERM, or SIGKILL after kill_grace (0.5 s)
        assert dispatcher.statistics().sessions_open == 0
    assert [n for n in os.listdir(tmp_path) if n.startswith("agent-backend-ws-")] == []
