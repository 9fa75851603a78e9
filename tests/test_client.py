"""agent_backend.Client: the Dispatcher's calls over HTTP, retries that reuse the key, errors mapped back."""

from __future__ import annotations

import pickle
import subprocess
import sys
import uuid
from typing import Any

import anyio
import pytest
from support.daemon_fixtures import Daemon, daemon_fixture, make_registry, start_daemon  # noqa: F401

from agent_backend import errors
from agent_backend.client import Client, SyncClient
from agent_backend.dispatch import Dispatcher, ToolResult
from agent_backend.errors import (
    ArgumentIssue,
    BackendUnavailable,
    PoolClosed,
    ToolArgumentError,
    ToolTimeout,
)
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolCall
from agent_backend.wire import (
    DaemonError,
    IdempotencyConflict,
    NotFound,
    RateLimited,
    Unauthorized,
    error_from_wire,
    error_registry,
    error_to_wire,
)

pytestmark = pytest.mark.anyio


async def workload(runner: Any) -> list[ToolResult]:
    """The same code against a Dispatcher or a Client: only the runner differs."""
    results = [await runner.call(("echo", {"value": "one"}))]
    results += await runner.call_many(
        [("echo", {"value": "a"}), {"name": "exec", "arguments": {"command": "exit 5"}, "id": "e"}]
    )
    results.append(await runner.call(ToolCall("m", "echo", '{"value": 5}', "openai")))
    async with runner.session() as session:
        await session.call(("write_file", {"path": "f.txt", "content": "in the session"}))
        results.append(await runner.call(("read_file", {"path": "f.txt"}), session=session))
        results += await session.call_many([("list_dir", {"path": "."})])
    return results


def _comparable(result: ToolResult) -> dict[str, Any]:
    return result.model_dump(exclude={"duration"})


async def test_one_line_switches_between_in_process_and_remote(daemon: Daemon) -> None:
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(make_registry(), pool) as runner:
        local = await workload(runner)
    async with Client(daemon.url, token=daemon.token) as runner:
        remote = await workload(runner)
    assert [_comparable(r) for r in remote] == [_comparable(r) for r in local]
    assert remote[2].error_type == "NonZeroExit"
    assert remote[4].output == "in the session"


async def test_tools_and_readiness(daemon: Daemon) -> None:
    async with Client(daemon.url, token=daemon.token) as client:
        tools = await client.tools("anthropic")
        ready = await client.ready()
    assert {t["name"] for t in tools} >= {"exec", "echo", "tally"}
    assert ready.status == "ready"


async def test_errors_come_back_as_the_same_classes(daemon: Daemon) -> None:
    async with Client(daemon.url, token="wrong-token-" + "z" * 20) as stranger:
        with pytest.raises(Unauthorized) as unauthorized:
            await stranger.call(("echo", {"value": "x"}))
    assert unauthorized.value.status == 401
    async with Client(daemon.url, token=daemon.token) as client:
        async with client.session() as session:
            sid = session.id
        assert session.is_closed()
        with pytest.raises(PoolClosed):  # refused locally: the session is closed
            await client.call(("echo", {"value": "x"}), session=session)
        with pytest.raises(NotFound, match=sid):
            await client._request("DELETE", f"/v1/sessions/{sid}")
        key = uuid.uuid4().hex
        await client.call(("echo", {"value": "x"}), idempotency_key=key)
        with pytest.raises(IdempotencyConflict) as conflict:
            await client.call(("echo", {"value": "y"}), idempotency_key=key)
        assert conflict.value.key == key
        with pytest.raises(DaemonError) as invalid:
            await client.call(("echo", {"value": "x"}), timeout=-1)
        assert invalid.value.status == 422
        await session.aclose()  # idempotent


async def test_an_unreachable_daemon_is_backend_unavailable() -> None:
    with anyio.fail_after(10):
        async with Client("http://127.0.0.1:9", token="t" * 20, retries=2, backoff=0.01) as client:
            with pytest.raises(BackendUnavailable, match="cannot reach the daemon"):
                await client.call(("echo", {"value": "x"}))


async def test_429_is_retried_after_retry_after_until_the_wait_would_pass_the_deadline() -> None:
    with start_daemon(max_concurrent_per_token=1, retry_after=1, mcp=False) as small:
        async with Client(small.url, token=small.token) as client:
            async with anyio.create_task_group() as group:
                group.start_soon(client.call, ("pause", {"seconds": 0.5}))
                await anyio.sleep(0.2)
                # Refused with Retry-After: 1, retried once the slot is free: succeeds.
                result = await client.call(("echo", {"value": "patient"}))
            assert result.output == "patient"
        async with (
            # Retry-After: 1 would end past this half-second bound: raised at once.
            Client(small.url, token=small.token, busy_timeout=0.5) as impatient,
            anyio.create_task_group() as group,
        ):
            group.start_soon(impatient.call, ("pause", {"seconds": 0.5}))
            await anyio.sleep(0.2)
            with pytest.raises(RateLimited) as limited:
                await impatient.call(("echo", {"value": "x"}))
    assert limited.value.retry_after == 1
    assert limited.value.status == 429


def test_sync_client(daemon: Daemon) -> None:
    with SyncClient(daemon.url, token=daemon.token) as client:
        assert client.call(("echo", {"value": "sync"})).output == "sync"
        assert [
            r.output for r in client.call_many([("echo", {"value": "1"}), ("echo", {"value": "2"})])
        ] == ["1", "2"]
        with client.session() as session:
            session.call(("write_file", {"path": "s.txt", "content": "x"}))
            assert session.call(("read_file", {"path": "s.txt"})).output == "x"
            assert client.call(("list_dir", {"path": "."}), session=session).ok
        assert any(t["function"]["name"] == "echo" for t in client.tools())
        assert client.ready().status == "ready"
    client.close()  # idempotent


def test_the_registry_holds_only_the_projects_classes() -> None:
    registry = error_registry()
    assert all(
        cls.__module__ in {"agent_backend.errors", "agent_backend.wire"}
        for cls in registry.values()
    )
    assert registry["ToolTimeout"] is ToolTimeout
    assert "ArgumentIssue" not in registry


def test_error_bodies_round_trip_with_their_fields() -> None:
    samples: list[errors.AgentBackendError] = [
        ToolArgumentError(
            "bad", issues=[ArgumentIssue("/a", "expected integer", "integer", '"x"')], tool="t"
        ),
        errors.UnknownToolError("nope", available=["a", "b"]),
        ToolTimeout("slow", timeout=1.5, backend="local", host="local"),
        errors.WorkerLost("lost", worker="w", cause="EOF", backend="ssh", host="h:22"),
        errors.ResourceUnavailable("no GPU", needed={"GPU": 1.0}, available={"CPU": 2.0}),
        errors.ConfigError("bad key", file="p.toml", key="hosts.0", expected="int"),
        RateLimited("slow down", retry_after=2.0, limit=4),
    ]
    for sample in samples:
        body = {"error": error_to_wire(sample).model_dump()}
        back = error_from_wire(body, status=400)
        assert type(back) is type(sample)
        assert str(back) == str(sample)
        assert vars(back) == vars(sample)
        assert pickle.loads(pickle.dumps(back)).__dict__ == back.__dict__


def test_an_unknown_or_hostile_type_is_never_imported() -> None:
    hostile = {"error": {"type": "os.system", "message": "boom", "fields": {"status": 1}}}
    assert type(error_from_wire(hostile, status=418)) is DaemonError
    assert type(error_from_wire(hostile, status=500)) is errors.AgentBackendError
    fields = {
        "type": "ToolTimeout",
        "message": "m",
        "fields": {"timeout": 2, "__class__": "x", "evil": 1},
    }
    back = error_from_wire({"error": fields}, status=504)
    assert isinstance(back, ToolTimeout)
    assert back.timeout == 2
    assert not hasattr(back, "evil")
    assert type(error_from_wire("not json", status=502)) is DaemonError


def test_importing_the_client_does_not_load_aiohttp() -> None:
    """aiohttp takes longer to import than the rest of the client: it loads on the first request."""
    code = "import sys, agent_backend.client; print(sorted({'aiohttp', 'yarl'} & set(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"


#: What runs tools, not what talks to the daemon: a process that only uses the Client never needs them.
TOOL_LAYERS = (
    "agent_backend.dispatch",
    "agent_backend.tools",
    "agent_backend.schema",
    "jsonschema",
)


def test_importing_the_client_does_not_load_the_layers_that_run_tools() -> None:
    """The thin client is the wire format over aiohttp: no dispatch, tools, schema or jsonschema."""
    code = (
        "import sys, agent_backend.client;"
        f"print(sorted(m for m in sys.modules if m.startswith({TOOL_LAYERS!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]"
