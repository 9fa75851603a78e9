"""Dispatcher.call / call_many on the real local backend: the pipeline, every execution kind,
model-caused problems as results, infrastructure failures raised, batches concurrent."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest
from support.proc_helpers import wait_dead

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.dispatch import (
    Backend,
    Command,
    CommandResult,
    DirEntry,
    Dispatcher,
    FileData,
    Host,
    ToolResult,
    builtin_tools,
)
from agent_backend.errors import (
    BackendUnavailable,
    ConfigError,
    PoolClosed,
    ToolArgumentError,
    ToolTimeout,
    WorkerLost,
)
from agent_backend.tools import Tool, ToolCall, ToolRegistry, from_openai

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    config = LocalPoolConfig(isolation="none", workspace_root=str(tmp_path), kill_grace=0.5)
    async with LocalBackend(config) as backend:
        yield backend


def registry(*extra: Tool) -> ToolRegistry:
    return ToolRegistry([*builtin_tools(), *extra])


def command_tool(name: str, argv: list[str], **spec: Any) -> Tool:
    return Tool(
        name=name,
        description="A command tool.",
        parameters={"type": "object", "properties": {"n": {"type": "integer"}}},
        meta={"x-agent-backend": {"command": argv, **spec}},
        source=f"test:{name}",
    )


# -- exec ---------------------------------------------------------------------------------------


async def test_exec_success_and_call_forms(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    by_pair = await dispatcher.call(("exec", {"command": "echo hello"}))
    assert (by_pair.ok, by_pair.output, by_pair.exit_status) == (True, "hello\n", 0)
    assert (by_pair.call_id, by_pair.tool, by_pair.host, by_pair.error) == (
        "call_0",
        "exec",
        "local",
        None,
    )
    by_dict = await dispatcher.call(
        {"id": "abc", "name": "exec", "arguments": '{"argv": ["echo", "a  b"]}'}
    )
    assert (by_dict.call_id, by_dict.output) == ("abc", "a  b\n")
    [openai_call] = from_openai(
        {
            "tool_calls": [
                {
                    "id": "call_x",
                    "type": "function",
                    "function": {"name": "exec", "arguments": '{"command": "printf %s $((6*7))"}'},
                }
            ]
        }
    )
    result = await dispatcher.call(openai_call)
    assert (result.call_id, result.output, result.to_model_message()) == ("call_x", "42", "42")
    with pytest.raises(TypeError):
        await dispatcher.call(42)  # type: ignore[arg-type]


async def test_argv_is_passed_verbatim(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    hostile = "$(touch /tmp/pwned); `id`; rm -rf / ' \" \\"
    result = await dispatcher.call(("exec", {"argv": ["printf", "%s", hostile]}))
    assert result.output == hostile


async def test_exec_stdin_and_env(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    result = await dispatcher.call(
        (
            "exec",
            {
                "command": 'read line; echo "$line/$GREETING"',
                "stdin": "in\n",
                "env": {"GREETING": "hi"},
            },
        )
    )
    assert result.output == "in/hi\n"


async def test_non_zero_exit_is_a_result_with_the_output(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    result = await dispatcher.call(("exec", {"command": "echo partial; echo oops >&2; exit 7"}))
    assert (result.ok, result.exit_status, result.error_type) == (False, 7, "NonZeroExit")
    assert result.output == "partial\n[stderr]\noops\n"
    assert result.output_bytes == len("partial\noops\n")
    assert result.to_model_message() == (
        "Error: the command exited with status 7\npartial\n[stderr]\noops\n"
    )


async def test_timeout_is_a_result_and_kills_the_group(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool, default_timeout=0.5)
    started = time.monotonic()
    result = await dispatcher.call(("exec", {"command": "echo $!; sleep 60 & echo $!; sleep 60"}))
    assert time.monotonic() - started < 3
    assert (result.ok, result.error_type, result.exit_status) == (False, "Timeout", None)
    assert "timed out after 0.5 s" in (result.error or "")
    grandchild = int(result.output.split()[-1])
    assert await wait_dead(grandchild, within=2)


async def test_timeouts_from_the_caller_the_tool_file_and_the_model(pool: LocalBackend) -> None:
    slow = command_tool("slow", ["sleep", "5"], timeout=0.3)
    dispatcher = Dispatcher(
        registry(slow), pool, default_timeout=0.3, max_timeout=0.6, backstop_grace=2
    )

    async def elapsed(call: Any, **kwargs: Any) -> tuple[float, ToolResult]:
        started = time.monotonic()
        result = await dispatcher.call(call, **kwargs)
        return time.monotonic() - started, result

    took, result = await elapsed(("slow", {}))  # the tool file's timeout
    assert result.error_type == "Timeout"
    assert 0.3 <= took < 1.5
    took, result = await elapsed(("slow", {}), timeout=0.1)  # the caller's
    assert result.error_type == "Timeout"
    assert 0.1 <= took < 0.3 + 1
    # The model asks for more than max_timeout: it gets max_timeout.
    took, result = await elapsed(("exec", {"command": "sleep 5", "timeout": 100}))
    assert result.error_type == "Timeout"
    assert 0.6 <= took < 1.5
    # ... and for less: it gets what it asked.
    took, result = await elapsed(("exec", {"command": "sleep 5", "timeout": 0.1}))
    assert result.error_type == "Timeout"
    assert took < 0.3 + 1
    with pytest.raises(ValueError, match="positive"):
        await dispatcher.call(("exec", {"command": "true"}), timeout=0)


async def test_output_is_cut_head_and_tail_with_the_full_size(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool, output_limit=200)
    result = await dispatcher.call(("exec", {"command": "seq 1 100000"}))
    full = "".join(f"{i}\n" for i in range(1, 100001))
    assert result.ok
    assert result.truncated
    assert result.output_bytes == len(full)
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("99999\n100000\n")
    assert len(result.output.encode()) < 200 + 60
    assert f"[... {len(full) - 200} bytes omitted ...]" in result.output


async def test_a_gigabyte_through_the_dispatcher_is_bounded(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool, output_limit=1000)
    result = await dispatcher.call(("exec", {"command": "yes abc | head -c 200000000"}))
    assert result.ok
    assert result.truncated
    assert result.output_bytes == 200_000_000
    assert len(result.output) < 1100


# -- model-caused problems are results --------------------------------------------------------


async def test_unknown_tool_and_bad_arguments_are_results(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    unknown = await dispatcher.call(("exce", {"command": "true"}))
    assert (unknown.ok, unknown.error_type, unknown.host) == (False, "UnknownToolError", None)
    assert "exec" in (unknown.error or "")
    bad = await dispatcher.call(("exec", {"command": "true", "shell": "bash"}))
    assert (bad.ok, bad.error_type) == (False, "ToolArgumentError")
    assert "shell" in (bad.error or "")
    both = await dispatcher.call(("exec", {"command": "true", "argv": ["true"]}))
    assert both.error_type == "ToolArgumentError"
    neither = await dispatcher.call(("exec", {}))
    assert neither.error_type == "ToolArgumentError"
    bad_env = await dispatcher.call(("exec", {"command": "true", "env": {"A=B": "x"}}))
    assert bad_env.error_type == "ToolArgumentError"


async def test_malformed_json_never_runs_with_empty_arguments(pool: LocalBackend) -> None:
    # Unreadable arguments fail closed: run with {}, the tool would do something unasked.
    dispatcher = Dispatcher(registry(), pool)
    result = await dispatcher.call(ToolCall("c1", "exec", '{"command": "echo hi"', "openai"))
    assert (result.ok, result.error_type, result.output) == (False, "ToolArgumentError", "")
    unreadable = await dispatcher.call(ToolCall("c2", "", "", "hermes", error="unclosed block"))
    assert unreadable.error_type == "ToolArgumentError"


async def test_file_tools_outside_a_session_say_so(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    for call in [
        ("read_file", {"path": "a"}),
        ("write_file", {"path": "a", "content": "x"}),
        ("list_dir", {}),
    ]:
        result = await dispatcher.call(call)
        assert (result.ok, result.error_type) == (False, "NoWorkspace")
        assert "session" in (result.error or "")


# -- command tools ------------------------------------------------------------------------------


async def test_command_tool_gets_its_arguments_as_json_on_stdin(pool: LocalBackend) -> None:
    script = "import json, os, sys; a = json.load(sys.stdin); print(a['n'] * 2, os.environ['MODE'])"
    double = command_tool("double", [sys.executable, "-c", script], env={"MODE": "x2"})
    dispatcher = Dispatcher(registry(double), pool)
    result = await dispatcher.call(("double", {"n": "21"}))  # repaired to 21 before it runs
    assert (result.ok, result.output) == (True, "42 x2\n")
    bad = await dispatcher.call(("double", {"n": "many"}))
    assert bad.error_type == "ToolArgumentError"


async def test_command_tool_failure_is_a_result(pool: LocalBackend) -> None:
    failing = command_tool("failing", [sys.executable, "-c", "raise SystemExit('nope')"])
    dispatcher = Dispatcher(registry(failing), pool)
    result = await dispatcher.call(("failing", {}))
    assert (result.ok, result.error_type, result.exit_status) == (False, "NonZeroExit", 1)
    assert "nope" in result.output


# -- Python-function tools ----------------------------------------------------------------------


async def test_function_tools_sync_and_async(pool: LocalBackend) -> None:
    tools = registry()

    @tools.tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    @tools.tool
    async def describe(city: str, days: int = 1) -> dict[str, Any]:
        """Describe a city."""
        await anyio.lowlevel.checkpoint()
        return {"city": city, "days": days, "nan": float("nan")}

    @tools.tool
    def shout(text: str) -> str:
        """Shout."""
        return text.upper()

    dispatcher = Dispatcher(tools, pool)
    added = await dispatcher.call(("add", {"a": 2, "b": "3"}))
    assert (added.ok, added.output, added.exit_status, added.host) == (True, "5", None, None)
    described = await dispatcher.call(("describe", {"city": "Paris"}))
    assert json.loads(described.output) == {"city": "Paris", "days": 1, "nan": "NaN"}
    assert (await dispatcher.call(("shout", {"text": "hi"}))).output == "HI"
    missing = await dispatcher.call(("add", {"a": 1}))
    assert missing.error_type == "ToolArgumentError"


async def test_function_tool_errors_and_timeouts(pool: LocalBackend) -> None:
    tools = registry()

    @tools.tool
    def divide(a: float, b: float) -> float:
        """Divide."""
        return a / b

    @tools.tool
    def refuse(reason: str) -> str:
        """Refuse with a model-facing error."""
        raise ToolArgumentError(f"cannot: {reason}", tool="refuse")

    @tools.tool
    def blocking(seconds: float) -> str:
        """Block a worker thread."""
        time.sleep(seconds)
        return "done"

    @tools.tool
    async def sleepy(seconds: float) -> str:
        """Sleep."""
        await anyio.sleep(seconds)
        return "done"

    @tools.tool
    def big() -> str:
        """A lot of text."""
        return "x" * 10_000

    dispatcher = Dispatcher(tools, pool, output_limit=100)
    zero = await dispatcher.call(("divide", {"a": 1, "b": 0}))
    assert (zero.ok, zero.error_type) == (False, "ToolFailed")
    assert "ZeroDivisionError" in (zero.error or "")
    refused = await dispatcher.call(("refuse", {"reason": "no"}))
    assert (refused.error_type, refused.error) == (
        "ToolArgumentError",
        "Invalid arguments for tool 'refuse': cannot: no\nFix these and call the tool again.",
    )
    for name in ("blocking", "sleepy"):
        started = time.monotonic()
        result = await dispatcher.call((name, {"seconds": 2}), timeout=0.2)
        assert result.error_type == "Timeout", name
        assert time.monotonic() - started < 1.0, name  # a blocked thread is abandoned
    large = await dispatcher.call(("big", {}))
    assert large.truncated
    assert large.output_bytes == 10_000
    assert len(large.output) < 150


# -- batches ------------------------------------------------------------------------------------


async def test_call_many_runs_concurrently_in_order(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    calls: list[Any] = [("exec", {"command": f"sleep 0.5; echo {i}"}) for i in range(8)]
    calls.insert(3, ("exec", {"bogus": 1}))
    calls.insert(6, ("nope", {}))
    started = time.monotonic()
    results = await dispatcher.call_many(calls)
    elapsed = time.monotonic() - started
    assert elapsed < 1.2, elapsed
    assert [r.call_id for r in results] == [f"call_{i}" for i in range(10)]
    assert [r.error_type for r in results] == [
        None,
        None,
        None,
        "ToolArgumentError",
        None,
        None,
        "UnknownToolError",
        None,
        None,
        None,
    ]
    assert [r.output for r in results if r.ok] == [f"{i}\n" for i in range(8)]
    assert await dispatcher.call_many([]) == []


async def test_one_failing_call_never_cancels_the_others(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool, default_timeout=30)
    # The third ends only once the first was killed at its timeout: it outlived that failure
    # on a machine of any speed (both run in the sessionless scratch directory).
    outlive = (
        "while [ ! -s pid1 ]; do sleep 0.01; done; "
        "while kill -0 $(cat pid1) 2>/dev/null; do sleep 0.01; done; echo survived"
    )
    results = await dispatcher.call_many(
        [
            ("exec", {"command": "echo $$ > pid1; exec sleep 60", "timeout": 0.5}),
            ("exec", {"command": "exit 3"}),
            ("exec", {"command": outlive}),
        ]
    )
    assert [r.error_type for r in results] == ["Timeout", "NonZeroExit", None]
    assert results[2].output == "survived\n"


# -- infrastructure failures are raised -------------------------------------------------------


class FakeHost(Host):
    """A host whose run() misbehaves on purpose: hangs past its timeout, or dies."""

    def __init__(self, behaviour: str) -> None:
        self.name = f"fake-{behaviour}"
        self.behaviour = behaviour
        self.calls = 0

    async def run(self, command: Command) -> CommandResult:
        self.calls += 1
        if command.shell == "fine":
            return CommandResult(exit_status=0, host=self.name)
        if self.behaviour == "hang":
            await anyio.sleep(3600)
        raise WorkerLost("connection lost mid-call", host=self.name, backend="fake")

    async def make_workspace(self) -> str:
        raise BackendUnavailable("no workspaces here", backend="fake")

    async def remove_workspace(self, path: str) -> None:
        pass

    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        raise WorkerLost("gone")

    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        raise WorkerLost("gone")

    async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
        raise WorkerLost("gone")

    def calls_in_flight(self) -> int:
        return 0


class FakeBackend(Backend):
    kind: ClassVar[str] = "fake"

    def __init__(self, host: FakeHost) -> None:
        self.host = host

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    @property
    def hosts(self) -> Sequence[Host]:
        return (self.host,)

    def statistics(self) -> None:
        return None


async def test_a_backend_that_ignores_its_timeout_hits_the_backstop() -> None:
    dispatcher = Dispatcher(registry(), FakeBackend(FakeHost("hang")), backstop_grace=0.2)
    started = time.monotonic()
    with pytest.raises(ToolTimeout) as caught:
        await dispatcher.call(("exec", {"command": "sleep 1"}), timeout=0.2)
    assert 0.4 <= time.monotonic() - started < 1.5
    assert (caught.value.timeout, caught.value.host) == (0.2, "fake-hang")
    assert isinstance(caught.value, TimeoutError)


async def test_infrastructure_errors_raise_after_the_rest_of_the_batch() -> None:
    host = FakeHost("die")
    dispatcher = Dispatcher(registry(), FakeBackend(host))
    with pytest.raises(WorkerLost, match="connection lost") as caught:
        await dispatcher.call_many(
            [
                ("exec", {"command": "fine"}),
                ("exec", {"command": "dies"}),
                ("exec", {"command": "dies too"}),
                ("exec", {"command": "fine"}),
            ]
        )
    assert host.calls == 4  # nothing was cancelled
    assert caught.value.__notes__ == ["1 more call(s) of this batch failed too"]
    with pytest.raises(WorkerLost):
        await dispatcher.call(("exec", {"command": "dies"}))


async def test_no_host_up_is_backend_unavailable(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(registry(), pool)
    await pool.aclose()
    with pytest.raises(BackendUnavailable, match="no local host is up"):
        await dispatcher.call(("exec", {"command": "true"}))


# -- configuration errors are raised at construction -----------------------------------------


def test_tools_that_cannot_run_fail_at_construction(tmp_path: Path) -> None:
    pool = LocalBackend(LocalPoolConfig(isolation="none", workspace_root=str(tmp_path)))
    nothing = Tool(name="nothing", meta={}, source="tools/nothing.json")
    with pytest.raises(ConfigError, match="no way to run") as caught:
        Dispatcher(registry(nothing), pool)
    assert (caught.value.file, caught.value.key) == ("tools/nothing.json", "x-agent-backend")
    typo = Tool(name="typo", meta={"x-agent-backend": {"comand": ["ls"]}}, source="t.json")
    with pytest.raises(ConfigError) as caught:
        Dispatcher(registry(typo), pool)
    assert (caught.value.file, caught.value.key) == ("t.json", "x-agent-backend.comand")
    both = Tool(name="both", meta={"x-agent-backend": {"command": ["ls"], "builtin": "exec"}})
    with pytest.raises(ConfigError, match="not both"):
        Dispatcher(registry(both), pool)
    remote = command_tool("remote", ["ls"], backend="ssh")
    with pytest.raises(ConfigError, match="'ssh' pool") as caught:
        Dispatcher(registry(remote), pool)
    assert caught.value.key == "x-agent-backend.backend"
    assert Dispatcher(registry(command_tool("here", ["ls"], backend="local")), pool)
    with pytest.raises(ValueError, match="at least 64 bytes"):
        Dispatcher(registry(), pool, output_limit=10)


async def test_a_tool_added_later_is_checked_at_its_first_call(pool: LocalBackend) -> None:
    tools = registry()
    dispatcher = Dispatcher(tools, pool)
    tools.add(Tool(name="late", meta={"x-agent-backend": {"timeout": -1, "command": ["ls"]}}))
    with pytest.raises(ConfigError, match="timeout"):
        await dispatcher.call(("late", {}))


async def test_a_closed_dispatcher_refuses_calls(pool: LocalBackend) -> None:
    async with Dispatcher(registry(), pool) as dispatcher:
        assert (await dispatcher.call(("exec", {"command": "true"}))).ok
    assert dispatcher.is_closed()
    with pytest.raises(PoolClosed):
        await dispatcher.call(("exec", {"command": "true"}))
