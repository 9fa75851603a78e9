"""OpenAI Agents SDK runs on agent_backend's FunctionTools, driven by the SDK's own ScriptedModel.

``agents.testing.ScriptedModel`` is the SDK's deterministic ``Model``: each
step here is a responder that reads the tool outputs in the input the runner
sent it (the ``function_call_output`` items) and answers with the next
``function_call``, as a model would. The tools run for real on the local
pool, in the test process (a Dispatcher) and through the daemon (a Client).
"""

from __future__ import annotations

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
from agent_backend.errors import BackendUnavailable, PoolClosed
from agent_backend.schema import strict_schema

try:
    from agents import Agent, FunctionTool, RunConfig, Runner
    from agents.exceptions import UserError
    from agents.strict_schema import ensure_strict_json_schema
    from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

    from agent_backend.integrations.openai_agents import (
        function_tools,
        is_strict_schema,
        session_tools,
    )
except ImportError as exc:
    framework_missing(exc, "openai-agents")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
backend = backend_fixture
toolset_daemon = daemon_fixture
NO_TRACING = RunConfig(tracing_disabled=True)

Outputs = dict[str, str]
Step = Callable[[Outputs], Sequence[Any]]


class Script:
    """The model: step ``n`` answers the ``n``-th request, seeing the tool outputs it carries.

    A step returns output items, or ``(name, arguments)`` pairs for tool
    calls, which get the ids ``call-0``, ``call-1``... in order; :meth:`shown`
    is what the model got back for one of them, read from the next request.
    """

    def __init__(self, *steps: Step) -> None:
        self.seen: list[Outputs] = []
        self.tools: list[Any] = []
        self.calls = 0
        self.model = ScriptedModel([ModelStep.respond(self._responder(step)) for step in steps])

    def _responder(self, step: Step) -> Callable[[ModelCall], Any]:
        def respond(call: ModelCall) -> Any:
            self.tools = call.tools
            items = call.input if isinstance(call.input, list) else []
            self.seen.append(
                {
                    item["call_id"]: item["output"]
                    for item in items
                    if isinstance(item, dict) and item.get("type") == "function_call_output"
                }
            )
            return [self._item(item) for item in step(self.seen[-1])]

        return respond

    def _item(self, item: Any) -> Any:
        if not isinstance(item, tuple):
            return item
        name, arguments = item
        self.calls += 1
        return function_call(name, arguments, call_id=f"call-{self.calls - 1}")

    def shown(self, index: int) -> str:
        """The output of tool call ``index`` as the model's next request carried it."""
        return self.seen[index + 1][f"call-{index}"]


def call(name: str, arguments: dict[str, Any] | str) -> Step:
    return lambda outputs: [(name, arguments)]


def done(outputs: Outputs) -> list[Any]:
    return [assistant_message("done")]


async def run(tools: list[FunctionTool], script: Script) -> Any:
    agent = Agent(name="coder", instructions="Use the tools.", model=script.model, tools=tools)
    result = await Runner.run(agent, "go", run_config=NO_TRACING)
    script.model.assert_complete()
    return result


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
        result = await run(tools, script)
    assert result.final_output == "done"
    assert script.shown(0) == "wrote 6 bytes to notes/a.txt"
    assert script.shown(1) == "hello\n"
    assert script.shown(2) == f"hello\n{backend.root.resolve() / workspace}\n"
    assert script.shown(3) == "notes/"
    assert backend.workspaces() == []  # removed with the session


async def test_two_sessions_do_not_share_a_workspace(backend: Backend) -> None:
    listings = []
    for _ in range(2):
        script = Script(
            call("exec", {"command": "ls; touch was-here"}),
            done,
        )
        async with session_tools(backend.runner) as tools:
            await run(tools, script)
        listings.append(script.shown(0))
    assert listings == ["(no output)", "(no output)"]
    assert backend.workspaces() == []


async def test_tools_bound_to_a_session_given_run_there(backend: Backend) -> None:
    async with backend.runner.session() as session:
        tools = await function_tools(backend.runner, session)
        for name in ("one", "two"):
            script = Script(
                call("write_file", {"path": name, "content": name}),
                done,
            )
            await run(tools, script)
        assert (await session.call(("exec", {"command": "ls"}))).output == "one\ntwo\n"
    assert backend.workspaces() == []


async def test_a_tool_used_after_its_session_closed_raises(backend: Backend) -> None:
    async with session_tools(backend.runner) as tools:
        pass
    script = Script(call("exec", {"command": "true"}), done)
    with pytest.raises(UserError, match="Error running tool exec") as raised:
        await run(tools, script)
    assert isinstance(raised.value.__cause__, PoolClosed)


# -- what the model is offered ----------------------------------------------------------------------


async def test_the_registry_s_tools_are_offered_strict_with_their_strict_variant(
    backend: Backend,
) -> None:
    script = Script(done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    offered = {tool.name: tool for tool in script.tools}
    assert sorted(offered) == sorted([*(t.name for t in builtin_tools()), "outage"])
    for tool in builtin_tools():
        function = offered[tool.name]
        assert isinstance(function, FunctionTool)
        assert function.description == tool.description
        assert function.strict_json_schema is True
        assert function.params_json_schema == strict_schema(tool.parameters)
        assert ensure_strict_json_schema(dict(function.params_json_schema)) == (
            function.params_json_schema
        )


async def test_strict_false_offers_the_canonical_schemas(backend: Backend) -> None:
    async with session_tools(backend.runner, strict=False) as tools:
        offered = {tool.name: tool for tool in tools}
    for tool in builtin_tools():
        assert offered[tool.name].strict_json_schema is False
        assert offered[tool.name].params_json_schema == tool.parameters


async def test_calls_written_against_the_strict_variant_mean_the_canonical_call(
    backend: Backend,
) -> None:
    # What a model in strict mode must send: every property, null for those it leaves
    # out, the environment as name/value pairs.
    script = Script(
        call(
            "exec",
            {
                "command": "echo $GREETING; cat",
                "argv": None,
                "timeout": None,
                "stdin": "from stdin",
                "env": [{"name": "GREETING", "value": "hi"}],
            },
        ),
        call("write_file", {"path": "a.txt", "content": "0123456789"}),
        call("read_file", {"path": "a.txt", "offset": None, "limit": None}),
        call("list_dir", {"path": None}),
        done,
    )
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.shown(0) == "hi\nfrom stdin"
    assert script.shown(2) == "0123456789"
    assert script.shown(3) == "a.txt  10"


async def test_a_strict_call_giving_both_command_and_argv_is_refused(backend: Backend) -> None:
    both = {"command": "true", "argv": ["true"], "timeout": None, "stdin": None, "env": None}
    script = Script(call("exec", both), done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.shown(0).startswith("Error: Invalid arguments for tool 'exec'")


def test_strict_only_when_strict_mode_takes_the_schema_unchanged() -> None:
    closed = {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
        "additionalProperties": False,
    }
    assert is_strict_schema(closed)
    assert not is_strict_schema({**closed, "required": []})  # the SDK would require "path"
    assert not is_strict_schema({**closed, "additionalProperties": {"type": "string"}})


# -- failures: text the model reads, or an exception for the infrastructure -------------------------


async def test_bad_arguments_reach_the_model_as_text_it_acts_on(backend: Backend) -> None:
    def fix(outputs: Outputs) -> list[Any]:
        error = outputs["call-0"]
        assert error.startswith("Error: Invalid arguments for tool 'exec'")
        assert 'unexpected properties "comand"' in error
        return [("exec", {"command": "echo fixed"})]

    script = Script(call("exec", {"comand": "echo fixed"}), fix, done)
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.shown(1) == "fixed\n"


async def test_malformed_json_is_refused_not_run_with_nothing(backend: Backend) -> None:
    script = Script(
        call("write_file", '{"path": "a.txt", "content": "x"'),  # unclosed
        call("list_dir", {}),
        done,
    )
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.shown(0).startswith("Error: Invalid arguments for tool 'write_file'")
    assert "not valid JSON" in script.shown(0)
    assert script.shown(1) == "(empty)"  # nothing was written


async def test_a_failing_command_shows_its_error_and_output(backend: Backend) -> None:
    script = Script(
        call("exec", {"command": "echo out; echo err >&2; exit 3"}),
        done,
    )
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    assert script.shown(0) == "Error: the command exited with status 3\nout\n[stderr]\nerr\n"


async def test_an_infrastructure_failure_is_raised_not_shown(backend: Backend) -> None:
    script = Script(call("outage", {}), done)
    async with session_tools(backend.runner) as tools:
        with pytest.raises(UserError, match="Error running tool outage") as raised:
            await run(tools, script)
    # The SDK ends the run with its UserError, raised from ours.
    assert isinstance(raised.value.__cause__, BackendUnavailable)
    assert str(raised.value.__cause__) == OUTAGE
    assert len(script.seen) == 1  # the model never got a second turn
    assert backend.workspaces() == []


# -- bounds: time and size --------------------------------------------------------------------------


async def test_a_call_past_its_timeout_is_killed_and_the_model_told(backend: Backend) -> None:
    marker = unique_sleep()  # found in the host's /proc by its command line
    script = Script(
        call("exec", {"command": f"echo running > started; exec sleep {marker}"}),
        call("read_file", {"path": "started"}),
        done,
    )
    with anyio.fail_after(20):
        async with session_tools(backend.runner, timeout=0.5) as tools:
            await run(tools, script)
    assert script.shown(0).startswith("Error: the command timed out after 0.5 s and was killed")
    assert script.shown(1) == "running\n"  # the command ran
    assert await none_left(marker) == []  # and its 600 s sleep was killed


async def test_large_output_is_bounded_and_says_so(backend: Backend) -> None:
    script = Script(
        call("exec", {"command": "head -c 100000 /dev/zero | tr '\\0' x"}),
        done,
    )
    async with session_tools(backend.runner) as tools:
        await run(tools, script)
    shown = script.shown(0)
    assert len(shown.encode()) <= OUTPUT_LIMIT + 64
    assert shown.startswith("x" * 1000)
    assert shown.endswith("x" * 1000)
    assert "bytes omitted" in shown


async def test_cancelling_a_run_kills_its_command_and_removes_its_workspace(
    tmp_path: Path,
) -> None:
    marker = unique_sleep()
    script = Script(
        call("exec", {"command": f"exec sleep {marker}"}),
        done,
    )
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
