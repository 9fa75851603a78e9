"""The one retry rule of every HTTP retry loop: Retry-After on 429/503 (jittered, capped), else jittered backoff.

The pure functions first, then both users of :func:`agent_backend.retry.retry_delay`
(the daemon's :class:`~agent_backend.Client` and the rollouts'
:class:`~agent_backend.rollout.server_client.PolicyServerClient`) against a
real aiohttp server on 127.0.0.1 that refuses the first request with a
``Retry-After``.
"""

from __future__ import annotations

import contextlib
import email.utils
import random
import time
from collections.abc import AsyncIterator

import aiohttp.web
import anyio
import anyio.abc
import orjson
import pytest

from agent_backend.backoff import backoff_delay
from agent_backend.client import Client
from agent_backend.dispatch import ToolResult
from agent_backend.retry import parse_retry_after, retry_after_delay, retry_delay
from agent_backend.rollout import OpenAICompatiblePolicy

NOW = 1_800_000_000.0


def test_doubles_per_retry_within_half_jitter_and_caps() -> None:
    rng = random.Random(7)
    for attempt, full in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0), (9, 5.0)):
        for _ in range(200):
            delay = backoff_delay(attempt, first=0.5, ceiling=5.0, rng=rng)
            assert full * 0.5 <= delay < full


def test_jitter_spreads_callers() -> None:
    delays = {backoff_delay(3, first=1.0, ceiling=60.0) for _ in range(50)}
    assert len(delays) > 40


def test_retry_after_is_seconds_or_an_http_date() -> None:
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("1.5") == 1.5
    assert parse_retry_after(email.utils.formatdate(NOW + 30, usegmt=True), now=NOW) == 30.0
    assert parse_retry_after(email.utils.formatdate(NOW - 30, usegmt=True), now=NOW) == 0.0
    assert parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now=784111777 - 10) == 10.0
    for unreadable in (None, "", "soon", "-1", "nan", "inf", "Sun, 06 Nov 1994 08:49:37"):
        assert parse_retry_after(unreadable, now=NOW) is None, unreadable


def test_a_retry_after_is_waited_at_least_as_asked_and_up_to_half_again() -> None:
    rng = random.Random(11)
    delays = [retry_after_delay(2.0, rng=rng) for _ in range(500)]
    assert all(2.0 <= delay < 3.0 for delay in delays)
    assert min(delays) < 2.05, "the whole window is used"
    assert max(delays) > 2.95, "the whole window is used"
    same = random.Random(11)
    assert [retry_after_delay(2.0, rng=same) for _ in range(500)] == delays  # reproducible
    assert retry_after_delay(0.0, rng=rng) == 0.0  # "now" is not delayed
    assert all(retry_after_delay(2.0, ceiling=2.5, rng=rng) <= 2.5 for _ in range(100))
    assert retry_after_delay(3600.0, ceiling=5.0, rng=rng) == 5.0


def test_callers_refused_together_come_back_spread_out() -> None:
    """200 workers refused at once with Retry-After: 1 do not all return at the same instant."""
    rng = random.Random(5)
    returns = sorted(retry_after_delay(1.0, rng=rng) for _ in range(200))
    per_10ms = [sum(1 for r in returns if start <= r < start + 0.01) for start in returns]
    assert max(per_10ms) <= 12  # 4 on average over the 0.5 s window
    assert returns[-1] - returns[0] > 0.45


def test_retry_after_wins_on_429_and_503_capped_by_the_ceiling() -> None:
    assert retry_delay(1, first=10.0, ceiling=20.0, status=429, retry_after="0") == 0.0
    assert 3.0 <= retry_delay(1, first=10.0, ceiling=20.0, status=503, retry_after="3") < 4.5
    assert retry_delay(4, first=0.1, ceiling=5.0, status=503, retry_after="3600") == 5.0
    date = email.utils.formatdate(time.time() + 3600, usegmt=True)
    assert retry_delay(1, first=0.1, ceiling=2.0, status=429, retry_after=date) == 2.0


def test_other_answers_and_connection_errors_back_off() -> None:
    rng = random.Random(3)
    for status, header in ((None, None), (500, "0"), (502, "0"), (503, "later"), (429, None)):
        delay = retry_delay(3, first=1.0, ceiling=60.0, status=status, retry_after=header, rng=rng)
        assert 2.0 <= delay < 4.0, (status, header)


# -- both clients, against a server that refuses first ----------------------------------------------


class Refusing:
    """Answers the first request of each path ``status`` with ``Retry-After``, the rest 200."""

    def __init__(self, status: int, retry_after: str, ok_body: bytes) -> None:
        self.status = status
        self.retry_after = retry_after
        self.ok_body = ok_body
        self.arrivals: list[float] = []

    async def handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.arrivals.append(time.monotonic())
        if len(self.arrivals) == 1:
            return aiohttp.web.Response(
                status=self.status, headers={"Retry-After": self.retry_after}, body=b"{}"
            )
        return aiohttp.web.Response(body=self.ok_body, content_type="application/json")


@contextlib.asynccontextmanager
async def serve(refusing: Refusing) -> AsyncIterator[str]:
    app = aiohttp.web.Application()
    app.router.add_post("/{tail:.*}", refusing.handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def policy_client(url: str, *, backoff: float, max_backoff: float) -> OpenAICompatiblePolicy:
    """The chat policy: its retry loop is :class:`PolicyServerClient`'s, shared with the token sampler."""
    return OpenAICompatiblePolicy(
        url + "/v1/chat/completions",
        model="m",
        timeout=10.0,
        max_retries=2,
        backoff=backoff,
        max_backoff=max_backoff,
    )


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", [429, 503])
async def test_the_policy_client_waits_what_the_server_asks(status: int) -> None:
    refusing = Refusing(status, "1", b'{"ok": 1}')
    async with serve(refusing) as url, policy_client(url, backoff=0.0, max_backoff=10.0) as client:
        with anyio.fail_after(10):
            assert await client._post(b"{}", None) == ({"ok": 1}, (0, 0))
        assert client.statistics().retries == 1
    waited = refusing.arrivals[1] - refusing.arrivals[0]
    assert 0.9 <= waited < 5, waited


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_policy_client_caps_retry_after_at_its_max_backoff() -> None:
    refusing = Refusing(503, "3600", b'{"ok": 1}')
    async with serve(refusing) as url, policy_client(url, backoff=0.0, max_backoff=0.3) as client:
        with anyio.fail_after(10):
            assert await client._post(b"{}", None) == ({"ok": 1}, (0, 0))
    waited = refusing.arrivals[1] - refusing.arrivals[0]
    assert 0.25 <= waited < 3, waited


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_client_reads_an_http_date_and_skips_its_backoff() -> None:
    result = ToolResult(call_id="c", tool="echo", ok=True, output="late")
    past = email.utils.formatdate(time.time() - 60, usegmt=True)  # "retry now"
    refusing = Refusing(503, past, orjson.dumps(result.model_dump()))
    async with (
        serve(refusing) as url,
        Client(url, token="t" * 20, backoff=30.0, max_backoff=60.0) as client,
    ):
        with anyio.fail_after(10):  # a backoff of 30 s would overrun this
            answer = await client.call(("echo", {"value": "late"}))
    assert answer.output == "late"
    assert len(refusing.arrivals) == 2


class HangsUpFirst:
    """Reads the first request and closes its connection unanswered, as a server does to a
    kept-alive connection it timed out just as the request came; answers later ones with 200."""

    def __init__(self, ok_body: bytes) -> None:
        self.ok_body = ok_body
        self.arrivals: list[float] = []

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await client.receive()
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += await client.receive()
            self.arrivals.append(time.monotonic())
            if len(self.arrivals) == 1:
                return  # closed without an answer
            await client.send(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(self.ok_body)}\r\nConnection: close\r\n\r\n".encode()
                + self.ok_body
            )


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_the_policy_client_resends_at_once_when_the_server_hung_up() -> None:
    server = HangsUpFirst(b'{"ok": 1}')
    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener,
        anyio.create_task_group() as group,
    ):
        group.start_soon(listener.serve, server.handle)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        # A backoff of 30 s would overrun the 10 s below: the resend must not wait for it.
        async with policy_client(
            f"http://127.0.0.1:{port}", backoff=30.0, max_backoff=60.0
        ) as client:
            with anyio.fail_after(10):
                assert await client._post(b"{}", None) == ({"ok": 1}, (0, 0))
            assert client.statistics().retries == 1
        group.cancel_scope.cancel()
    assert len(server.arrivals) == 2
