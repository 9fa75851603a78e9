"""Cancellation over MCP ends the command: its process group is killed, its long sleep gone.

Each test runs ``exec`` with a command that sleeps for 600 s, a duration no other process
has (then would echo). Once that sleep shows in the host's ``/proc`` (the command runs in a
sandbox, with pids of its own namespace: the test finds it by its command line), the client
gives up in one of the ways MCP has (its read timeout, its caller cancelled, an explicit
``notifications/cancelled``, a dropped connection); the test then waits, bounded, for every
process of the command's host process group, and every process with its sleep's duration in
its command line, to be gone: a 600 s sleep cannot end by itself within that wait. On stdio
and on the daemon's ``/mcp``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import httpx2
import mcp
import pytest
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from support.daemon_fixtures import ROOT, Daemon, daemon_fixture  # noqa: F401
from support.proc_helpers import (
    group_alive,
    kill_marked,
    pid_alive,
    process_group,
    processes_with,
    unique_sleep,
    wait_sleeping,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

_MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


class Marked:
    """A command that sleeps 600 s (a duration of its own), then would echo ``finished``."""

    def __init__(self) -> None:
        self.marker = unique_sleep()
        self.command = f"sleep {self.marker}; echo finished"

    async def wait_started(self, within: float = 15.0) -> int:
        """The host process group of the command, once its sleep runs."""
        pid = await wait_sleeping(self.marker, within)
        pgid = process_group(pid)
        assert pgid is not None, "the command's sleep ended before the client gave up"
        return pgid

    async def assert_ended(self, pgid: int, within: float = 10.0) -> None:
        try:
            await _until(lambda: not group_alive(pgid) and not processes_with(self.marker), within)
        finally:
            kill_marked(self.marker)


async def _until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait, bounded, for a state outside this process (/proc): no event to await. Each look
    scans /proc in a worker thread, off the loop that the client under test runs on."""
    with anyio.fail_after(within):
        while not await anyio.to_thread.run_sync(predicate):  # noqa: ASYNC110
            await anyio.sleep(0.02)


def _stdio_client() -> mcp.Client:
    server = mcp.StdioServerParameters(
        command=sys.executable, args=["-m", "agent_backend.cli", "mcp"], cwd=str(ROOT)
    )
    return mcp.Client(server)


def _http_client(daemon: Daemon) -> Callable[[], Any]:
    import contextlib

    @contextlib.asynccontextmanager
    async def open_client() -> AsyncIterator[mcp.Client]:
        async with httpx2.AsyncClient(headers=daemon.headers(), timeout=30) as http:
            transport = streamable_http_client(f"{daemon.url}/mcp", http_client=http)
            async with mcp.Client(transport) as client:
                yield client

    return open_client


async def _read_timeout(client: mcp.Client) -> None:
    marked = Marked()
    pgid: list[int] = []

    async def watch() -> None:
        pgid.append(await marked.wait_started())

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        with pytest.raises(MCPError, match=r"[Tt]imed out|timeout"):
            await client.call_tool("exec", {"command": marked.command}, read_timeout_seconds=2.0)
    await marked.assert_ended(pgid[0])
    # The connection is still good for the next call.
    assert (await client.call_tool("exec", {"command": "echo after"})).content[0].text == "after\n"


async def _caller_cancelled(client: mcp.Client) -> None:
    marked = Marked()
    async with anyio.create_task_group() as group:
        group.start_soon(client.call_tool, "exec", {"command": marked.command})
        pgid = await marked.wait_started()
        group.cancel_scope.cancel()  # the SDK sends notifications/cancelled
    await marked.assert_ended(pgid)
    assert (await client.call_tool("exec", {"command": "echo after"})).content[0].text == "after\n"


async def test_stdio_read_timeout_kills_the_command() -> None:
    async with _stdio_client() as client:
        await _read_timeout(client)


async def test_stdio_cancelled_caller_kills_the_command() -> None:
    async with _stdio_client() as client:
        await _caller_cancelled(client)


async def test_stdio_client_gone_kills_the_command() -> None:
    marked = Marked()
    async with anyio.create_task_group() as group:

        async def call() -> None:
            async with _stdio_client() as client:
                await client.call_tool("exec", {"command": marked.command})

        group.start_soon(call)
        pgid = await marked.wait_started()
        group.cancel_scope.cancel()  # the client closes the server's stdin and goes
    await marked.assert_ended(pgid)


async def test_stdio_writes_nothing_after_stdin_closed() -> None:
    # A client that closed stdin has stopped reading (mcp 1.x fails on a late message).
    marked = Marked()
    lines = [
        {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "exec", "arguments": {"command": marked.command}},
        },
    ]
    process = await anyio.open_process(
        [sys.executable, "-m", "agent_backend.cli", "mcp"], cwd=str(ROOT), stderr=None
    )
    async with process:
        assert process.stdin is not None
        assert process.stdout is not None
        await process.stdin.send(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        pgid = await marked.wait_started()
        await process.stdin.aclose()
        written = b""
        with anyio.fail_after(15):
            async for chunk in process.stdout:
                written += chunk
            assert await process.wait() == 0
    await marked.assert_ended(pgid)
    replies = [json.loads(line) for line in written.splitlines()]
    assert [reply["id"] for reply in replies] == [0]  # initialize's answer, nothing after


async def test_http_read_timeout_kills_the_command(daemon: Daemon) -> None:
    async with _http_client(daemon)() as client:
        await _read_timeout(client)


async def test_http_cancelled_caller_kills_the_command(daemon: Daemon) -> None:
    async with _http_client(daemon)() as client:
        await _caller_cancelled(client)


async def _initialize(http: httpx.AsyncClient) -> dict[str, str]:
    response = await http.post(
        "/mcp",
        json={
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"},
            },
        },
        headers=_MCP_HEADERS,
    )
    assert response.status_code == 200, response.text
    return {
        **_MCP_HEADERS,
        "Mcp-Session-Id": response.headers["mcp-session-id"],
        "MCP-Protocol-Version": "2025-06-18",
    }


def _call(request_id: int, command: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "exec", "arguments": {"command": command}},
    }


async def test_http_notifications_cancelled_kills_the_command(
    daemon: Daemon,
) -> None:
    marked = Marked()
    answers: list[httpx.Response] = []
    async with daemon.async_http(timeout=30) as http:
        headers = await _initialize(http)

        async def call() -> None:
            answers.append(await http.post("/mcp", json=_call(7, marked.command), headers=headers))

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            pgid = await marked.wait_started()
            cancel = {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": 7, "reason": "the user stopped it"},
            }
            response = await http.post("/mcp", json=cancel, headers=headers)
            assert response.status_code == 202
        await marked.assert_ended(pgid)
    # No response to a cancelled request, as the spec asks: on HTTP, 202 and no body.
    assert answers[0].status_code == 202
    assert answers[0].content == b""


async def test_http_delete_ends_the_sessions_calls(daemon: Daemon) -> None:
    marked = Marked()
    answers: list[httpx.Response] = []
    async with daemon.async_http(timeout=30) as http:
        headers = await _initialize(http)

        async def call() -> None:
            answers.append(await http.post("/mcp", json=_call(8, marked.command), headers=headers))

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            pgid = await marked.wait_started()
            assert (await http.delete("/mcp", headers=headers)).status_code == 204
        await marked.assert_ended(pgid)
    assert answers[0].status_code == 202


async def test_http_read_timeout_then_leaving_at_once(daemon: Daemon) -> None:
    # The client gives up and closes straight away (DELETE while the call is being
    # cancelled): nothing the server still sends may crash the closing client.
    marked = Marked()
    started: list[int] = []

    async def watch() -> None:
        started.append(await marked.wait_started())

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        with pytest.raises(BaseException) as caught:  # noqa: PT011 - the SDK wraps it in groups
            async with _http_client(daemon)() as client:
                await client.call_tool(
                    "exec", {"command": marked.command}, read_timeout_seconds=2.0
                )
    leaves = list(_leaves(caught.value))
    assert leaves, caught.value
    for leaf in leaves:  # the timeout, and nothing else (no ClosedResourceError)
        assert isinstance(leaf, MCPError), repr(leaf)
        assert "timed out" in str(leaf)
    await marked.assert_ended(started[0])


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


async def test_http_stateless_notifications_cancelled(daemon: Daemon) -> None:
    # Without a session id, requests and cancellations meet in the token's stateless session.
    marked = Marked()
    async with daemon.async_http(timeout=30) as http:

        async def call() -> None:
            await http.post("/mcp", json=_call("c-1", marked.command), headers=_MCP_HEADERS)

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            pgid = await marked.wait_started()
            cancel = {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": "c-1"},
            }
            assert (await http.post("/mcp", json=cancel, headers=_MCP_HEADERS)).status_code == 202
        await marked.assert_ended(pgid)


async def _disconnect_during(daemon: Daemon, marked: Marked, headers: dict[str, str]) -> int:
    async with anyio.create_task_group() as group:

        async def call() -> None:
            async with daemon.async_http(timeout=30) as doomed:
                await doomed.post("/mcp", json=_call(1, marked.command), headers=headers)

        group.start_soon(call)
        pgid = await marked.wait_started()
        group.cancel_scope.cancel()  # the connection is closed mid-request
    return pgid


async def test_http_disconnect_kills_the_command(daemon: Daemon) -> None:
    marked = Marked()
    async with daemon.async_http(timeout=30) as http:
        headers = await _initialize(http)
        pgid = await _disconnect_during(daemon, marked, headers)
        await marked.assert_ended(pgid)
        # The session lives on: a later call on it runs.
        after = await http.post("/mcp", json=_call(2, "echo after"), headers=headers)
        assert after.json()["result"]["content"][0]["text"] == "after\n"


async def test_http_client_timeout_kills_the_command(daemon: Daemon) -> None:
    # An HTTP client's own timeout is a disconnect too.
    marked = Marked()
    async with daemon.async_http(timeout=30) as http:
        headers = await _initialize(http)
    started: list[int] = []

    async def watch() -> None:
        started.append(await marked.wait_started())

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        async with daemon.async_http(timeout=httpx.Timeout(30, read=2.0)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/mcp", json=_call(1, marked.command), headers=headers)
    await marked.assert_ended(started[0])


async def test_the_pid_helpers_see_a_live_process() -> None:
    # The checks above would pass vacuously if the helpers never saw anything: the same
    # command, run by a shell of this host in a process group of its own.
    marked = Marked()
    process = await anyio.open_process(["sh", "-c", marked.command], start_new_session=True)
    try:
        pgid = await marked.wait_started()
        assert pgid == process.pid
        assert pid_alive(process.pid)
        assert group_alive(pgid)
        assert len(processes_with(marked.marker)) == 2  # the shell and its sleep
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
    await marked.assert_ended(pgid)
    assert not group_alive(pgid)
