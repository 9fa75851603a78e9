"""Safe by default: bearer tokens, size and concurrency limits, token files, loopback, no CORS."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import anyio
import httpx
import pytest
from support.daemon_fixtures import OTHER_TOKEN, TALLY, TOKEN, Daemon, daemon_fixture, start_daemon  # noqa: F401

from agent_backend.daemon import DaemonServer, DaemonSettings, is_loopback, load_token
from agent_backend.dispatch import Dispatcher
from agent_backend.errors import ConfigError
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tokens import find_token
from agent_backend.tools import ToolRegistry

PROTECTED = [
    ("GET", "/v1/health/ready"),
    ("GET", "/v1/tools"),
    ("POST", "/v1/call"),
    ("POST", "/v1/batch"),
    ("POST", "/v1/sessions"),
    ("DELETE", "/v1/sessions/s1"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("POST", "/mcp"),
    ("GET", "/does-not-exist"),
]


def _refused(daemon: Daemon, method: str, path: str, headers: dict[str, str]) -> None:
    before = dict(TALLY)
    response = httpx.request(
        method,
        daemon.url + path,
        headers=headers,
        json={"name": "tally", "arguments": {"key": "auth"}},
    )
    assert response.status_code == 401, (method, path, headers)
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "Unauthorized"
    assert dict(TALLY) == before, "a tool ran without authentication"


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_route_but_liveness_needs_a_token(daemon: Daemon, method: str, path: str) -> None:
    _refused(daemon, method, path, {})


@pytest.mark.parametrize(
    "authorization",
    ["Bearer", "Bearer  x", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN],
)
def test_a_wrong_token_is_refused(daemon: Daemon, authorization: str) -> None:
    for method, path in (("POST", "/v1/call"), ("POST", "/mcp"), ("GET", "/metrics")):
        _refused(daemon, method, path, {"Authorization": authorization})


def test_both_configured_tokens_work_and_the_scheme_is_case_insensitive(daemon: Daemon) -> None:
    for header in (f"Bearer {TOKEN}", f"bearer {OTHER_TOKEN}"):
        response = httpx.get(f"{daemon.url}/v1/tools", headers={"Authorization": header})
        assert response.status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
        "/.well-known/oauth-authorization-server",
        "/.well-known/openid-configuration",
    ],
)
def test_oauth_discovery_is_404_not_401(daemon: Daemon, path: str) -> None:
    # MCP clients (the Inspector among them) probe these after a 401; a 401 here too would
    # read as "OAuth wanted". There is no OAuth: nothing is there, token or not.
    for headers in ({}, daemon.headers()):
        response = httpx.get(daemon.url + path, headers=headers)
        assert response.status_code == 404, (path, headers)
        assert TOKEN not in response.text


def test_no_cors(daemon: Daemon) -> None:
    preflight = httpx.options(
        f"{daemon.url}/v1/call",
        headers={
            "Origin": "https://evil.example",
            "Access-Control-Request-Method": "POST",
            **daemon.headers(),
        },
    )
    assert "access-control-allow-origin" not in preflight.headers
    with daemon.http() as http:
        response = http.get("/v1/tools", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in response.headers


def test_body_over_the_limit_is_413_before_it_is_read() -> None:
    with (
        start_daemon(max_body_bytes=4096, max_argument_bytes=1024, mcp=False) as small,
        small.http() as http,
    ):
        big = {"name": "echo", "arguments": {"value": "x" * 5000}}
        declared = http.post("/v1/call", json=big)

        def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b" " * 1000

        streamed = http.post(
            "/v1/call", content=chunks(), headers={"content-type": "application/json"}
        )
        arguments = http.post("/v1/call", json={"name": "echo", "arguments": {"value": "y" * 2000}})
        in_batch = http.post(
            "/v1/batch",
            json={
                "calls": [
                    {"name": "echo", "arguments": {"value": "ok"}},
                    {"name": "echo", "arguments": "z" * 2000},
                ]
            },
        )
        fine = http.post("/v1/call", json={"name": "echo", "arguments": {"value": "y" * 500}})
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "RequestTooLarge"
        assert response.json()["error"]["fields"]["what"] == "body"
    for response in (arguments, in_batch):
        assert response.status_code == 413
        assert response.json()["error"]["fields"]["what"] == "arguments"
    assert fine.status_code == 200


@pytest.mark.anyio
async def test_concurrency_over_the_limit_is_429_with_retry_after() -> None:
    with start_daemon(max_concurrent_per_token=2, retry_after=3, mcp=False) as small:
        async with small.async_http() as http, small.async_http(OTHER_TOKEN) as other:
            slow = {"name": "pause", "arguments": {"seconds": 1.0}}
            answers: list[httpx.Response] = []

            async def one() -> None:
                answers.append(await http.post("/v1/call", json=slow))

            async with anyio.create_task_group() as group:
                group.start_soon(one)
                group.start_soon(one)
                await anyio.sleep(0.4)
                refused = await http.post(
                    "/v1/call", json={"name": "echo", "arguments": {"value": "x"}}
                )
                # Another token has its own budget; health is never limited.
                other_ok = await other.post(
                    "/v1/call", json={"name": "echo", "arguments": {"value": "x"}}
                )
                health = await http.get("/v1/health/ready")
            after = await http.post("/v1/call", json={"name": "echo", "arguments": {"value": "x"}})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["type"] == "RateLimited"
    assert refused.json()["error"]["fields"]["limit"] == 2
    assert other_ok.status_code == 200
    assert health.status_code == 200
    assert [a.status_code for a in answers] == [200, 200]
    assert after.status_code == 200, "the slots were not given back"


def test_too_many_sessions_is_429_with_retry_after() -> None:
    with (
        start_daemon(max_sessions_per_token=2, retry_after=2, mcp=False) as small,
        small.http() as http,
    ):
        first = http.post("/v1/sessions").json()["id"]
        http.post("/v1/sessions")
        refused = http.post("/v1/sessions")
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "TooManySessions"
        assert refused.json()["error"]["fields"] == {"status": 429, "limit": 2, "retry_after": 2.0}
        assert refused.headers["retry-after"] == "2"
        assert http.delete(f"/v1/sessions/{first}").status_code == 204
        assert http.post("/v1/sessions").status_code == 201


def test_token_is_generated_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "agent-backend" / "token"
    made = load_token(path, env={})
    assert made.origin == "generated"
    assert not made.explicit
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    again = load_token(path, env={})
    assert again.token == made.token
    assert again.origin == "file"
    assert find_token({"AGENT_BACKEND_TOKEN_FILE": str(path)}) == made.token
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_token(path, env={})
    from_env = load_token(path, env={"AGENT_BACKEND_TOKEN": "e" * 20})
    assert from_env.origin == "env"
    assert from_env.token == "e" * 20
    with pytest.raises(ConfigError, match="at least 16"):
        load_token(path, env={"AGENT_BACKEND_TOKEN": "short"})


def test_loopback_detection() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))


@pytest.mark.anyio
async def test_non_loopback_bind_without_an_explicit_token_is_refused() -> None:
    settings = DaemonSettings(tokens=("g" * 32,), host="0.0.0.0", port=0)
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(ToolRegistry(), pool) as dispatcher:
        with pytest.raises(ConfigError, match="not loopback"):
            DaemonServer(dispatcher, settings, token_explicit=False)


def test_the_daemon_binds_loopback_by_default(daemon: Daemon) -> None:
    assert DaemonSettings(tokens=("t" * 20,)).host == "127.0.0.1"
    assert daemon.url.startswith("http://127.0.0.1:")
    assert daemon.server.address is not None
    assert daemon.server.address[0] == "127.0.0.1"


def test_a_token_file_never_reaches_a_response(daemon: Daemon) -> None:
    with daemon.http() as http:
        texts = [http.get(p).text for p in ("/metrics", "/openapi.json", "/v1/health/ready")]
    assert not any(TOKEN in text or OTHER_TOKEN in text for text in texts)
    assert threading.active_count() >= 1
    assert os.getpid() > 0
