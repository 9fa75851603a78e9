"""The daemon's routes on a real uvicorn: health, tools, calls, batches, sessions, metrics, errors."""

from __future__ import annotations

import time

import httpx
import pytest
from support.daemon_fixtures import OTHER_TOKEN, Daemon, daemon_fixture, make_registry, start_daemon  # noqa: F401

from agent_backend.daemon import DaemonSettings, create_app
from agent_backend.dispatch import Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pool


def test_liveness_needs_no_token(daemon: Daemon) -> None:
    response = httpx.get(f"{daemon.url}/v1/health/live")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readiness_reflects_the_pool(daemon: Daemon) -> None:
    with daemon.http() as http:
        response = http.get("/v1/health/ready")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready"
    assert body["backend"] == "local"
    assert body["hosts_up"] == body["hosts"] == 1
    assert body["draining"] is False
    pools = body["pools"]
    assert set(pools) == {"default"}
    assert {k: v for k, v in pools["default"].items() if k != "guarantees"} == {
        "backend": "local",
        "up": 1,
        "total": 1,
    }
    # The walls in force are declared, whatever they are.
    assert pools["default"]["guarantees"][0].startswith("isolation: ")


@pytest.mark.parametrize(
    ("fmt", "key"), [("openai", "function"), ("anthropic", "input_schema"), ("mcp", "inputSchema")]
)
def test_tools_in_each_provider_shape(daemon: Daemon, fmt: str, key: str) -> None:
    with daemon.http() as http:
        response = http.get("/v1/tools", params={"format": fmt})
    assert response.status_code == 200
    body = response.json()
    assert body["format"] == fmt
    assert all(key in tool for tool in body["tools"])
    assert len(body["tools"]) == len(make_registry())


def test_tools_strict_is_the_strict_variant_and_only_for_openai(daemon: Daemon) -> None:
    with daemon.http() as http:
        strict = http.get("/v1/tools", params={"format": "openai", "strict": "true"})
        refused = http.get("/v1/tools", params={"format": "mcp", "strict": "true"})
    assert strict.status_code == 200
    exec_tool = next(t for t in strict.json()["tools"] if t["function"]["name"] == "exec")
    assert exec_tool["function"]["strict"] is True
    parameters = exec_tool["function"]["parameters"]
    assert sorted(parameters["required"]) == sorted(parameters["properties"])
    assert refused.status_code == 422  # InvalidRequest, as for any request the daemon refuses
    assert "format=openai" in refused.json()["error"]["message"]


def test_a_call_and_its_failures_are_results(daemon: Daemon) -> None:
    with daemon.http() as http:
        ok = http.post("/v1/call", json={"name": "echo", "arguments": {"value": "hi"}, "id": "c1"})
        failed = http.post("/v1/call", json={"name": "exec", "arguments": {"command": "exit 3"}})
        unknown = http.post("/v1/call", json={"name": "nope"})
        repaired = http.post(
            "/v1/call", json={"name": "tally", "arguments": '{"key": "r", "delay": "0"}'}
        )
        bad = http.post("/v1/call", json={"name": "tally", "arguments": '{"key": '})
    assert ok.status_code == 200
    assert ok.json() | {"duration": 0} == {
        "call_id": "c1",
        "tool": "echo",
        "ok": True,
        "output": "hi",
        "exit_status": None,
        "duration": 0,
        "truncated": False,
        "output_bytes": 2,
        "error": None,
        "error_type": None,
        "host": None,
    }
    assert failed.status_code == 200
    assert failed.json()["error_type"] == "NonZeroExit"
    assert failed.json()["exit_status"] == 3
    assert unknown.json()["error_type"] == "UnknownToolError"
    assert repaired.json()["ok"] is True  # "0" was repaired to a number
    assert bad.json()["error_type"] == "ToolArgumentError"  # never run with {}


def test_a_batch_runs_concurrently_and_answers_in_order(daemon: Daemon) -> None:
    calls = [{"name": "pause", "arguments": {"seconds": 0.4}, "id": f"p{i}"} for i in range(4)]
    calls.insert(2, {"name": "echo", "arguments": {"value": "middle"}})
    with daemon.http() as http:
        started = time.perf_counter()
        response = http.post("/v1/batch", json={"calls": calls})
        took = time.perf_counter() - started
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["call_id"] for r in results] == ["p0", "p1", "call_2", "p2", "p3"]
    assert results[2]["output"] == "middle"
    assert took < 1.2, "four 0.4 s calls ran one after another"


def test_a_session_keeps_its_workspace_and_is_private_to_its_token(daemon: Daemon) -> None:
    with daemon.http() as http, daemon.http(OTHER_TOKEN) as other:
        opened = http.post("/v1/sessions")
        assert opened.status_code == 201
        session = opened.json()
        sid = session["id"]
        write = http.post(
            "/v1/call",
            json={
                "name": "write_file",
                "arguments": {"path": "a.txt", "content": "kept"},
                "session": sid,
            },
        )
        assert write.json()["ok"], write.json()
        read = http.post(
            "/v1/batch",
            json={"calls": [{"name": "read_file", "arguments": {"path": "a.txt"}}], "session": sid},
        )
        assert read.json()["results"][0]["output"] == "kept"
        stranger = other.post(
            "/v1/call", json={"name": "echo", "arguments": {"value": "x"}, "session": sid}
        )
        assert stranger.status_code == 404
        assert stranger.json()["error"]["type"] == "NotFound"
        assert other.delete(f"/v1/sessions/{sid}").status_code == 404
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204
        gone = http.post(
            "/v1/call", json={"name": "echo", "arguments": {"value": "x"}, "session": sid}
        )
        assert gone.status_code == 404
        assert http.delete(f"/v1/sessions/{sid}").status_code == 404


def test_a_reaped_session_is_410_once_then_404() -> None:
    with start_daemon(session_ttl=0.3, mcp=False) as short, short.http() as http:
        sid = http.post("/v1/sessions").json()["id"]
        call = {"name": "echo", "arguments": {"value": "x"}, "session": sid}
        assert http.post("/v1/call", json=call).status_code == 200
        time.sleep(1.0)
        reaped = http.post("/v1/call", json=call)
        assert reaped.status_code == 410
        assert reaped.json()["error"]["type"] == "PoolClosed"
        assert http.post("/v1/call", json=call).status_code == 404


def test_client_mistakes_get_4xx_json(daemon: Daemon) -> None:
    with daemon.http() as http:
        cases = {
            "no route": http.get("/v2/nothing"),
            "method": http.get("/v1/call"),
            "not json": http.post(
                "/v1/call", content=b"{not json", headers={"content-type": "application/json"}
            ),
            "fork body not UTF-8": http.post(
                "/v1/sessions/s-x/fork",
                content=b"45:\x15\r\xff",
                headers={"content-type": "application/json"},
            ),
            "missing name": http.post("/v1/call", json={"arguments": {}}),
            "extra key": http.post("/v1/call", json={"name": "echo", "nme": 1}),
            "bad timeout": http.post("/v1/call", json={"name": "echo", "timeout": -1}),
            "batch not a list": http.post("/v1/batch", json={"calls": {}}),
            "bad format": http.get("/v1/tools", params={"format": "xml"}),
        }
    for what, response in cases.items():
        assert 400 <= response.status_code < 500, what
        error = response.json()["error"]
        assert error["type"] in {"NotFound", "MethodNotAllowed", "InvalidRequest"}, what
        assert error["message"], what
    assert cases["missing name"].json()["error"]["fields"]["issues"][0]["loc"] == ["body", "name"]
    assert cases["fork body not UTF-8"].status_code == 422  # as the OpenAPI document says


def test_openapi_lists_the_routes_and_needs_a_token(daemon: Daemon) -> None:
    assert httpx.get(f"{daemon.url}/openapi.json").status_code == 401
    with daemon.http() as http:
        document = http.get("/openapi.json").json()
    assert set(document["paths"]) == {
        "/v1/health/live",
        "/v1/health/ready",
        "/v1/tools",
        "/v1/call",
        "/v1/batch",
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/fork",
        "/metrics",
    }
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert document["paths"]["/v1/health/live"]["get"]["security"] == []


def test_metrics_count_calls_errors_and_pool_state(daemon: Daemon) -> None:
    with daemon.http() as http:
        http.post("/v1/call", json={"name": "echo", "arguments": {"value": "m"}})
        http.post("/v1/call", json={"name": "exec", "arguments": {"command": "exit 2"}})
        http.post("/v1/call", json={"name": "no-such-tool-xyz"})
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'agent_backend_calls_total{backend="local",outcome="ok",tool="echo"}' in text
    assert 'agent_backend_call_errors_total{backend="local",type="NonZeroExit"}' in text
    assert 'tool="(unknown)"' in text
    assert "no-such-tool-xyz" not in text
    assert (
        'agent_backend_call_duration_seconds_bucket{backend="local",le="0.001",tool="echo"}' in text
    )
    assert 'agent_backend_pool_hosts_up{backend="local",pool="default"} 1.0' in text
    assert 'agent_backend_pool_calls_active{backend="local",pool="default"}' in text
    assert "agent_backend_idempotency_kept" in text
    assert "_created" not in text


@pytest.mark.anyio
async def test_the_call_routes_answer_in_fastapis_shapes() -> None:
    """``POST /v1/call`` and ``/v1/batch`` are answered in front of FastAPI (daemon/calls.py):
    a body error is located as FastAPI locates one, and FastAPI answers their other methods."""
    token = "parity-token-" + "c" * 20
    settings = DaemonSettings(tokens=(token,), mcp=False)
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(make_registry(), pool) as dispatcher:
        transport = httpx.ASGITransport(app=create_app(dispatcher, settings))
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers=headers
        ) as http:
            ok = await http.post("/v1/call", json={"name": "echo", "arguments": {"value": "v"}})
            assert ok.status_code == 200
            assert ok.json()["output"] == "v"
            bad = await http.post("/v1/call", json={"nam": "echo"})
            in_batch = await http.post(
                "/v1/batch", json={"calls": [{"name": "echo", "timeout": 0}]}
            )
            not_json = await http.post("/v1/call", content=b"{", headers={"content-type": "x"})
            wrong_method = await http.get("/v1/call")
            slash = await http.post("/v1/batch/", json={"calls": []})
    assert bad.status_code == 422
    assert bad.json()["error"] == {
        "type": "InvalidRequest",
        "message": "body.name: Field required (and 1 more)",
        "fields": {
            "status": 422,
            "issues": [
                {"loc": ["body", "name"], "msg": "Field required"},
                {"loc": ["body", "nam"], "msg": "Extra inputs are not permitted"},
            ],
        },
    }
    assert in_batch.status_code == 422
    assert in_batch.json()["error"]["fields"]["issues"] == [
        {"loc": ["body", "calls", 0, "timeout"], "msg": "Extra inputs are not permitted"}
    ]
    assert not_json.status_code == 422
    assert not_json.json()["error"]["fields"]["issues"][0]["loc"] == ["body"]
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"] == {
        "type": "MethodNotAllowed",
        "message": "GET is not allowed on /v1/call",
        "fields": {"status": 405},
    }
    assert slash.status_code == 307
    assert slash.headers["location"] == "http://t/v1/batch"
