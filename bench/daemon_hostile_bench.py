"""The daemon under hostile clients (issue 32): a victim's calls beside an attack, and 200 callers.

Run: ``.venv/bin/python bench/daemon_hostile_bench.py`` (``--quick`` for a short run).

Each daemon runs in a child process, as ``agent-backend serve`` runs it: the
built-in tools on the default local pool, logging at ``warning`` to its
stderr, which goes to a file so that the log each attack causes can be
counted (the old bug: a 507 MB log of ``accept()`` tracebacks). It accepts
two tokens: the victim's and the attacker's, so that per-token limits do not
stand in for the daemon's own bounds. Every daemon is fresh, so that one
measurement never inherits another's leftovers.

Part 1, attacks. For each one, a victim (one :class:`agent_backend.Client`)
makes sequential ``exec {"command": "echo hi"}`` calls, first unloaded (the
baseline), then for as long as the attack lasts; meanwhile ``/v1/health/live``
is polled once a second on a new connection, and the daemon's RSS (VmRSS) and
open descriptors are sampled four times a second. The attacker is a separate
process (so that its CPU is not the victim's event loop's), talks to
127.0.0.1 only, and stops by itself after a set time (20 s; 6 s with
``--quick``, 12 s for slowloris so that its 10 s head timeout is seen):

a. big headers: 4 connections, each sending an ``Authorization`` header of
   256 MB without a token in 64 KiB writes while reading the answer; when the
   daemon answers or closes, the connection reconnects 0.1 s later and starts
   over, until the time is up;
b. slowloris: 1,100 connections, each sending its request head one byte every
   10 s, against a daemon whose ``RLIMIT_NOFILE`` is (1,024, 1,024), set in the
   child before anything else (it raises its soft limit to the hard one at
   start, so both are set); a connection the daemon closes reconnects 1 s
   later. This process and the attacker raise their own limit to the hard one;
c. a 10,000-call JSON-RPC batch to ``/mcp`` (authenticated, 2025-03-26, each
   call ``exec id``: with ``echo hi`` the body is over the default 1 MiB
   ``max_body_bytes``), POSTed again and again by 3 senders;
   a send still waiting when the time is up is cut (the daemon then ends the
   batch, as it does when any MCP client disconnects).

Figures, per attack: the victim's p99 during the attack at most 5x its
unloaded p99, with no failure (an error, a failed result, or no answer in
30 s); the daemon's largest RSS during the attack at most 1.5x its largest
before; for (a), every attempt answered 431 or cut before its 256 MB were
sent (one still sending when the time is up counts as neither), and at least
one was. Reported beside them: what the attacker saw, the health poll's worst
latency, the bytes the daemon logged, its open descriptors.

Part 2, many callers: 200 workers, each its own ``Client`` with its defaults,
make 50 sequential ``exec`` calls each (10,000 calls; 5 each with ``--quick``)
against a daemon with its default settings (``max_concurrent_per_token`` 128,
fewer than the workers). Beside them, against the same daemon, a plain aiohttp loop: 200
workers on one ``ClientSession`` (a connector allowing 200 connections), the
same body and a fresh ``Idempotency-Key`` per call, that on 429 or 503 sleeps
``Retry-After`` seconds and sends the call again (same key), without limit.
The two alternate over 2 rounds, which goes first alternating too. Figures: no
``Client`` error, and the median of the per-round ratios of calls/s
(Client's over the loop's) at least 0.9. The same again against a daemon
started with ``--max-concurrent 32`` (overloaded: far fewer slots than
workers), one round, with the same two figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import anyio.streams.buffered
import orjson

import agent_backend
from agent_backend.client import Client
from agent_backend.errors import AgentBackendError

SELF = os.path.abspath(__file__)
TOKEN = "bench-victim-" + "v" * 24
ATTACKER_TOKEN = "bench-attacker-" + "a" * 24
EXEC_ARGUMENTS = {"command": "echo hi"}
# The batch's command: with "echo hi" its 10,000 calls make 1,088,891 bytes, over the daemon's
# default max_body_bytes (1 MiB), and every send would be a 413 before the batch is read.
BATCH_ARGUMENTS = {"command": "id"}

# Part 1.
LATENCY_BAR = 5.0
RSS_BAR = 1.5
ATTACK_SECONDS = 20.0
QUICK_ATTACK_SECONDS = 6.0
# Longer than the daemon's 10 s head timeout, so that a quick run sees it too.
QUICK_SLOWLORIS_SECONDS = 12.0
PROBE_TIMEOUT = 30.0
"""Seconds one victim call may take before it counts as a failure."""
HEALTH_TIMEOUT = 5.0
HEADER_CONNECTIONS = 4
HEADER_BYTES = 256 << 20
HEADER_CHUNK = 64 << 10
HEADER_PAUSE = 0.1
SLOW_CONNECTIONS = 1_100
SLOW_INTERVAL = 10.0
SLOW_PAUSE = 1.0
DAEMON_NOFILE = 1_024
BATCH_CALLS = 10_000
BATCH_SENDERS = 3
MCP_VERSION = "2025-03-26"

# Part 2.
WORKERS = 200
CALLS_EACH = 50
QUICK_CALLS_EACH = 5
ROUNDS = 2
QUICK_ROUNDS = 2
OVERLOADED_ROUNDS = 1
OVERLOADED_SLOTS = 32
RATIO_BAR = 0.9
PHASE_LIMIT = 600.0
"""Seconds one pass of the workers may take at most (the raw loop retries without limit)."""


def raise_open_files_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` raised to its hard limit; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- the daemon, in a child process -----------------------------------------------------------------


async def child_main(config: dict[str, Any]) -> None:
    """``agent-backend serve``'s daemon (default pool, built-in tools), with two tokens."""
    from agent_backend.daemon import DaemonServer, DaemonSettings
    from agent_backend.data import BUILTIN_TOOLS_DIR
    from agent_backend.dispatch import Dispatcher
    from agent_backend.pool_file import load_pools
    from agent_backend.tools import ToolRegistry

    logging.basicConfig(  # as `agent-backend serve --log-level warning`
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = DaemonSettings(tokens=(TOKEN, ATTACKER_TOKEN), port=0, **config["settings"])
    pools = load_pools(None)
    registry = ToolRegistry.from_dir(BUILTIN_TOOLS_DIR)
    async with pools, Dispatcher(registry, **pools.dispatcher_options()) as dispatcher:
        server = DaemonServer(dispatcher, settings)
        async with anyio.create_task_group() as group:
            url = await group.start(server.serve)
            print(url, flush=True)


class Daemon:
    """A daemon child process, its log file, and what /proc says about it."""

    def __init__(self, label: str, log_dir: Path, *, nofile: int | None = None, **settings: Any):
        self.label = label
        self.log_path = log_dir / f"{label}.log"
        config = {"settings": settings, "nofile": nofile}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, SELF, "--child", json.dumps(config)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.process.kill()
            raise SystemExit(f"the daemon ({label}) did not start: see {self.log_path}")
        self.pid = self.process.pid

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def open_fds(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:
            return 0

    def nofile(self) -> str:
        for line in Path(f"/proc/{self.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return f"{soft}/{hard}"
        return "?"

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> int:
        """SIGTERM, then the exit status (killed after 60 s: grace plus unwinding)."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -9


# -- the attackers, in their own process ------------------------------------------------------------


def _status_of(head: bytes) -> str:
    parts = head.split(b" ", 2)
    if head.startswith(b"HTTP/") and len(parts) > 1:
        return parts[1].decode(errors="replace")
    return "garbage" if head else ""


async def _read_status(stream: anyio.abc.ByteStream) -> str:
    """The status of the answer on ``stream``; "closed" or "reset" when none came."""
    head = b""
    try:
        while b"\r\n" not in head and len(head) < 4096:
            head += await stream.receive()
    except anyio.EndOfStream:
        return _status_of(head) or "closed"
    except (anyio.BrokenResourceError, OSError):
        return _status_of(head) or "reset"
    return _status_of(head)


async def attack_big_headers(host: str, port: int, seconds: float) -> dict[str, Any]:
    """4 connections, each an Authorization header of 256 MB (no token), again until the time."""
    outcomes: collections.Counter[str] = collections.Counter()
    most_sent = 0
    prefix = (
        f"GET /v1/tools HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: bench\r\nAuthorization: "
    ).encode()
    chunk = b"a" * HEADER_CHUNK

    async def one_attempt() -> None:
        nonlocal most_sent
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError:
            outcomes["connect failed"] += 1
            return
        sent = 0
        answer = ""
        try:
            async with stream, anyio.create_task_group() as group:

                async def reader() -> None:
                    nonlocal answer
                    answer = await _read_status(stream)
                    group.cancel_scope.cancel()

                group.start_soon(reader)
                try:
                    await stream.send(prefix)
                    while sent < HEADER_BYTES:
                        await stream.send(chunk)
                        sent += len(chunk)
                    await stream.send(b"\r\n\r\n")
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass  # the daemon closed: the reader tells how
        finally:  # also when the time is up, mid-attempt
            most_sent = max(most_sent, sent)
            if not answer:
                outcomes["still sending, no answer, when the time was up"] += 1
            else:
                whole = "after the whole header" if sent >= HEADER_BYTES else "before 256 MB"
                outcomes[f"{answer} {whole}"] += 1

    async def connection() -> None:
        while True:
            await one_attempt()
            await anyio.sleep(HEADER_PAUSE)

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as group:
            for _ in range(HEADER_CONNECTIONS):
                group.start_soon(connection)
    return {"outcomes": dict(outcomes), "most MB sent on one connection": most_sent / 1e6}


async def attack_slowloris(host: str, port: int, seconds: float) -> dict[str, Any]:
    """1,100 connections, each sending a request head one byte every 10 s, until the time."""
    outcomes: collections.Counter[str] = collections.Counter()
    head = f"GET /v1/health/live HTTP/1.1\r\nHost: {host}:{port}\r\nX-Slow: ".encode()
    open_now = 0
    most_open = 0

    async def one_connection() -> None:
        nonlocal open_now, most_open
        try:
            stream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            outcomes[f"connect failed ({type(exc).__name__})"] += 1
            return
        open_now += 1
        most_open = max(most_open, open_now)
        answer = ""
        try:
            async with stream, anyio.create_task_group() as group:

                async def reader() -> None:
                    nonlocal answer
                    answer = await _read_status(stream)
                    group.cancel_scope.cancel()

                group.start_soon(reader)
                with contextlib.suppress(
                    anyio.BrokenResourceError, anyio.ClosedResourceError, OSError
                ):
                    for index in range(1 << 30):
                        await stream.send(head[index % len(head) : index % len(head) + 1])
                        await anyio.sleep(SLOW_INTERVAL)
        finally:
            open_now -= 1
            outcomes[answer or "open when the time was up"] += 1

    async def connection() -> None:
        while True:
            await one_connection()
            await anyio.sleep(SLOW_PAUSE)

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as group:
            for _ in range(SLOW_CONNECTIONS):
                group.start_soon(connection)
    return {"outcomes": dict(outcomes), "most open at once": most_open}


def mcp_batch_body() -> bytes:
    """10,000 ``tools/call`` requests of ``exec id`` in one JSON-RPC batch (under 1 MiB)."""
    call = {"name": "exec", "arguments": BATCH_ARGUMENTS}
    return orjson.dumps(
        [
            {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": call}
            for i in range(BATCH_CALLS)
        ]
    )


async def attack_mcp_batch(host: str, port: int, seconds: float) -> dict[str, Any]:
    """3 senders POSTing the 10,000-call batch to /mcp again and again, until the time."""
    body = mcp_batch_body()
    headers = {
        "Authorization": f"Bearer {ATTACKER_TOKEN}",
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MCP_VERSION,
    }
    outcomes: collections.Counter[str] = collections.Counter()
    samples: dict[str, str] = {}
    deadline = time.monotonic() + seconds
    url = f"http://{host}:{port}/mcp"

    in_flight = 0

    async def sender(http: aiohttp.ClientSession) -> None:
        nonlocal in_flight
        while time.monotonic() < deadline:
            started = time.monotonic()
            in_flight += 1  # not taken back when the time is up: that send is cut
            try:
                async with http.post(url, data=body, headers=headers) as response:
                    answer = await response.read()
            except aiohttp.ClientError as exc:
                in_flight -= 1
                outcomes[f"error {type(exc).__name__}"] += 1
                await anyio.sleep(0.1)
                continue
            in_flight -= 1
            status = str(response.status)
            if response.status == 200:
                replies = orjson.loads(answer)
                errors = sum(1 for reply in replies if "error" in reply)
                status = f"200 ({len(replies)} replies, {errors} errors)"
            outcomes[status] += 1
            samples.setdefault(status, f"{time.monotonic() - started:.1f} s: {answer[:200]!r}")

    async with aiohttp.ClientSession() as http:
        with anyio.move_on_after(seconds):
            async with anyio.create_task_group() as group:
                for _ in range(BATCH_SENDERS):
                    group.start_soon(sender, http)
    if in_flight:
        outcomes["cut when the time was up"] = in_flight
    return {"body bytes": len(body), "outcomes": dict(outcomes), "first answers": samples}


ATTACKS = {
    "big-headers": attack_big_headers,
    "slowloris": attack_slowloris,
    "mcp-batch": attack_mcp_batch,
}


async def attacker_main(name: str, url: str, seconds: float) -> None:
    raise_open_files_limit()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    print("attacking", flush=True)
    result = await ATTACKS[name](host, int(port), seconds)
    print(json.dumps(result), flush=True)


# -- measuring --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Calls:
    """Latencies (seconds) of a series of calls, and their failures by kind."""

    latencies: list[float] = dataclasses.field(default_factory=list)
    failures: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refusals: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    """429s and 503s the raw loop waited out."""
    wall: float = 0.0

    @property
    def errors(self) -> int:
        return sum(self.failures.values())

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall if self.wall else 0.0

    def pct(self, q: float) -> float:
        """The q-quantile latency in ms."""
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    def failure_text(self) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in self.failures.most_common()) or "none"


async def victim_call(client: Client, calls: Calls) -> None:
    """One ``exec echo hi`` through ``client``; a failure is an error, a failed result, or 30 s."""
    started = time.perf_counter()
    failure = None
    with anyio.move_on_after(PROBE_TIMEOUT) as scope:
        try:
            result = await client.call(("exec", EXEC_ARGUMENTS))
        except AgentBackendError as exc:
            failure = type(exc).__name__
        else:
            failure = None if result.ok else f"result {result.error_type}"
    if scope.cancelled_caught:
        failure = f"no answer in {PROBE_TIMEOUT:g} s"
    calls.latencies.append(time.perf_counter() - started)
    if failure:
        calls.failures[failure] += 1


@dataclasses.dataclass
class Watch:
    """What is sampled beside the victim: the daemon's RSS and descriptors, the health route."""

    rss_kib: int = 0
    fds: int = 0
    health: Calls = dataclasses.field(default_factory=Calls)
    statuses: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


async def sample(daemon: Daemon, watch: Watch, stop: anyio.Event) -> None:
    while not stop.is_set():
        if daemon.alive():
            watch.rss_kib = max(watch.rss_kib, daemon.rss_kib())
            watch.fds = max(watch.fds, daemon.open_fds())
        with anyio.move_on_after(0.25):
            await stop.wait()


async def poll_health(url: str, watch: Watch, stop: anyio.Event) -> None:
    """GET /v1/health/live once a second, each on a new connection."""
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                async with http.get(f"{url}/v1/health/live") as response:
                    await response.read()
                    status = str(response.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            watch.health.latencies.append(time.perf_counter() - started)
            watch.statuses[status] += 1
            with anyio.move_on_after(max(0.0, 1.0 - (time.perf_counter() - started))):
                await stop.wait()


@dataclasses.dataclass
class Figure:
    name: str
    measured: str
    baseline: str
    ratio: str
    bar: str
    ok: bool


@dataclasses.dataclass
class AttackReport:
    figures: list[Figure]
    notes: list[str]


def log_excerpt(daemon: Daemon, start: int, end: int, lines: int = 4) -> list[str]:
    """The first distinct lines the daemon logged between two offsets, clipped."""
    with daemon.log_path.open("rb") as log:
        log.seek(start)
        text = log.read(min(end - start, 1 << 20)).decode(errors="replace")
    seen: list[str] = []
    for line in text.splitlines():
        # Without the timestamp, so that repeats of one line show once.
        core = line.split(" ", 2)[-1][:160]
        if core not in seen:
            seen.append(core)
        if len(seen) >= lines:
            break
    return seen


async def under_attack(
    label: str, attack: str, seconds: float, quick: bool, log_dir: Path, **daemon_options: Any
) -> AttackReport:
    """A fresh daemon; the victim unloaded, then during ``attack``; the figures and what was seen."""
    daemon = Daemon(attack, log_dir, **daemon_options)
    figures: list[Figure] = []
    notes: list[str] = []
    baseline_calls = 60 if quick else 200
    try:
        print(f"\n== {label}: daemon {daemon.url} (pid {daemon.pid}, open files {daemon.nofile()})")
        async with Client(daemon.url, token=TOKEN) as client:
            warmup = Calls()
            for _ in range(20):
                await victim_call(client, warmup)
            baseline = Calls()
            before = Watch()
            stop = anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(sample, daemon, before, stop)
                group.start_soon(poll_health, daemon.url, before, stop)
                for _ in range(baseline_calls):
                    await victim_call(client, baseline)
                stop.set()

            during = Calls()
            watch = Watch()
            log_start = daemon.log_size()
            result: dict[str, Any] = {}
            stop = anyio.Event()

            command = [sys.executable, SELF, "--attack", attack]
            command += ["--url", daemon.url, "--seconds", str(seconds)]
            errors = log_dir / f"{attack}.attacker.log"
            with errors.open("wb") as stderr:
                process = await anyio.open_process(command, stderr=stderr)
            async with process:
                assert process.stdout is not None
                lines = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)

                async def attacker_line(within: float) -> bytes | None:
                    """Its next line of output; None, and the process killed, when none comes."""
                    with anyio.move_on_after(within):
                        with contextlib.suppress(anyio.IncompleteRead, anyio.EndOfStream):
                            return await lines.receive_until(b"\n", 1 << 20)
                    process.kill()
                    return None

                # Its imports take seconds on a loaded machine: measured from its first move.
                if await attacker_line(60) is None:
                    raise SystemExit(f"the attacker did not start: {errors.read_text()[-2000:]}")

                async def run_attacker() -> None:
                    try:
                        line = await attacker_line(seconds + 60)
                        if line is None:
                            result["failed"] = errors.read_text()[-2000:]
                        else:
                            result.update(json.loads(line))
                    finally:
                        stop.set()

                async def victim() -> None:
                    while not stop.is_set():
                        await victim_call(client, during)

                started = time.perf_counter()
                async with anyio.create_task_group() as group:
                    group.start_soon(run_attacker)
                    group.start_soon(sample, daemon, watch, stop)
                    group.start_soon(poll_health, daemon.url, watch, stop)
                    group.start_soon(victim)
                during.wall = time.perf_counter() - started
            log_bytes = daemon.log_size() - log_start
            alive = daemon.alive()
            after = Calls()
            if alive:
                await victim_call(client, after)
    finally:
        code = daemon.stop()

    p99_ratio = during.pct(0.99) / baseline.pct(0.99)
    rss_ratio = watch.rss_kib / before.rss_kib if before.rss_kib else float("inf")
    print(f"attack ({during.wall:.1f} s): {json.dumps(result, indent=None)[:3000]}")
    print(
        f"victim exec: unloaded {len(baseline.latencies)} calls p50 {baseline.pct(0.5):.1f} ms"
        f" p99 {baseline.pct(0.99):.1f} ms; under attack {len(during.latencies)} calls"
        f" p50 {during.pct(0.5):.1f} ms p99 {during.pct(0.99):.1f} ms"
        f" max {during.pct(1.0):.1f} ms; failures: {during.failure_text()}"
    )
    print(
        f"daemon RSS: before {before.rss_kib / 1024:.1f} MiB, max during"
        f" {watch.rss_kib / 1024:.1f} MiB ({rss_ratio:.2f}x); open descriptors: before"
        f" {before.fds}, max during {watch.fds}"
    )
    print(
        f"/v1/health/live: unloaded max {before.health.pct(1.0):.1f} ms; under attack"
        f" {len(watch.health.latencies)} polls, max {watch.health.pct(1.0):.1f} ms,"
        f" statuses {dict(watch.statuses)}"
    )
    print(f"daemon log during the attack: {log_bytes:,} bytes")
    for line in log_excerpt(daemon, log_start, log_start + log_bytes):
        print(f"  | {line}")
    after_text = (
        f"{after.pct(0.5):.1f} ms ({after.failure_text()} failed)" if alive else "daemon gone"
    )
    print(
        f"after the attack: daemon alive {alive}, one call {after_text}; exit status on SIGTERM"
        f" {code}; whole log {daemon.log_size():,} bytes"
    )
    figures.append(
        Figure(
            f"{label}: victim exec p99, 0 failures",
            f"{during.pct(0.99):.1f} ms, {during.errors} fail",
            f"{baseline.pct(0.99):.1f} ms",
            f"{p99_ratio:.2f}x",
            f"<= {LATENCY_BAR:g}x, 0 fail",
            p99_ratio <= LATENCY_BAR and during.errors == 0 and alive,
        )
    )
    figures.append(
        Figure(
            f"{label}: daemon RSS (max)",
            f"{watch.rss_kib / 1024:.1f} MiB",
            f"{before.rss_kib / 1024:.1f} MiB",
            f"{rss_ratio:.2f}x",
            f"<= {RSS_BAR:g}x",
            rss_ratio <= RSS_BAR and alive,
        )
    )
    if attack == "big-headers":
        outcomes: dict[str, int] = result.get("outcomes", {})
        finished = {kind: n for kind, n in outcomes.items() if not kind.startswith("still")}
        refused = sum(n for kind, n in finished.items() if kind.endswith("before 256 MB"))
        figures.append(
            Figure(
                f"{label}: attempts refused (431/cut)",
                f"{refused} of {sum(finished.values())}",
                "-",
                "-",
                "all, before 256 MB",
                refused == sum(finished.values()) > 0,
            )
        )
    notes.append(
        f"INFO  {label}: health max {watch.health.pct(1.0):.1f} ms (unloaded"
        f" {before.health.pct(1.0):.1f} ms); daemon log {log_bytes:,} bytes during the attack;"
        f" exit status {code}"
    )
    return AttackReport(figures, notes)


# -- part 2: 200 callers ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def client_workers(url: str) -> AsyncIterator[list[Client]]:
    """One :class:`Client` per worker, with its defaults."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Client(url, token=TOKEN)) for _ in range(WORKERS)]


async def run_clients(clients: list[Client], calls_each: int) -> Calls:
    calls = Calls()

    async def worker(client: Client) -> None:
        for _ in range(calls_each):
            started = time.perf_counter()
            try:
                result = await client.call(("exec", EXEC_ARGUMENTS))
            except AgentBackendError as exc:
                calls.failures[type(exc).__name__] += 1
            else:
                if not result.ok:
                    calls.failures[f"result {result.error_type}"] += 1
            calls.latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with anyio.fail_after(PHASE_LIMIT):
        async with anyio.create_task_group() as group:
            for client in clients:
                group.start_soon(worker, client)
    calls.wall = time.perf_counter() - started
    return calls


async def run_raw(http: aiohttp.ClientSession, url: str, calls_each: int) -> Calls:
    """The raw loop: one session, a fresh key per call, 429/503 waited out without limit."""
    calls = Calls()
    target = f"{url}/v1/call"

    async def one(index: int) -> None:
        body = orjson.dumps({"id": f"call_{index}", "name": "exec", "arguments": EXEC_ARGUMENTS})
        headers = {"Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex}
        started = time.perf_counter()
        while True:
            try:
                async with http.post(target, data=body, headers=headers) as response:
                    answer = await response.read()
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
            except aiohttp.ClientError as exc:
                calls.failures[type(exc).__name__] += 1
                break
            if status in (429, 503):
                calls.refusals[status] += 1
                await anyio.sleep(float(retry_after or 1.0))
                continue
            if status != 200:
                calls.failures[f"HTTP {status}"] += 1
            elif not orjson.loads(answer).get("ok"):
                calls.failures["result not ok"] += 1
            break
        calls.latencies.append(time.perf_counter() - started)

    async def worker(index: int) -> None:
        for i in range(calls_each):
            await one(index * calls_each + i)

    started = time.perf_counter()
    with anyio.fail_after(PHASE_LIMIT):
        async with anyio.create_task_group() as group:
            for index in range(WORKERS):
                group.start_soon(worker, index)
    calls.wall = time.perf_counter() - started
    return calls


def calls_row(label: str, calls: Calls) -> str:
    refusals = ", ".join(f"{n} x {s}" for s, n in sorted(calls.refusals.items())) or "-"
    return (
        f"  {label:<18} {len(calls.latencies):>7,} {calls.rate:>9,.0f} {calls.pct(0.5):>9.1f}"
        f" {calls.pct(0.99):>9.1f} {calls.errors:>7}  {refusals}"
    )


async def many_callers(
    label: str, rounds: int, calls_each: int, log_dir: Path, **settings: Any
) -> list[Figure]:
    """Client workers vs the raw loop against one daemon, alternating over ``rounds``."""
    daemon = Daemon(label.split()[0], log_dir, **settings)
    clients_runs: list[Calls] = []
    raw_runs: list[Calls] = []
    ratios: list[float] = []
    try:
        print(
            f"\n== {label}: {WORKERS} workers x {calls_each} exec calls, {rounds} round(s);"
            f" daemon {daemon.url} (pid {daemon.pid})"
        )
        print(
            f"  {'':<18} {'calls':>7} {'calls/s':>9} {'p50 ms':>9} {'p99 ms':>9}"
            f" {'errors':>7}  429/503 waited out"
        )
        connector = aiohttp.TCPConnector(limit=WORKERS)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            client_workers(daemon.url) as clients,
            aiohttp.ClientSession(headers=headers, connector=connector) as http,
        ):
            # Warm: a connection per worker on both sides (not counted).
            await run_clients(clients, 1)
            await run_raw(http, daemon.url, 1)
            for index in range(rounds):
                order = ("client", "raw") if index % 2 == 0 else ("raw", "client")
                for side in order:
                    if side == "client":
                        run = await run_clients(clients, calls_each)
                        clients_runs.append(run)
                    else:
                        run = await run_raw(http, daemon.url, calls_each)
                        raw_runs.append(run)
                    name = "Client" if side == "client" else "raw aiohttp loop"
                    print(calls_row(f"{name} r{index + 1}", run), flush=True)
                ratios.append(clients_runs[-1].rate / raw_runs[-1].rate)
    finally:
        code = daemon.stop()
    median = statistics.median(ratios)
    client_errors = sum(r.errors for r in clients_runs)
    failures: collections.Counter[str] = collections.Counter()
    for run in clients_runs:
        failures.update(run.failures)
    raw_errors = sum(r.errors for r in raw_runs)
    refused = sum(sum(r.refusals.values()) for r in raw_runs)
    print(
        f"  ratios (Client calls/s over the raw loop's): {' '.join(f'{r:.3f}' for r in ratios)};"
        f" median {median:.3f}x"
    )
    print(
        f"  Client errors: {client_errors} ({', '.join(f'{n} {k}' for k, n in failures.items()) or 'none'});"
        f" raw loop errors {raw_errors}, 429/503 waited out {refused}; daemon exit status {code};"
        f" log {daemon.log_size():,} bytes"
    )
    total = sum(len(r.latencies) for r in clients_runs)
    return [
        Figure(
            f"{label}: Client errors",
            f"{client_errors} of {total:,}",
            f"raw {raw_errors}",
            "-",
            "0",
            client_errors == 0,
        ),
        Figure(
            f"{label}: Client/raw calls/s",
            f"{statistics.median(r.rate for r in clients_runs):,.0f}/s",
            f"{statistics.median(r.rate for r in raw_runs):,.0f}/s",
            f"{median:.3f}x",
            f">= {RATIO_BAR:g}x",
            median >= RATIO_BAR,
        ),
    ]


# -- the run ----------------------------------------------------------------------------------------


async def main(quick: bool) -> int:
    nofile = raise_open_files_limit()
    seconds = QUICK_ATTACK_SECONDS if quick else ATTACK_SECONDS
    slow_seconds = QUICK_SLOWLORIS_SECONDS if quick else ATTACK_SECONDS
    print(f"agent_backend from {Path(agent_backend.__file__).parent}")
    print(
        f"{os.cpu_count()} cores; load average at start: {os.getloadavg()[0]:.2f};"
        f" this process's open-files limit {nofile}; batch body {len(mcp_batch_body()):,} bytes"
    )
    started = time.perf_counter()
    figures: list[Figure] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hostile-bench-") as tmp:
        log_dir = Path(tmp)
        attacks = (
            ("a. 4 x 256 MB Authorization header", "big-headers", seconds, {}),
            (
                f"b. slowloris, {SLOW_CONNECTIONS:,} connections",
                "slowloris",
                slow_seconds,
                {"nofile": DAEMON_NOFILE},
            ),
            (f"c. {BATCH_CALLS:,}-call /mcp batch", "mcp-batch", seconds, {}),
        )
        for label, attack, duration, options in attacks:
            report = await under_attack(label, attack, duration, quick, log_dir, **options)
            figures += report.figures
            notes += report.notes
        calls_each = QUICK_CALLS_EACH if quick else CALLS_EACH
        figures += await many_callers(
            "default settings", QUICK_ROUNDS if quick else ROUNDS, calls_each, log_dir
        )
        figures += await many_callers(
            f"overloaded (--max-concurrent {OVERLOADED_SLOTS})",
            OVERLOADED_ROUNDS,
            calls_each,
            log_dir,
            max_concurrent_per_token=OVERLOADED_SLOTS,
        )
    print(
        f"\nload average at end: {os.getloadavg()[0]:.2f} (other processes share these cores);"
        f" {time.perf_counter() - started:.0f} s in all"
    )
    width = max(len(f.name) for f in figures)
    print(f"{'':<6}{'figure':<{width}}  {'measured':>22}  {'baseline':>12}  {'ratio':>8}  bar")
    for f in figures:
        print(
            f"{'PASS' if f.ok else 'FAIL':<6}{f.name:<{width}}  {f.measured:>22}"
            f"  {f.baseline:>12}  {f.ratio:>8}  {f.bar}"
        )
    for note in notes:
        print(note)
    return 0 if all(f.ok for f in figures) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter attacks, fewer calls")
    parser.add_argument("--child", metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--attack", choices=sorted(ATTACKS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=ATTACK_SECONDS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        config = json.loads(options.child)
        if config["nofile"]:
            # Before anything opens a file: the daemon raises its soft limit to the hard one.
            resource.setrlimit(resource.RLIMIT_NOFILE, (config["nofile"], config["nofile"]))
        anyio.run(child_main, config)
    elif options.attack:
        anyio.run(attacker_main, options.attack, options.url, options.seconds)
    else:
        sys.exit(anyio.run(main, options.quick))
