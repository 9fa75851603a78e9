"""Exactly once under retries: the Idempotency-Key store as a state machine, and live."""

from __future__ import annotations

import uuid

import anyio
import httpx
import pytest
from support.daemon_fixtures import OTHER_TOKEN, TALLY, Daemon, daemon_fixture  # noqa: F401

from agent_backend.daemon.idempotency import IdempotencyStore, StoredResponse, fingerprint

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _response(status: int = 200, body: bytes = b"{}") -> StoredResponse:
    return StoredResponse(status, ((b"content-type", b"application/json"),), body)


async def test_store_runs_once_then_waits_then_replays_and_refuses_other_requests() -> None:
    store = IdempotencyStore(ttl=10, max_entries=10, max_bytes=1 << 20)
    key = ("alice", "k1")
    action, entry = store.begin(key, b"fp")
    assert action == "run"
    assert entry is not None
    assert store.begin(key, b"fp")[0] == "wait"
    assert store.begin(key, b"other")[0] == "conflict"
    assert store.begin(("bob", "k1"), b"fp")[0] == "run", "keys are per token"
    store.finish(key, entry, _response())
    assert entry.done.is_set()
    action, again = store.begin(key, b"fp")
    assert action == "replay"
    assert again is entry
    assert again.response == _response()
    assert store.begin(key, b"other")[0] == "conflict"
    stats = store.statistics()
    assert (stats.running, stats.kept, stats.replays, stats.conflicts) == (1, 1, 1, 2)


async def test_store_forgets_after_the_ttl_and_keeps_within_its_bounds() -> None:
    clock = Clock()
    body = b"x" * 1000
    size = _response(body=body).size
    store = IdempotencyStore(ttl=5, max_entries=3, max_bytes=size * 2, clock=clock)
    for name in ("a", "b", "c"):
        _, entry = store.begin(("p", name), b"fp")
        assert entry is not None
        store.finish(("p", name), entry, _response(body=body))
        clock.now += 1
    # Over the byte bound: the oldest finished one went first.
    assert store.statistics().kept == 2
    assert store.begin(("p", "a"), b"fp")[0] == "run"
    assert store.begin(("p", "c"), b"fp")[0] == "replay"
    assert store.statistics().kept_bytes <= size * 2
    clock.now += 10
    assert store.begin(("p", "c"), b"fp")[0] == "run", "kept past its ttl"
    assert store.statistics().kept == 0


async def test_store_drops_5xx_and_unanswered_requests_so_a_retry_runs_again() -> None:
    store = IdempotencyStore(ttl=10, max_entries=10, max_bytes=1 << 20)
    _, entry = store.begin(("p", "k"), b"fp")
    assert entry is not None
    store.finish(("p", "k"), entry, _response(503))
    assert entry.response is not None
    assert entry.response.status == 503
    assert store.begin(("p", "k"), b"fp")[0] == "run"
    _, entry = store.begin(("p", "k2"), b"fp")
    assert entry is not None
    store.finish(("p", "k2"), entry, None)
    assert entry.done.is_set()
    assert entry.response is None
    assert store.begin(("p", "k2"), b"fp")[0] == "run"


async def test_fingerprint_ignores_key_order_and_whitespace_but_not_values() -> None:
    a = fingerprint("POST", "/v1/call", b'{"name": "x", "arguments": {"a": 1, "b": 2}}')
    b = fingerprint("POST", "/v1/call", b'{"arguments":{"b":2,"a":1},"name":"x"}')
    c = fingerprint("POST", "/v1/call", b'{"arguments":{"b":3,"a":1},"name":"x"}')
    d = fingerprint("POST", "/v1/batch", b'{"arguments":{"b":2,"a":1},"name":"x"}')
    assert a == b
    assert len({a, c, d}) == 3
    assert fingerprint("POST", "/v1/call", b"not json") != fingerprint(
        "POST", "/v1/call", b"not json "
    )


async def test_concurrent_retries_run_the_tool_once(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    body = {"name": "tally", "arguments": {"key": key, "delay": 0.5}}
    responses: list[httpx.Response] = []
    async with daemon.async_http() as http:

        async def attempt() -> None:
            responses.append(
                await http.post("/v1/call", json=body, headers={"Idempotency-Key": key})
            )

        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(attempt)
        later = await http.post("/v1/call", json=body, headers={"Idempotency-Key": key})
    assert TALLY[key] == 1
    assert all(r.status_code == 200 for r in responses)
    assert len({r.content for r in [*responses, later]}) == 1, "a retry got another result"
    replayed = [r.headers.get("idempotent-replayed") for r in responses]
    assert replayed.count(None) == 1
    assert replayed.count("true") == 7
    assert later.headers["idempotent-replayed"] == "true"
    assert later.json()["output"] == "1"


async def test_same_key_with_other_arguments_is_409(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with daemon.async_http() as http:
        first = await http.post(
            "/v1/call",
            json={"name": "tally", "arguments": {"key": key}},
            headers={"Idempotency-Key": key},
        )
        conflict = await http.post(
            "/v1/call",
            json={"name": "tally", "arguments": {"key": key + "-other"}},
            headers={"Idempotency-Key": key},
        )
        other_route = await http.post(
            "/v1/batch",
            json={"calls": [{"name": "tally", "arguments": {"key": key}}]},
            headers={"Idempotency-Key": key},
        )
        # Another token's keys are its own.
        async with daemon.async_http(OTHER_TOKEN) as other:
            elsewhere = await other.post(
                "/v1/call",
                json={"name": "tally", "arguments": {"key": key}},
                headers={"Idempotency-Key": key},
            )
        bad_key = await http.post(
            "/v1/call",
            json={"name": "echo", "arguments": {"value": "x"}},
            headers={"Idempotency-Key": "x" * 300},
        )
    assert first.status_code == 200
    for response in (conflict, other_route):
        assert response.status_code == 409
        assert response.json()["error"]["type"] == "IdempotencyConflict"
        assert response.json()["error"]["fields"]["key"] == key
    assert elsewhere.status_code == 200
    assert "idempotent-replayed" not in elsewhere.headers
    assert TALLY[key] == 2  # once per token
    assert bad_key.status_code == 422


async def test_a_retry_after_the_client_gave_up_gets_the_first_result(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    body = {"name": "tally", "arguments": {"key": key, "delay": 0.8}}
    async with daemon.async_http(timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post("/v1/call", json=body, headers={"Idempotency-Key": key})
    async with daemon.async_http() as http:
        retry = await http.post("/v1/call", json=body, headers={"Idempotency-Key": key})
    assert retry.status_code == 200
    assert retry.json()["output"] == "1"
    assert TALLY[key] == 1


async def test_sessions_and_batches_are_idempotent_too(daemon: Daemon) -> None:
    key = uuid.uuid4().hex
    async with daemon.async_http() as http:
        opened = [
            (await http.post("/v1/sessions", headers={"Idempotency-Key": key})) for _ in range(2)
        ]
        assert opened[0].json()["id"] == opened[1].json()["id"]
        batch = {"calls": [{"name": "tally", "arguments": {"key": key}}] * 3}
        for _ in range(2):
            await http.post("/v1/batch", json=batch, headers={"Idempotency-Key": key + "b"})
        await http.delete(f"/v1/sessions/{opened[0].json()['id']}")
    assert TALLY[key] == 3
