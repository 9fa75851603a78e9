"""The MCP client matrix's cells: what each scenario sends, and what a user of any client must see.

A driver per client (``tests/support/mcp_client_inproc.py`` for the clients in ``.venv``,
``tests/support/mcp_client_v1.py`` for those that need the MCP SDK 1.x, ``tests/support/mcp_client_inspector.py``
for the MCP Inspector) runs a scenario's calls in one MCP session and reports an
:class:`Outcome`: the tools the client (or, for a framework, the model) was offered, and for
each call the text that reached the model, whether it was flagged as an error, and its
``structuredContent`` where the client exposes it. Frameworks are driven by a scripted model
that makes the scenario's calls one per turn, so a step's text is what the framework put in
the model's next request.

The checks below are the same for every client: they are the spec, not a description of
what some client happens to do. This module never imports a client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import anyio

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = {"exec", "read_file", "write_file", "list_dir"}
#: Bytes of output the dispatcher keeps by default (``Dispatcher(output_limit=...)``).
OUTPUT_LIMIT = 16384
#: Seconds a command may take to disappear after its call ended: the pool's SIGTERM-to-SIGKILL
#: grace (2 s) and some slack for a loaded machine.
GONE_WITHIN = 15.0

CELLS = (
    "list",
    "call",
    "output",
    "bad_args",
    "timeout",
    "client_timeout",
    "large_output",
    "session",
)


@dataclasses.dataclass(frozen=True)
class Server:
    """Where a client finds the server: a command it launches (stdio) or a URL and token (HTTP)."""

    transport: Literal["stdio", "http"]
    command: tuple[str, ...] = ()
    cwd: str | None = None
    url: str | None = None
    token: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stdio_server() -> Server:
    """``agent-backend mcp`` with the built-in tools, as an MCP client would launch it."""
    import sys

    return Server(
        "stdio", command=(sys.executable, "-m", "agent_backend.cli", "mcp"), cwd=str(ROOT)
    )


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class Step:
    """One call as the model saw it."""

    text: str
    #: Whether the client flagged it as an error; None when the client has no such flag
    #: (OpenAI Agents hands the model a plain ``function_call_output``).
    is_error: bool | None
    #: The result's ``structuredContent``, for clients that expose the raw result.
    structured: Any = None


@dataclasses.dataclass
class Outcome:
    #: Tool name -> the input schema the client offered (to the model, for frameworks).
    tools: dict[str, Any]
    steps: list[Step]
    #: ``"Type: message"`` if the client or the framework's run raised instead of returning.
    raised: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Outcome:
        steps = [Step(**step) for step in data["steps"]]
        return cls(tools=data["tools"], steps=steps, raised=data.get("raised"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The outcome for a failure message: tool names, steps, what was raised."""
        shown = {**self.to_json(), "tools": sorted(self.tools)}
        return json.dumps(shown, indent=1, default=str)[:4000]


@dataclasses.dataclass
class Scenario:
    cell: str
    calls: list[Call]
    #: Seconds after which the client itself gives up on a call (its own timeout option).
    client_timeout: float | None = None
    #: A file the test writes once it sees the command run (the timeout cells; the command
    #: itself runs in a sandbox and cannot write outside its workspace).
    started: Path | None = None
    #: A string found in the command line of every process the command starts: the duration
    #: of its ``sleep``.
    marker: str | None = None
    #: The calls must share one MCP session (a client that opens one per call needs its
    #: session mode here).
    one_session: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "cell": self.cell,
            "calls": [dataclasses.asdict(call) for call in self.calls],
            "client_timeout": self.client_timeout,
            "started": None if self.started is None else str(self.started),
        }


def exec_call(command: str, **extra: Any) -> Call:
    return Call("exec", {"command": command, **extra})


def build(cell: str, workdir: Path) -> Scenario:
    """The calls of ``cell``, with fresh markers, and a place for its files in ``workdir``."""
    nonce = secrets.token_hex(4)
    if cell == "list":
        return Scenario(cell, [])
    if cell == "call":
        return Scenario(cell, [exec_call(f"echo call-{nonce}")])
    if cell == "output":
        return Scenario(cell, [exec_call(f"echo out-{nonce}; echo err-{nonce} >&2; exit 3")])
    if cell == "bad_args":
        return Scenario(
            cell, [Call("exec", {"command": 5}), exec_call(f"echo fixed-{nonce}")], one_session=True
        )
    if cell in ("timeout", "client_timeout"):
        started = workdir / f"started-{nonce}"
        # A sleep of a duration no other process has: its digits find every process it started,
        # and 600 s cannot end by itself within the waits of wait_gone.
        marker = f"600.{int(nonce, 16) % 10**6:06d}"
        command = f"sleep {marker}; echo finished-{nonce}"
        if cell == "timeout":
            return Scenario(cell, [exec_call(command, timeout=1)], started=started, marker=marker)
        return Scenario(
            cell, [exec_call(command)], client_timeout=2.0, started=started, marker=marker
        )
    if cell == "large_output":
        return Scenario(cell, [exec_call("seq 1 200000")])
    if cell == "session":
        path = f"notes-{nonce}/plan.txt"
        return Scenario(
            cell,
            [
                Call("write_file", {"path": path, "content": f"note-{nonce}\n"}),
                Call("read_file", {"path": path}),
                Call("list_dir", {"path": f"notes-{nonce}"}),
            ],
            one_session=True,
        )
    raise ValueError(f"unknown cell {cell!r}")


# -- checks ---------------------------------------------------------------------------------------


def _nonce_of(call: Call, prefix: str) -> str:
    command = str(call.arguments["command"])
    start = command.index(prefix)
    return command[start : start + len(prefix) + 8]


def _structured_carries(step: Step, *needles: str) -> None:
    """Results every client reads: a ``structuredContent`` (which some clients show instead
    of the text) carries the same facts as the text, or is absent."""
    if step.structured is None:
        return
    dumped = json.dumps(step.structured)
    missing = [needle for needle in needles if needle not in dumped]
    assert not missing, f"structuredContent lacks {missing}: {dumped[:1000]}"


def _steps(outcome: Outcome, count: int) -> list[Step]:
    assert outcome.raised is None, f"the client raised: {outcome.raised}\n{outcome.describe()}"
    assert len(outcome.steps) == count, f"expected {count} results\n{outcome.describe()}"
    return outcome.steps


def check_list(scenario: Scenario, outcome: Outcome) -> None:
    assert outcome.raised is None, outcome.describe()
    assert set(outcome.tools) >= BUILTINS, sorted(outcome.tools)
    properties = outcome.tools["exec"].get("properties", {})
    assert {"command", "argv"} <= set(properties), outcome.tools["exec"]
    for name in BUILTINS:
        schema = outcome.tools[name]
        assert schema.get("type") == "object", (name, schema)


def check_call(scenario: Scenario, outcome: Outcome) -> None:
    (step,) = _steps(outcome, 1)
    expected = _nonce_of(scenario.calls[0], "call-")
    assert step.is_error is not True, outcome.describe()
    assert expected in step.text, outcome.describe()
    assert "Error" not in step.text, outcome.describe()
    _structured_carries(step, expected)


def check_output(scenario: Scenario, outcome: Outcome) -> None:
    (step,) = _steps(outcome, 1)
    out = _nonce_of(scenario.calls[0], "out-")
    err = _nonce_of(scenario.calls[0], "err-")
    assert step.is_error is not False, (
        f"a failed command must read as an error\n{outcome.describe()}"
    )
    for needle in ("exited with status 3", out, err):
        assert needle in step.text, f"the model does not see {needle!r}\n{outcome.describe()}"
    _structured_carries(step, "exited with status 3", out, err)


def check_bad_args(scenario: Scenario, outcome: Outcome) -> None:
    bad, fixed = _steps(outcome, 2)
    assert bad.is_error is not False, outcome.describe()
    # What the model needs to fix its call: which argument, and what was expected.
    assert "/command" in bad.text, outcome.describe()
    assert "string" in bad.text, outcome.describe()
    expected = _nonce_of(scenario.calls[1], "fixed-")
    assert fixed.is_error is not True, outcome.describe()
    assert expected in fixed.text, outcome.describe()


def check_timeout(scenario: Scenario, outcome: Outcome) -> None:
    (step,) = _steps(outcome, 1)
    assert step.is_error is not False, outcome.describe()
    assert "timed out" in step.text, outcome.describe()
    assert "finished-" not in step.text, outcome.describe()
    _structured_carries(step, "timed out")


def check_client_timeout(scenario: Scenario, outcome: Outcome) -> None:
    """The client gave up: an error result (a framework's own wording, which may hide the
    reason), or an exception that says it timed out, not some other failure; no end shown."""
    for step in outcome.steps:
        assert step.is_error is not False, outcome.describe()
        assert "finished-" not in step.text, outcome.describe()
    if outcome.raised is not None:
        said = outcome.raised.lower()
        assert "timed out" in said or "timeout" in said or "interrupted" in said, (
            f"the client's own timeout surfaced as something else: {outcome.raised}"
        )
    else:
        assert outcome.steps, f"the call neither raised nor returned\n{outcome.describe()}"


def check_large_output(scenario: Scenario, outcome: Outcome) -> None:
    (step,) = _steps(outcome, 1)
    assert step.is_error is not True, outcome.describe()
    # seq 1 200000 prints 1.3 MB: what reaches the model is bounded, keeps the end, and says
    # that the middle was cut.
    assert len(step.text) < 3 * OUTPUT_LIMIT, f"{len(step.text)} characters reached the model"
    assert "200000" in step.text, step.text[-300:]
    assert "omitted" in step.text, step.text[:300]


def check_session(scenario: Scenario, outcome: Outcome) -> None:
    wrote, read, listed = _steps(outcome, 3)
    note = scenario.calls[0].arguments["content"].strip()
    for step in (wrote, read, listed):
        assert step.is_error is not True, outcome.describe()
    assert note in read.text, f"read_file does not see what write_file wrote\n{outcome.describe()}"
    assert "plan.txt" in listed.text, outcome.describe()


CHECKS: dict[str, Callable[[Scenario, Outcome], None]] = {
    "list": check_list,
    "call": check_call,
    "output": check_output,
    "bad_args": check_bad_args,
    "timeout": check_timeout,
    "client_timeout": check_client_timeout,
    "large_output": check_large_output,
    "session": check_session,
}


# -- the processes a command started ----------------------------------------------------------------


def processes_with(marker: str, *, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Live (not zombie) processes with ``marker`` in their command line."""
    needle = marker.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def command_processes(scenario: Scenario) -> list[int]:
    """Live processes of the scenario's command itself: its shell (``sh -c COMMAND``) and its
    ``sleep MARKER``, never a client whose command line merely quotes the command."""
    assert scenario.marker is not None
    command = str(scenario.calls[0].arguments["command"]).encode()
    found = []
    for pid in processes_with(scenario.marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if command in argv[1:] or argv[1:] == [scenario.marker.encode()]:
            found.append(pid)
    return found


async def watch_started(scenario: Scenario) -> None:
    """Write ``scenario.started`` as soon as the command runs, seen in the host's ``/proc``
    (run beside the client, cancelled when it is done; the command runs in a sandbox and
    cannot write outside its workspace): the proof that the command ran, and what the
    Inspector's driver waits for before its Ctrl-C."""
    assert scenario.started is not None
    # Each look reads every process's command line: in a worker thread, never on the loop the
    # client runs on (on a busy machine a scan on the loop starved the client's own start).
    while not await anyio.to_thread.run_sync(command_processes, scenario):  # noqa: ASYNC110
        await anyio.sleep(0.05)  # a state in /proc: no event to wait on
    scenario.started.write_text("running\n")


async def wait_gone(
    scenario: Scenario, *, exclude: frozenset[int] = frozenset(), within: float = GONE_WITHIN
) -> None:
    """Assert that the scenario's command ran, then wait (bounded) until all it started is gone."""
    assert scenario.started is not None
    assert scenario.marker is not None
    assert scenario.started.exists(), "the command never started"
    with anyio.move_on_after(within):
        while processes_with(scenario.marker, exclude=exclude):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    left = processes_with(scenario.marker, exclude=exclude)
    assert not left, f"the command is still running {within:g} s after its call ended: pids {left}"


def kill_leftovers(scenario: Scenario, *, exclude: frozenset[int] = frozenset()) -> None:
    """SIGKILL what a failed test left running (processes of this test's command only)."""
    if scenario.marker is None:
        return
    for pid in processes_with(scenario.marker, exclude=exclude):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
