"""One set of limits for every route, against a real daemon on 127.0.0.1.

Every tool call holds one of its token's ``max_concurrent_per_token``
slots, whichever route carries it: a batch on ``/v1/batch`` or on ``/mcp``
takes one per call before any runs, all or none (429 with ``Retry-After``),
and one that could never fit is refused with 422; ``/mcp`` batches obey
``max_batch`` as ``/v1/batch`` does. A session at its most calls in flight
answers a "busy, retry" error without internals, the session cap sends
``Retry-After`` and spares the token's stateless MCP session, and each
setting ``serve`` has reaches what it sets (the dispatcher's, uvicorn's).

Calls are held in flight by the ``wait`` tool, which returns once the test
opens its gate: concurrency is proved by states, never by sleeps.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import re
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from support.daemon_fixtures import OTHER_TOKEN, TALLY, TOKEN, Daemon, make_registry
from support.serve_child import closed_by_peer, read_one_response, serve_child

import agent_backend.dispatch.session as session_module
from agent_backend.daemon import DaemonSettings, run_in_thread
from agent_backend.daemon.mcp_http import _array_longer_than
from agent_backend.errors import TooManySessions
from agent_backend.pool_file import DEFAULT_POOL, with_isolation
from agent_backend.tools import ToolRegistry
from agent_backend.wire import error_from_wire

pytestmark = pytest.mark.timeout(120)

#: Gates the ``wait`` tool waits on, by key; a test opens one with ``GATES[key].set()``.
GATES: collections.defaultdict[str, threading.Event] = collections.defaultdict(threading.Event)
#: Runs of the ``wait`` tool started, by key.
STARTED: collections.Counter[str] = collections.Counter()

MCP_BATCH = {
    "Accept": "application/json, text/event-stream",
    "MCP-Protocol-Version": "2025-03-26",
}
#: No walls: these tests are about the daemon's limits, and a walled workspace costs more.
UNWALLED = with_isolation(DEFAULT_POOL, "none")


def _registry() -> ToolRegistry:
    registry = make_registry()

    @registry.tool
    async def wait(key: str) -> str:
        """Wait until the test opens the gate ``key``.

        Args:
            key: The gate.
        """
        STARTED[key] += 1
        gate = GATES[key]
        while not gate.is_set():  # noqa: ASYNC110 - a gate of another thread: nothing to await
            await anyio.sleep(0.01)
        return "opened"

    return registry


@contextlib.contextmanager
def limited(**settings: Any) -> Iterator[Daemon]:
    """A daemon with ``settings`` over the defaults (port 0, both test tokens)."""
    options: dict[str, Any] = {"tokens": (TOKEN, OTHER_TOKEN), "port": 0, "grace": 2.0}
    options.update(settings)
    with run_in_thread(_registry(), DaemonSettings(**options), pool=UNWALLED) as running:
        yield Daemon(running.url, TOKEN, running.server)


def _key() -> str:
    return uuid.uuid4().hex


def _wait(key: str, **extra: Any) -> dict[str, Any]:
    return {"name": "wait", "arguments": {"key": key}, **extra}


def _tally(key: str) -> dict[str, Any]:
    return {"name": "tally", "arguments": {"key": key}}


def _mcp_call(request_id: int | str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    params = {"name": name, "arguments": arguments}
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


async def _until(predicate: Callable[[], bool], within: float = 30.0) -> None:
    """Wait, bounded, for a state of the daemon's thread: no event to await."""
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def _slots(http: httpx.AsyncClient) -> float:
    """The call slots held now, over every token (the daemon's gauge; /metrics holds none)."""
    metrics = (await http.get("/metrics")).text
    found = re.search(r"^agent_backend_requests_in_flight (\S+)$", metrics, re.M)
    assert found, metrics
    return float(found.group(1))


class _Posts:
    """Requests started in a task group, their answers kept in order of arrival."""

    def __init__(self, group: anyio.abc.TaskGroup) -> None:
        self.group = group
        self.answers: list[httpx.Response] = []

    def start(self, request: Callable[[], Awaitable[httpx.Response]]) -> None:
        async def run() -> None:
            self.answers.append(await request())

        self.group.start_soon(run)


# -- a batch holds a slot per call ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_v1_batch_holds_a_slot_per_call_all_or_none() -> None:
    held, batched, counted = _key(), _key(), _key()
    with limited(max_concurrent_per_token=6, retry_after=2) as daemon:
        async with (
            daemon.async_http(timeout=60) as http,
            daemon.async_http(OTHER_TOKEN) as other,
            anyio.create_task_group() as group,
        ):
            posts = _Posts(group)
            for _ in range(3):
                posts.start(lambda: http.post("/v1/call", json=_wait(held)))
            await _until(lambda: STARTED[held] == 3)
            assert await _slots(http) == 3

            # Four calls need four slots; three are free: refused whole, none of it ran.
            refused = await http.post("/v1/batch", json={"calls": [_tally(counted)] * 4})
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "2"
            error = refused.json()["error"]
            assert error["type"] == "RateLimited"
            assert error["fields"]["limit"] == 6
            assert "this batch needs 4 of this token's 6 call slots" in error["message"]
            assert TALLY[counted] == 0
            # Three fit exactly.
            fits = await http.post("/v1/batch", json={"calls": [_tally(counted)] * 3})
            assert fits.status_code == 200, fits.text
            assert TALLY[counted] == 3

            # A batch of three in flight holds three slots, not one: the token is full.
            posts.start(lambda: http.post("/v1/batch", json={"calls": [_wait(batched)] * 3}))
            await _until(lambda: STARTED[batched] == 3)
            assert await _slots(http) == 6
            single = await http.post("/v1/call", json=_tally(counted))
            assert single.status_code == 429
            assert (
                "6 calls are already in flight for this token" in single.json()["error"]["message"]
            )
            assert TALLY[counted] == 3
            # Another token has its own slots.
            theirs = await other.post("/v1/call", json=_tally(counted))
            assert theirs.status_code == 200
            GATES[held].set()
            GATES[batched].set()
        assert [answer.status_code for answer in posts.answers] == [200] * 4
        async with daemon.async_http() as http:
            assert await _slots(http) == 0, "the slots were not given back"
            # More calls than the token may ever have in flight: no wait makes room, so 422.
            never = await http.post("/v1/batch", json={"calls": [_tally(counted)] * 7})
            assert never.status_code == 422
            assert "may hold at most 6 calls, not 7" in never.json()["error"]["message"]
            assert "retry-after" not in never.headers
            assert TALLY[counted] == 4


@pytest.mark.anyio
async def test_an_mcp_batch_holds_a_slot_per_call_as_v1_does() -> None:
    held, batched, counted = _key(), _key(), _key()
    with limited(max_concurrent_per_token=6, retry_after=2) as daemon:
        async with daemon.async_http(timeout=60) as http, anyio.create_task_group() as group:
            posts = _Posts(group)
            for _ in range(3):
                posts.start(lambda: http.post("/v1/call", json=_wait(held)))
            await _until(lambda: STARTED[held] == 3)

            # A stateless JSON-RPC batch of four calls: four slots, three free.
            four = [_mcp_call(i, "tally", {"key": counted}) for i in range(4)]
            refused = await http.post("/mcp", json=four, headers=MCP_BATCH)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "2"
            body = refused.json()
            assert body["jsonrpc"] == "2.0"
            assert body["id"] is None
            assert body["error"]["type"] == "RateLimited"
            assert body["error"]["fields"]["retry_after"] == 2.0
            assert body["error"]["message"].startswith("429 Too Many Requests: this batch needs 4")
            assert TALLY[counted] == 0
            # Only calls count: three calls, a ping and a notification fit in three slots.
            mixed = [
                *(_mcp_call(i, "tally", {"key": counted}) for i in range(3)),
                {"jsonrpc": "2.0", "id": "p", "method": "ping"},
                {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}},
            ]
            fits = await http.post("/mcp", json=mixed, headers=MCP_BATCH)
            assert fits.status_code == 200, fits.text
            assert [reply["id"] for reply in fits.json()] == [0, 1, 2, "p"]
            assert TALLY[counted] == 3

            # An MCP batch in flight holds a slot per call: the token is full, on /v1 too.
            waits = [_mcp_call(i, "wait", {"key": batched}) for i in range(3)]
            posts.start(lambda: http.post("/mcp", json=waits, headers=MCP_BATCH))
            await _until(lambda: STARTED[batched] == 3)
            assert await _slots(http) == 6
            single = await http.post(
                "/mcp", json=_mcp_call(9, "tally", {"key": counted}), headers=MCP_BATCH
            )
            assert single.status_code == 429
            assert "already in flight" in single.json()["error"]["message"]
            assert (await http.post("/v1/call", json=_tally(counted))).status_code == 429
            assert TALLY[counted] == 3
            GATES[held].set()
            GATES[batched].set()
        assert [answer.status_code for answer in posts.answers] == [200] * 4
        async with daemon.async_http() as http:
            assert await _slots(http) == 0
            seven = [_mcp_call(i, "tally", {"key": counted}) for i in range(7)]
            never = await http.post("/mcp", json=seven, headers=MCP_BATCH)
            assert never.status_code == 422
            message = never.json()["error"]["message"]
            assert "a JSON-RPC batch may hold at most 6 calls, not 7" in message
            assert TALLY[counted] == 3


@pytest.mark.anyio
async def test_an_mcp_batch_obeys_max_batch_as_v1_does() -> None:
    counted = _key()
    with limited(max_batch=3) as daemon:
        async with daemon.async_http() as http:
            v1 = await http.post("/v1/batch", json={"calls": [_tally(counted)] * 4})
            assert v1.status_code == 422
            assert v1.json()["error"]["type"] == "InvalidRequest"
            assert "a batch has at most 3 calls, not 4" in v1.json()["error"]["message"]
            four = [_mcp_call(i, "tally", {"key": counted}) for i in range(4)]
            mcp = await http.post("/mcp", json=four, headers=MCP_BATCH)
            assert mcp.status_code == 422
            error = mcp.json()["error"]
            assert error["type"] == "InvalidRequest"
            assert error["message"] == (
                "422 Unprocessable Entity: a batch has at most 3 messages, not 4"
            )
            assert TALLY[counted] == 0
            three = await http.post("/mcp", json=four[:3], headers=MCP_BATCH)
            assert three.status_code == 200
            assert TALLY[counted] == 3


# -- a busy session --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_busy_session_says_retry_without_internals(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A session holding its most calls (1024; 2 here) refuses one more: 429 on /v1, an
    isError result on /mcp, neither with the session's repr or its workspace path."""
    monkeypatch.setattr(session_module, "_SESSION_CAPACITY", 2)
    caplog.set_level(logging.DEBUG, logger="agent_backend")
    v1_key, mcp_key = _key(), _key()
    with limited() as daemon:
        async with daemon.async_http(timeout=60) as http, anyio.create_task_group() as group:
            opened = (await http.post("/v1/sessions")).json()
            sid, workspace = opened["id"], opened["workspace"]
            posts = _Posts(group)
            for _ in range(2):
                posts.start(lambda: http.post("/v1/call", json=_wait(v1_key, session=sid)))
            await _until(lambda: STARTED[v1_key] == 2)
            busy = await http.post("/v1/call", json={**_tally(v1_key), "session": sid})
            assert busy.status_code == 429
            assert busy.headers["retry-after"] == "1"
            error = busy.json()["error"]
            assert error["type"] == "PoolBusy"
            assert error["fields"] == {"limit": 2, "retry_after": 1.0}
            assert error["message"].startswith("this session already has 2 calls in flight")
            assert "retry in 1 s" in error["message"]
            batch = await http.post(
                "/v1/batch", json={"calls": [_tally(v1_key)] * 2, "session": sid}
            )
            assert batch.status_code == 429
            assert batch.json()["error"]["type"] == "PoolBusy"
            assert TALLY[v1_key] == 0

            # The same over MCP: a result the model reads, and can act on.
            initialized = await http.post(
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
                headers=MCP_BATCH | {"MCP-Protocol-Version": "2025-06-18"},
            )
            headers = {
                **MCP_BATCH,
                "MCP-Protocol-Version": "2025-06-18",
                "Mcp-Session-Id": initialized.headers["mcp-session-id"],
            }
            pwd = await http.post(
                "/mcp", json=_mcp_call(1, "exec", {"command": "pwd"}), headers=headers
            )
            mcp_workspace = pwd.json()["result"]["content"][0]["text"].strip()
            assert mcp_workspace.startswith("/")
            for i in range(2):
                posts.start(
                    lambda i=i: http.post(
                        "/mcp", json=_mcp_call(10 + i, "wait", {"key": mcp_key}), headers=headers
                    )
                )
            await _until(lambda: STARTED[mcp_key] == 2)
            refused = await http.post(
                "/mcp", json=_mcp_call(2, "tally", {"key": mcp_key}), headers=headers
            )
            assert refused.status_code == 200
            result = refused.json()["result"]
            assert result["isError"] is True
            text = result["content"][0]["text"]
            assert text.startswith("Error: PoolBusy: this session already has 2 calls in flight")
            assert result["_meta"]["agent-backend/result"]["retry_after"] == 1.0
            assert TALLY[mcp_key] == 0
            for shown in (error["message"], text):
                assert workspace not in shown
                assert mcp_workspace not in shown
                assert "<" not in shown, shown  # no repr
            GATES[v1_key].set()
            GATES[mcp_key].set()
        assert [answer.status_code for answer in posts.answers] == [200] * 4
    refusals = [r for r in caplog.records if "PoolBusy" in r.getMessage()]
    assert refusals, "the MCP refusal is logged at DEBUG"
    assert all(r.levelno <= logging.DEBUG for r in refusals), [
        (r.levelname, r.getMessage()) for r in refusals
    ]


# -- sessions: the cap says when to retry, and spares the stateless session -------------------------


@pytest.mark.anyio
async def test_too_many_sessions_has_retry_after_and_pickles_with_it() -> None:
    with limited(max_sessions_per_token=2, retry_after=3) as daemon:
        async with daemon.async_http() as http:
            first = (await http.post("/v1/sessions")).json()["id"]
            await http.post("/v1/sessions")
            refused = await http.post("/v1/sessions")
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "3"
            error = error_from_wire(refused.json(), status=429)
            assert isinstance(error, TooManySessions)
            assert (error.limit, error.retry_after, error.status) == (2, 3.0, 429)
            clone = pickle.loads(pickle.dumps(error))
            assert type(clone) is TooManySessions
            assert clone.__dict__ == error.__dict__
            fork = await http.post(f"/v1/sessions/{first}/fork", json={"n": 1})
            assert fork.status_code == 429
            assert fork.headers["retry-after"] == "3"
            init = {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "test", "version": "1"},
                },
            }
            mcp = await http.post("/mcp", json=init, headers=MCP_BATCH)
            assert mcp.status_code == 429
            assert mcp.headers["retry-after"] == "3"
            assert mcp.json()["error"]["type"] == "TooManySessions"
            assert mcp.json()["error"]["fields"]["retry_after"] == 3.0


@pytest.mark.anyio
async def test_a_stateless_mcp_call_is_served_at_the_session_cap() -> None:
    with limited(max_sessions_per_token=2) as daemon:
        async with daemon.async_http() as http:
            ids = [(await http.post("/v1/sessions")).json()["id"] for _ in range(2)]
            assert (await http.post("/v1/sessions")).status_code == 429
            # No Mcp-Session-Id: served in the token's stateless session, which is not counted.
            wrote = await http.post(
                "/mcp",
                json=_mcp_call(1, "write_file", {"path": "kept.txt", "content": "stateless"}),
                headers=MCP_BATCH,
            )
            assert wrote.status_code == 200, wrote.text
            assert wrote.json()["result"]["isError"] is False
            read = await http.post(
                "/mcp", json=_mcp_call(2, "read_file", {"path": "kept.txt"}), headers=MCP_BATCH
            )
            assert read.json()["result"]["content"][0]["text"] == "stateless"
            # It took no place under the cap: still full, and a freed place is a session's.
            assert (await http.post("/v1/sessions")).status_code == 429
            assert (await http.delete(f"/v1/sessions/{ids[0]}")).status_code == 204
            assert (await http.post("/v1/sessions")).status_code == 201
            assert (await http.post("/v1/sessions")).status_code == 429


# -- each setting reaches what it sets -------------------------------------------------------------


@pytest.mark.anyio
async def test_session_ttl_from_the_environment_reaps_an_idle_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENT_BACKEND_SESSION_TTL", "0.3")
    monkeypatch.setenv("AGENT_BACKEND_OUTPUT_LIMIT", "100")
    settings = DaemonSettings(tokens=(TOKEN,), port=0)
    assert (settings.session_ttl, settings.output_limit) == (0.3, 100)
    with run_in_thread(_registry(), settings, pool=UNWALLED) as running:
        dispatcher = running.dispatcher
        assert (dispatcher.session_ttl, dispatcher.output_limit) == (0.3, 100)
        async with httpx.AsyncClient(
            base_url=running.url, headers={"Authorization": f"Bearer {TOKEN}"}
        ) as http:
            sid = (await http.post("/v1/sessions")).json()["id"]
            await _until(lambda: dispatcher.statistics().sessions_reaped >= 1)
            gone = await http.post("/v1/call", json={**_tally(_key()), "session": sid})
            assert gone.status_code == 410
            long = await http.post(
                "/v1/call", json={"name": "echo", "arguments": {"value": "x" * 500}}
            )
            assert long.json()["truncated"] is True


@pytest.mark.timeout(180)
def test_serve_options_reach_the_dispatcher_and_uvicorn(tmp_path: Path) -> None:
    """``agent-backend serve``'s options, each seen where it acts."""
    options = [
        "--session-ttl", "0.5",
        "--default-timeout", "2",
        "--max-timeout", "3",
        "--output-limit", "200",
        "--keep-alive-timeout", "0.2",
        "--max-sessions", "1",
        "--max-batch", "8",
        "--max-concurrent", "3",
    ]  # fmt: skip
    with serve_child(tmp_path, *options, exits_cleanly=True) as child:
        url = child.url
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            true = {"name": "exec", "arguments": {"command": "true"}}
            over_limit = http.post("/v1/batch", json={"calls": [true] * 4})
            assert "may hold at most 3 calls, not 4" in over_limit.text  # --max-concurrent
            over_batch = http.post("/v1/batch", json={"calls": [true] * 9})
            assert "a batch has at most 8 calls, not 9" in over_batch.text  # --max-batch
            sid = http.post("/v1/sessions").json()["id"]
            second = http.post("/v1/sessions")  # --max-sessions
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"

            slow = {"command": "sleep 30"}
            long = {"command": "head -c 5000 /dev/zero | tr '\\0' a"}
            calls = [
                {"name": "exec", "arguments": slow},  # --default-timeout
                {"name": "exec", "arguments": {**slow, "timeout": 100}},  # --max-timeout
                {"name": "exec", "arguments": long},  # --output-limit
            ]
            results = http.post("/v1/batch", json={"calls": calls}).json()["results"]
            assert [r["error_type"] for r in results[:2]] == ["Timeout", "Timeout"]
            assert "after 2 s" in results[0]["error"]
            assert "after 3 s" in results[1]["error"]
            assert results[2]["truncated"] is True
            assert results[2]["output_bytes"] == 5000
            assert len(results[2]["output"]) < 400

            # --session-ttl: idle past it, the session is reaped (then 410).
            def reaped() -> bool:
                metrics = http.get("/metrics").text
                found = re.search(r"^agent_backend_sessions_reaped\{[^}]*\} (\S+)$", metrics, re.M)
                return found is not None and float(found.group(1)) >= 1

            deadline = time.monotonic() + 30
            while not reaped():
                assert time.monotonic() < deadline, "the idle session was not reaped within 30 s"
                time.sleep(0.05)
            gone = http.post("/v1/call", json={**true, "session": sid})
            assert gone.status_code == 410

        # --keep-alive-timeout: an idle keep-alive connection is closed after 0.2 s (not 5 s).
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_one_response(sock).startswith(b"HTTP/1.1 200 ")
            assert closed_by_peer(sock, within=3.0)


@pytest.mark.parametrize(
    ("body", "limit", "longer"),
    [
        (b"[1,2,3]", 3, False),
        (b" [ 1 , 2 ,3 ] ", 2, True),
        (b'[{"a": "[1,2,3,4]"}, 2]', 1, True),
        (b'[{"a": "[1,2,3,4]"}]', 1, False),  # commas and brackets inside a string are not elements
        (b'{"jsonrpc": "2.0"}', 0, False),  # not an array
        (b"[1,2,", 2, False),  # invalid JSON: the whole parse decides
        (b"[1,2,", 1, True),
        (b"\xff[1,2]", 0, False),  # not UTF-8
        (b"[" + b",".join([b'{"id":1}'] * 300) + b"]", 256, True),
        (b"[" + b",".join([b'{"id":1}'] * 256) + b"]", 256, False),
    ],
)
def test_a_batch_is_counted_before_it_is_parsed_whole(
    body: bytes, limit: int, longer: bool
) -> None:
    assert _array_longer_than(body, limit) is longer
