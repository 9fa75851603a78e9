"""Hostile traffic is bounded, before authentication and after it, against a real daemon.

Each test starts ``agent-backend serve`` in a child process whose open-files
limit is 256 (so that exhausting it takes a few hundred sockets, not
thousands), attacks it over loopback with loops that stop by themselves, and
checks three things: the attack fails as the limit says, the daemon answers
``/v1/health/live`` and an authenticated call meanwhile, and its descriptors
come back to what they were. Two attacks come with a token: a batch of
10,000 calls, and a token opening sessions past its cap (that one on a
daemon in this process, which accepts two tokens). Every wait is on a
state, bounded generously.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.daemon_fixtures import OTHER_TOKEN, TOKEN, make_registry
from support.serve_child import Child, closed_by_peer, read_one_response, serve_child

from agent_backend.daemon import DaemonSettings, run_in_thread
from agent_backend.pool_file import DEFAULT_POOL, with_isolation

pytestmark = pytest.mark.timeout(120)

NOFILE = 256


@contextlib.contextmanager
def serve(tmp_path: Path, **settings: object) -> Iterator[Child]:
    """``agent-backend serve`` with ``settings`` (as AGENT_BACKEND_<NAME>) and 256 descriptors."""
    env = {f"AGENT_BACKEND_{name.upper()}": str(value) for name, value in settings.items()}
    # No walls: their trial sandbox raises its own limits past the 256 given here.
    with serve_child(tmp_path, "--log-level", "info", env=env, nofile=NOFILE) as child:
        yield child


def wait_until(condition: Callable[[], bool], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.05)


def _answers(url: str, path: str, headers: dict[str, str] | None = None) -> bool:
    try:
        response = httpx.get(url + path, headers=headers, timeout=5)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def assert_serving(child: Child, *, within: float) -> None:
    """Liveness and an authenticated call both answer 200, retried until ``within`` seconds."""
    wait_until(lambda: _answers(child.url, "/v1/health/live"), within=within, what="liveness")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    wait_until(lambda: _answers(child.url, "/v1/tools", auth), within=within, what="an authed call")


def settle(child: Child, baseline: int) -> None:
    """The child's descriptors come back to ``baseline``, and its log shows no traceback."""
    wait_until(lambda: child.fds() <= baseline, within=30, what=f"descriptors back to {baseline}")
    assert "Traceback" not in child.log_text()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setblocking(False)
    return sock


def read_response(sock: socket.socket, *, within: float) -> bytes:
    """What the daemon sent before closing (or within ``within`` seconds)."""
    sock.setblocking(True)
    sock.settimeout(within)
    received = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


HEAD = b"GET /v1/tools HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def test_an_oversized_header_without_a_token_gets_431_having_read_a_bounded_amount(
    tmp_path: Path,
) -> None:
    with serve(tmp_path) as child:
        assert_serving(child, within=30)
        baseline = child.fds()

        # Just over the bound, all of it buffered: the client reads a 431 in the daemon's shape.
        sock = socket.create_connection(("127.0.0.1", child.port), timeout=10)
        sock.sendall(HEAD + b"Authorization: Bearer " + b"a" * (96 << 10) + b"\r\n\r\n")
        answer = read_response(sock, within=10)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b'"error"' in answer
        assert b"exceed 65536 bytes" in answer

        # A 64 MB header sent as fast as loopback goes: the daemon stops reading long before.
        sent = 0
        failed: list[BaseException] = []

        def flood() -> None:
            nonlocal sent
            chunk = b"a" * (1 << 20)
            with socket.create_connection(("127.0.0.1", child.port), timeout=10) as attacker:
                try:
                    attacker.sendall(HEAD + b"Authorization: Bearer ")
                    for _ in range(64):
                        attacker.sendall(chunk)
                        sent += len(chunk)
                    attacker.sendall(b"\r\n\r\n")
                except OSError as exc:  # reset or timed out: the daemon no longer reads
                    failed.append(exc)

        attacker = threading.Thread(target=flood)
        attacker.start()
        assert_serving(child, within=30)
        attacker.join(timeout=60)
        assert not attacker.is_alive()
        assert failed, f"the daemon read the whole {sent >> 20} MiB header"
        # What the kernel buffers on both sides, and no more: far from 64 MiB.
        assert sent < 32 << 20, sent
        settle(child, baseline)


def test_a_header_sent_a_byte_at_a_time_is_cut_at_the_head_deadline(tmp_path: Path) -> None:
    with serve(tmp_path, head_timeout=1.0) as child:
        assert_serving(child, within=30)
        baseline = child.fds()
        # More than the descriptors the daemon has: over its cap, the rest are refused at once.
        count = NOFILE + 44
        sockets = {connect(child.port): time.monotonic() for _ in range(count)}
        cut: dict[socket.socket, tuple[float, bytes]] = {}
        selector = selectors.DefaultSelector()
        for sock in sockets:
            selector.register(sock, selectors.EVENT_READ)

        def trickle() -> None:
            # One header byte per second per connection, for at most 20 s, until all are cut.
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.send(HEAD[:-2])
            started = time.monotonic()
            last_byte = started
            while len(cut) < count and time.monotonic() - started < 20:
                for key, _ in selector.select(timeout=0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    cut[sock] = (time.monotonic() - sockets[sock], data)
                    selector.unregister(sock)
                if time.monotonic() - last_byte >= 1:
                    last_byte = time.monotonic()
                    for sock in sockets.keys() - cut.keys():
                        with contextlib.suppress(OSError):
                            sock.send(b"X")

        attack = threading.Thread(target=trickle)
        attack.start()
        try:
            assert_serving(child, within=20)
        finally:
            attack.join(timeout=60)
            selector.close()
            for sock in sockets:
                sock.close()
        assert len(cut) == count, f"{count - len(cut)} connections were never cut"
        statuses = [data.split(b" ", 2)[1] if data else b"" for _, data in cut.values()]
        assert statuses.count(b"408") >= 100, statuses
        assert set(statuses) <= {b"408", b"503"}, set(statuses)
        # Cut within 10x the 1 s deadline, though each byte arrived in time.
        assert max(elapsed for elapsed, _ in cut.values()) < 10
        settle(child, baseline)


def test_connections_over_the_cap_are_refused_with_503_and_idle_ones_make_room(
    tmp_path: Path,
) -> None:
    # head_timeout 40 s: a held connection counts as stalled only after 10 s (the test's own
    # 30 held ones connect well within that), so the cap answers 503 rather than cutting one.
    with serve(tmp_path, max_connections=20, head_timeout=40.0) as child:
        assert_serving(child, within=30)
        baseline = child.fds()

        # 20 keep-alive connections, idle after one request: a new connection closes one.
        idle = [socket.create_connection(("127.0.0.1", child.port), timeout=10) for _ in range(20)]
        try:
            for sock in idle:
                sock.sendall(b"GET /v1/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert read_one_response(sock).startswith(b"HTTP/1.1 200 ")
            assert_serving(child, within=5)
            # Two were closed to make room (one per request of assert_serving).
            closed = [sock for sock in idle if closed_by_peer(sock, within=0.5)]
            assert len(closed) >= 2
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: child.fds() <= baseline, within=30, what="the idle ones closed")

        # 20 connections that never send: the next ones get a clear 503 at once.
        # (The daemon accepts in the order the kernel queued them: the held ones first.)
        held = [connect(child.port) for _ in range(20)]
        over = [connect(child.port) for _ in range(10)]
        try:
            for sock in over:
                answer = read_response(sock, within=10)
                assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
                assert b"retry-after: 1\r\n" in answer.lower()
                assert b"too many open connections" in answer
        finally:
            for sock in held + over:
                sock.close()
        assert_serving(child, within=30)
        settle(child, baseline)


def test_slow_heads_make_room_for_new_connections_at_the_cap(tmp_path: Path) -> None:
    # Slowloris at the cap: every slot holds a head arriving a byte at a time. Once a head has
    # arrived for a quarter of head_timeout (1 s here), a new connection cuts the oldest (408),
    # so liveness and authenticated calls are served long before the heads' own deadline.
    with serve(tmp_path, max_connections=20, head_timeout=4.0) as child:
        assert_serving(child, within=30)
        baseline = child.fds()
        held = [connect(child.port) for _ in range(20)]
        try:
            for sock in held:
                sock.send(HEAD[:5])
            last = time.monotonic()
            wait_until(lambda: time.monotonic() - last > 1.0, within=10, what="1 s passed")
            assert_serving(child, within=30)
            answers = [read_response(sock, within=0.5) for sock in held]
            cut = [answer for answer in answers if answer.startswith(b"HTTP/1.1 408 ")]
            assert cut, answers
            assert b"a new connection needed room" in cut[0]
            assert all(not answer or answer.startswith(b"HTTP/1.1 408 ") for answer in answers)
        finally:
            for sock in held:
                sock.close()
        settle(child, baseline)
        assert "slow request head cut to make room (408)" in child.log_text()


def test_the_log_under_attack_has_no_traceback_and_a_few_summary_lines(tmp_path: Path) -> None:
    # A cap above the descriptors the daemon has: accept() itself fails (EMFILE).
    with serve(tmp_path, max_connections=1000, head_timeout=2.0) as child:
        assert_serving(child, within=30)
        baseline = child.fds()
        held = [connect(child.port) for _ in range(NOFILE + 44)]
        try:
            wait_until(
                lambda: any(word in child.log_text() for word in ("EMFILE", "out of system")),
                within=30,
                what="accept() failing, logged",
            )
            assert_serving(child, within=30)
        finally:
            for sock in held:
                sock.close()
        settle(child, baseline)
        summaries = [line for line in child.log_text().splitlines() if "refused or cut" in line]
        assert 1 <= len(summaries) <= 4, summaries
        assert "socket.accept() out of system resource" not in child.log_text()


# -- attacks with a token ---------------------------------------------------------------------------


def _echo_hi(url: str, token: str = TOKEN) -> bool:
    """An authenticated ``exec echo hi`` answers with its output (within 10 s)."""
    try:
        response = httpx.post(
            url + "/v1/call",
            json={"name": "exec", "arguments": {"command": "echo hi"}},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and response.json()["output"] == "hi\n"


def _exec_calls(url: str) -> float:
    """The ``exec`` calls the daemon ran to the end, whatever their outcome (its metrics)."""
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    pattern = r'^agent_backend_calls_total\{[^}]*tool="exec"[^}]*\} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, metrics, re.M))


def test_a_10000_call_mcp_batch_is_refused_before_any_call_runs(tmp_path: Path) -> None:
    with serve(tmp_path) as child:
        assert_serving(child, within=30)
        baseline = child.fds()
        # One JSON-RPC batch of 10,000 tools/call in under 1 MiB: over max_batch (256).
        call = {"jsonrpc": "2.0", "method": "tools/call"}
        params = {"name": "exec", "arguments": {"command": ":"}}  # the shell's no-op
        batch = [{**call, "id": i, "params": params} for i in range(10_000)]
        body = json.dumps(batch, separators=(",", ":")).encode()
        assert len(body) <= 1 << 20
        headers = {
            "Authorization": f"Bearer {TOKEN}",
            "Content-Type": "application/json",
            "Accept": "application/json",
            "MCP-Protocol-Version": "2025-03-26",
        }
        answers: list[httpx.Response] = []

        def attack() -> None:
            with httpx.Client(timeout=30) as http:
                for _ in range(10):
                    answers.append(http.post(child.url + "/mcp", content=body, headers=headers))

        attackers = [threading.Thread(target=attack) for _ in range(4)]
        for attacker in attackers:
            attacker.start()
        echoed = 0
        try:
            # Meanwhile liveness and another client's authenticated call keep answering.
            while any(attacker.is_alive() for attacker in attackers) or not echoed:
                assert _answers(child.url, "/v1/health/live")
                wait_until(lambda: _echo_hi(child.url), within=30, what="exec echo hi")
                echoed += 1
        finally:
            for attacker in attackers:
                attacker.join(timeout=60)
        assert not any(attacker.is_alive() for attacker in attackers)
        assert len(answers) == 40
        for answer in answers:
            assert answer.status_code == 422, answer.text[:300]
            error = answer.json()["error"]
            assert "a batch has at most 256 messages" in error["message"]
        # Not one of the 400,000 calls ran: every exec the daemon ran was an "echo hi".
        assert _exec_calls(child.url) == echoed
        settle(child, baseline)
        assert "WARNING" not in child.log_text()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sessions_past_the_cap_are_429_with_retry_after_and_another_token_works() -> None:
    """A token opening sessions to its cap, then 200 more at once: each is refused at once with
    429 and Retry-After, while another token's calls (and its own stateless MCP calls) work."""
    settings = DaemonSettings(
        tokens=(TOKEN, OTHER_TOKEN), port=0, grace=2.0, max_sessions_per_token=64
    )
    pool = with_isolation(DEFAULT_POOL, "none").model_copy(update={"spare_workspaces": 0})
    with run_in_thread(make_registry(), settings, pool=pool) as daemon:
        url = daemon.url
        assert _echo_hi(url)
        assert _echo_hi(url, OTHER_TOKEN)
        baseline = _open_fds()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as http:
            opened = [http.post("/v1/sessions") for _ in range(64)]
            assert [response.status_code for response in opened] == [201] * 64
            refused: list[httpx.Response] = []

            def more() -> None:
                with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
                    refused.extend(client.post("/v1/sessions") for _ in range(50))

            attackers = [threading.Thread(target=more) for _ in range(4)]
            for attacker in attackers:
                attacker.start()
            try:
                while any(attacker.is_alive() for attacker in attackers):
                    assert _answers(url, "/v1/health/live")
                    wait_until(
                        lambda: _echo_hi(url, OTHER_TOKEN), within=30, what="the other token"
                    )
            finally:
                for attacker in attackers:
                    attacker.join(timeout=60)
            assert len(refused) == 200
            for response in refused:
                assert response.status_code == 429, response.text[:300]
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["type"] == "TooManySessions"
            # The token at its cap still makes stateless MCP calls, and so does the other.
            stateless = http.post(
                "/mcp",
                json={
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "tools/call",
                    "params": {"name": "exec", "arguments": {"command": "echo hi"}},
                },
                headers={"Accept": "application/json"},
            )
            assert stateless.status_code == 200
            assert stateless.json()["result"]["content"][0]["text"] == "hi\n"
            assert daemon.dispatcher.statistics().sessions_open == 65  # its 64 and the stateless
            for response in opened:
                assert http.delete(f"/v1/sessions/{response.json()['id']}").status_code == 204
            assert http.post("/v1/sessions").status_code == 201  # room again
        wait_until(
            lambda: _open_fds() <= baseline, within=30, what=f"descriptors back to {baseline}"
        )
