"""The daemon's ``/mcp``: streamable HTTP conformance, sessions, limits and refusals.

Raw HTTP (httpx) checks what the wire says; the ``mcp`` package's own
client (2.x) checks what a user of it sees. Real daemons on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import httpx2
import mcp
import pytest
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from support.daemon_fixtures import OTHER_TOKEN, Daemon, daemon_fixture, start_daemon  # noqa: F401

from agent_backend.mcp import RESULT_META_KEY, SERVED_VERSIONS

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ACCEPT = {"Accept": "application/json, text/event-stream"}


def _init(version: str = "2025-06-18", request_id: int | str = 1) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "initialize",
        "params": {
            "protocolVersion": version,
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"},
        },
    }


def _req(
    request_id: int | str, method: str, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def _call(request_id: int | str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return _req(request_id, "tools/call", {"name": name, "arguments": arguments})


def _text(reply: dict[str, Any]) -> str:
    return "".join(block["text"] for block in reply["result"]["content"])


async def _session(http: httpx.AsyncClient, version: str = "2025-06-18") -> dict[str, str]:
    response = await http.post("/mcp", json=_init(version), headers=ACCEPT)
    assert response.status_code == 200, response.text
    sid = response.headers["mcp-session-id"]
    assert len(sid) >= 32
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    headers = {**ACCEPT, "Mcp-Session-Id": sid, "MCP-Protocol-Version": version}
    assert (await http.post("/mcp", json=initialized, headers=headers)).status_code == 202
    return headers


async def _until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Wait, bounded, for a state of the daemon's thread or the disk: no event to await."""
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.02)


@contextlib.asynccontextmanager
async def _sdk_client(daemon: Daemon, token: str | None = None) -> AsyncIterator[mcp.Client]:
    async with (
        httpx2.AsyncClient(headers=daemon.headers(token), timeout=30) as http,
        mcp.Client(streamable_http_client(f"{daemon.url}/mcp", http_client=http)) as client,
    ):
        yield client


# -- handshake, versions, framing -----------------------------------------------------------------


async def test_initialize_negotiates_the_version(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        for version in SERVED_VERSIONS:
            reply = (await http.post("/mcp", json=_init(version), headers=ACCEPT)).json()
            assert reply["result"]["protocolVersion"] == version
        # A version we do not serve: the answer names the latest we do; the client decides.
        reply = (await http.post("/mcp", json=_init("2099-01-01"), headers=ACCEPT)).json()
        assert reply["result"]["protocolVersion"] == SERVED_VERSIONS[-1]
        result = reply["result"]
        assert result["capabilities"] == {"tools": {"listChanged": False}}
        assert result["serverInfo"]["name"] == "agent-backend"
        assert "workspace" in result["instructions"]


async def test_a_modern_request_is_told_the_served_versions(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        response = await http.post(
            "/mcp",
            json=_req(1, "server/discover"),
            headers={**ACCEPT, "MCP-Protocol-Version": "2026-07-28"},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == -32022
    assert error["data"] == {"supported": list(SERVED_VERSIONS), "requested": "2026-07-28"}


async def test_the_sdk_client_falls_back_to_the_handshake(daemon: Daemon) -> None:
    async with _sdk_client(daemon) as client:
        assert client.protocol_version == SERVED_VERSIONS[-1]
        assert client.session.initialize_result is not None


async def test_notifications_and_responses_are_accepted(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        headers = await _session(http)
        progress = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}
        response = await http.post("/mcp", json=progress, headers=headers)
        assert response.status_code == 202
        assert response.content == b""
        answer = {"jsonrpc": "2.0", "id": 5, "result": {}}
        assert (await http.post("/mcp", json=answer, headers=headers)).status_code == 202


async def test_batches_only_at_2025_03_26(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        headers = await _session(http, "2025-03-26")
        batch = [
            _call("a", "echo", {"value": "one"}),
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": {}},
            _req("b", "tools/list"),
            _call(3, "echo", {"value": "three"}),
        ]
        replies = (await http.post("/mcp", json=batch, headers=headers)).json()
        assert [reply["id"] for reply in replies] == ["a", "b", 3]
        assert _text(replies[0]) == "one"
        assert {tool["name"] for tool in replies[1]["result"]["tools"]} >= {"exec", "echo"}
        assert _text(replies[2]) == "three"
        only_notes = [{"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}]
        assert (await http.post("/mcp", json=only_notes, headers=headers)).status_code == 202

        later = await _session(http, "2025-06-18")
        response = await http.post("/mcp", json=batch, headers=later)
        assert response.status_code == 400
        assert "batches are not part of protocol 2025-06-18" in response.json()["error"]["message"]


async def test_json_rpc_errors(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        headers = await _session(http)
        broken = await http.post(
            "/mcp", content=b"{not json", headers={**headers, "Content-Type": "application/json"}
        )
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == -32700
        assert broken.json()["id"] is None

        unknown = (await http.post("/mcp", json=_req(2, "resources/list"), headers=headers)).json()
        assert unknown["id"] == 2
        assert unknown["error"]["code"] == -32601
        assert "tools only" in unknown["error"]["message"]

        bad = (
            await http.post("/mcp", json=_req(3, "tools/call", {"name": 5}), headers=headers)
        ).json()
        assert bad["error"]["code"] == -32602
        assert "params.name" in bad["error"]["message"]

        envelope = (await http.post("/mcp", json={"id": 4, "method": 7}, headers=headers)).json()
        assert envelope["error"]["code"] == -32600

        again = (await http.post("/mcp", json=_req(5, "ping"), headers=headers)).json()
        assert again == {"jsonrpc": "2.0", "id": 5, "result": {}}


async def test_http_semantics(daemon: Daemon) -> None:
    async with daemon.async_http() as http:
        headers = await _session(http)
        get = await http.get("/mcp", headers=headers)
        assert get.status_code == 405
        assert get.headers["allow"] == "POST, DELETE"
        assert "no SSE stream" in get.json()["error"]["message"]

        form = await http.post(
            "/mcp", content=b"{}", headers={**headers, "Content-Type": "text/plain"}
        )
        assert form.status_code == 415
        xml = await http.post(
            "/mcp", json=_req(1, "ping"), headers={**headers, "Accept": "application/xml"}
        )
        assert xml.status_code == 406

        wrong = {**headers, "MCP-Protocol-Version": "2025-03-26"}
        mismatch = await http.post("/mcp", json=_req(2, "ping"), headers=wrong)
        assert mismatch.status_code == 400
        assert "not the version this session negotiated" in mismatch.json()["error"]["message"]

        assert (await http.delete("/mcp", headers=headers)).status_code == 204
        gone = await http.post("/mcp", json=_req(3, "ping"), headers=headers)
        assert gone.status_code == 404
        assert "initialize" in gone.json()["error"]["message"]
        assert (await http.delete("/mcp", headers=headers)).status_code == 404
        assert (await http.delete("/mcp", headers=ACCEPT)).status_code == 400


# -- sessions --------------------------------------------------------------------------------------


async def test_each_sdk_client_has_its_own_workspace(daemon: Daemon) -> None:
    async with _sdk_client(daemon) as one, _sdk_client(daemon) as two:
        written = await one.call_tool("write_file", {"path": "notes.txt", "content": "from one"})
        assert not written.is_error, written
        read = await one.call_tool("read_file", {"path": "notes.txt"})
        assert read.content[0].text == "from one"
        listed = await one.call_tool("list_dir", {"path": "."})
        assert "notes.txt" in listed.content[0].text
        missing = await two.call_tool("read_file", {"path": "notes.txt"})
        assert missing.is_error
        assert missing.meta is not None
        assert missing.meta[RESULT_META_KEY]["error_type"] == "FileError"
        workspace = (await one.call_tool("exec", {"command": "pwd"})).content[0].text.strip()
        assert await anyio.Path(workspace).is_dir()
    # Each client sent DELETE on exit: the workspace is gone.
    await _until(lambda: not os.path.exists(workspace))


async def test_a_session_belongs_to_its_token(daemon: Daemon) -> None:
    async with daemon.async_http() as http, daemon.async_http(OTHER_TOKEN) as other:
        headers = await _session(http)
        stolen = await other.post("/mcp", json=_req(1, "ping"), headers=headers)
        assert stolen.status_code == 404
        assert (await other.delete("/mcp", headers=headers)).status_code == 404
        assert (await http.post("/mcp", json=_req(2, "ping"), headers=headers)).status_code == 200


async def test_an_idle_session_is_reaped_then_404() -> None:
    with start_daemon(session_ttl=0.3) as daemon:
        dispatcher = daemon.server.dispatcher
        async with _sdk_client(daemon) as client:
            ok = await client.call_tool("write_file", {"path": "a.txt", "content": "x"})
            assert not ok.is_error
            workspace = (await client.call_tool("exec", {"command": "pwd"})).content[0].text
            await _until(lambda: dispatcher.statistics().sessions_reaped >= 1)
            await _until(lambda: not os.path.exists(workspace.strip()))
            with pytest.raises(MCPError, match="idle past the daemon's session TTL"):
                await client.call_tool("read_file", {"path": "a.txt"})
        async with daemon.async_http() as http:
            headers = await _session(http)
            await _until(lambda: dispatcher.statistics().sessions_reaped >= 2)
            gone = await http.post("/mcp", json=_req(1, "ping"), headers=headers)
            assert gone.status_code == 404
            assert "idle past the daemon's session TTL" in gone.json()["error"]["message"]


async def test_stateless_requests_share_the_tokens_session() -> None:
    with start_daemon(session_ttl=0.5) as daemon:
        dispatcher = daemon.server.dispatcher
        async with daemon.async_http() as http, daemon.async_http(OTHER_TOKEN) as other:
            write = _call(1, "write_file", {"path": "kept.txt", "content": "stateless"})
            assert not (await http.post("/mcp", json=write, headers=ACCEPT)).json()["result"][
                "isError"
            ]
            read = (
                await http.post(
                    "/mcp", json=_call(2, "read_file", {"path": "kept.txt"}), headers=ACCEPT
                )
            ).json()
            assert _text(read) == "stateless"
            # Another token has its own.
            theirs = (
                await other.post(
                    "/mcp", json=_call(3, "read_file", {"path": "kept.txt"}), headers=ACCEPT
                )
            ).json()
            assert theirs["result"]["isError"]
            # Reaped when idle; the next call gets a fresh workspace, and says the file is not there.
            await _until(lambda: dispatcher.statistics().sessions_reaped >= 2)
            again = (
                await http.post(
                    "/mcp", json=_call(4, "read_file", {"path": "kept.txt"}), headers=ACCEPT
                )
            ).json()
            assert again["result"]["isError"]
            assert "kept.txt" in _text(again)


async def test_sessions_count_against_the_tokens_limit() -> None:
    with start_daemon(max_sessions_per_token=2) as daemon:
        async with daemon.async_http() as http:
            first = await _session(http)
            await _session(http)
            refused = await http.post("/mcp", json=_init(), headers=ACCEPT)
            assert refused.status_code == 429
            assert "sessions open" in refused.json()["error"]["message"]
            assert (await http.delete("/mcp", headers=first)).status_code == 204
            assert (await http.post("/mcp", json=_init(), headers=ACCEPT)).status_code == 200


# -- limits and refusals ---------------------------------------------------------------------------


async def test_refusals_are_json_rpc_errors_with_their_status(daemon: Daemon) -> None:
    async with httpx.AsyncClient(base_url=daemon.url) as anonymous:
        missing = await anonymous.post("/mcp", json=_init(), headers=ACCEPT)
        assert missing.status_code == 401
        # The daemon's one challenge: no resource_metadata, nothing to start OAuth discovery.
        assert missing.headers["www-authenticate"] == "Bearer"
        body = missing.json()
        assert body["jsonrpc"] == "2.0"
        assert body["id"] is None
        assert body["error"]["code"] == -32600
        assert body["error"]["message"].startswith(
            "401 Unauthorized: missing or wrong bearer token"
        )
        assert "does not use OAuth" in body["error"]["message"]
        assert body["error"]["type"] == "Unauthorized"  # as /v1 says it, for the daemon's clients
        wrong = await anonymous.post(
            "/mcp", json=_init(), headers={**ACCEPT, "Authorization": "Bearer " + "x" * 32}
        )
        assert wrong.status_code == 401
        assert "resource_metadata" not in wrong.headers["www-authenticate"]
    async with daemon.async_http() as http:
        rebinding = await http.post(
            "/mcp", json=_init(), headers={**ACCEPT, "Host": "evil.example"}
        )
        assert rebinding.status_code == 421
        assert "DNS rebinding" in rebinding.json()["error"]["message"]
        origin = await http.post(
            "/mcp", json=_init(), headers={**ACCEPT, "Origin": "http://evil.example"}
        )
        assert origin.status_code == 403
        local = await http.post(
            "/mcp", json=_init(), headers={**ACCEPT, "Origin": "http://localhost:3000"}
        )
        assert local.status_code == 200


async def test_the_sdk_client_shows_why_it_was_refused(daemon: Daemon) -> None:
    with pytest.raises(BaseException) as caught:  # noqa: PT011 - the SDK wraps it in groups
        async with _sdk_client(daemon, token="y" * 32):
            pass
    assert "missing or wrong bearer token" in _leaf_messages(caught.value)


def _leaf_messages(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return " | ".join(_leaf_messages(inner) for inner in exc.exceptions)
    return str(exc)


async def test_argument_and_body_limits_match_v1() -> None:
    with start_daemon(max_argument_bytes=1024, max_body_bytes=4096) as daemon:
        async with _sdk_client(daemon) as client:
            with pytest.raises(MCPError, match=r"413 .*arguments of tools/call 'echo' are larger"):
                await client.call_tool("echo", {"value": "x" * 2000})
            with pytest.raises(MCPError, match=r"413 .*request body is larger than 4096"):
                await client.call_tool("echo", {"value": "x" * 5000})
            small = await client.call_tool("echo", {"value": "x" * 500})
            assert small.content[0].text == "x" * 500
        async with daemon.async_http() as http:
            v1 = await http.post(
                "/v1/call", json={"name": "echo", "arguments": {"value": "x" * 2000}}
            )
            assert v1.status_code == 413
            raw = await http.post(
                "/mcp", json=_call(1, "echo", {"value": "x" * 2000}), headers=ACCEPT
            )
            assert raw.status_code == 413
            assert raw.json()["error"]["type"] == "RequestTooLarge"
            assert raw.json()["error"]["fields"]["what"] == "arguments"


async def test_concurrency_limit_is_shared_with_v1() -> None:
    with start_daemon(max_concurrent_per_token=2) as daemon:
        async with daemon.async_http(timeout=30) as http:
            headers = await _session(http)
            gate = {"name": "pause", "arguments": {"seconds": 3}}
            async with anyio.create_task_group() as group:
                group.start_soon(functools.partial(http.post, "/v1/call", json=gate))
                mcp_call = _call(1, "pause", {"seconds": 3})
                group.start_soon(
                    functools.partial(http.post, "/mcp", json=mcp_call, headers=headers)
                )
                await _until(lambda: daemon.server.dispatcher.statistics().calls_in_flight >= 2)
                refused = await http.post("/mcp", json=_req(2, "ping"), headers=headers)
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "1"
                assert "already in flight" in refused.json()["error"]["message"]
                group.cancel_scope.cancel()


async def test_mcp_calls_show_in_the_metrics(daemon: Daemon) -> None:
    async with _sdk_client(daemon) as client:
        await client.call_tool("echo", {"value": "counted"})
    with daemon.http() as http:
        metrics = http.get("/metrics").text
    assert 'tool="echo"' in metrics
