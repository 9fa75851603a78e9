"""The daemon's own overhead: a trivial tool through the daemon vs the in-process Dispatcher.

Run: ``.venv/bin/python bench/daemon_bench.py`` (``--quick`` for a short run).

The tool is a Python function that returns its input, so what is measured is
the daemon (HTTP, auth, limits, idempotency, JSON, routing) and not a
subprocess. The daemon runs in a child process (``agent-backend``'s own
server code, on the embedded local pool) so that it and the load generator
each have a core, as they would on a tool host and a rollout worker.

The ``daemon`` rows are what a user's code does: each concurrent client is
its own :class:`agent_backend.Client` (on aiohttp) with one keep-alive
connection, calling ``client.call(...)`` (an ``Idempotency-Key`` on every
call, the answer parsed into a ``ToolResult``; no retries, so every failure
counts as an error). Beside them: a plain ``aiohttp.ClientSession`` doing the
Client's per-call work by hand (orjson body, an ``Idempotency-Key``, the
``ToolResult`` parse), and a minimal hand-written HTTP/1.1 client ("raw
client") that shows how much of the time is the daemon's.

Figures to reach, printed as PASS/FAIL:
* at 1 client, the daemon's p50 latency is within 1 ms of the in-process call
  (issue 5);
* at 16 clients, at least 1,500 calls/s through the daemon, with no errors
  (issue 5);
* ``Client`` makes at least 0.95x the calls/s of the plain ``ClientSession``
  at 1 and at 16 clients (issue 13): the two are measured against the same
  daemon in alternating rounds (which goes first alternates too), and the
  median of the per-round ratios is the figure.
The exec tool (a real subprocess per call) is reported for scale, without a bar.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import aiohttp
import anyio
import anyio.streams.buffered
import orjson
from yarl import URL

from agent_backend.client import Client
from agent_backend.daemon import DaemonServer, DaemonSettings
from agent_backend.dispatch import Dispatcher, ToolResult
from agent_backend.errors import AgentBackendError
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolRegistry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "bench-token-" + "x" * 24
CONCURRENCY = (1, 16, 64)
# Client vs a plain aiohttp session: rounds at each of these, and the bar on the median ratio.
COMPARED = (1, 16)
ROUNDS = 60
RATIO_BAR = 0.95
# The daemon's process, whose CPU time the daemon rows report.
SERVER: subprocess.Popen[str] | None = None


def make_registry() -> ToolRegistry:
    registry = ToolRegistry.from_dir(os.path.join(ROOT, "schemas", "tools"))

    @registry.tool
    async def echo(value: str) -> str:
        """Return the input unchanged.

        Args:
            value: Any text.
        """
        return value

    return registry


# -- the daemon, in a child process -----------------------------------------------------------------


async def child_main() -> None:
    registry = make_registry()
    settings = DaemonSettings(tokens=(TOKEN,), port=0, max_concurrent_per_token=256, mcp=False)
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(registry, pool) as dispatcher:
        server = DaemonServer(dispatcher, settings)
        async with anyio.create_task_group() as group:
            url = await group.start(server.serve)
            print(url, flush=True)


def start_child() -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    url = child.stdout.readline().strip()
    if not url.startswith("http://"):
        child.kill()
        raise SystemExit("the daemon did not start")
    return child, url


# -- measuring --------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run:
    def __init__(self, latencies: list[float], wall: float, errors: int) -> None:
        self.latencies = sorted(latencies)
        self.wall = wall
        self.errors = errors
        self.client_cpu = 0.0
        """This process's CPU seconds per call (the load generator, and in-process the tool)."""
        self.server_cpu = 0.0
        """The daemon's CPU seconds per call."""

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall

    def pct(self, q: float) -> float:
        index = min(len(self.latencies) - 1, int(q * len(self.latencies)))
        return self.latencies[index] * 1000


def _server_pid() -> int | None:
    """The daemon child's pid, whose CPU per call the daemon runs report."""
    return SERVER.pid if SERVER is not None else None


async def load(
    concurrency: int,
    total: int,
    one_call: Callable[[int], Awaitable[bool]],
    warmup: int,
    *,
    server_pid: int | None = None,
) -> Run:
    for i in range(warmup):
        await one_call(i)
    latencies: list[float] = []
    errors = 0
    per_client = total // concurrency

    async def client(index: int) -> None:
        nonlocal errors
        for i in range(per_client):
            started = time.perf_counter()
            ok = await one_call(index * per_client + i)
            latencies.append(time.perf_counter() - started)
            errors += not ok

    started = time.perf_counter()
    cpu = time.process_time()
    server = cpu_seconds(server_pid) if server_pid else 0.0
    async with anyio.create_task_group() as group:
        for index in range(concurrency):
            group.start_soon(client, index)
    run = Run(latencies, time.perf_counter() - started, errors)
    run.client_cpu = (time.process_time() - cpu) / len(latencies)
    if server_pid:
        run.server_cpu = (cpu_seconds(server_pid) - server) / len(latencies)
    return run


async def in_process(
    tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> Run:
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(make_registry(), pool) as dispatcher:

        async def one(i: int) -> bool:
            result = await dispatcher.call((tool, arguments))
            return result.ok

        return await load(concurrency, total, one, warmup=200)


Caller = Callable[[int], Awaitable[bool]]


@contextlib.asynccontextmanager
async def client_calls(
    url: str, tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> AsyncIterator[Caller]:
    """agent_backend.Client, one per concurrent caller, each with one keep-alive connection."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(Client(url, token=TOKEN, max_connections=1, retries=0))
            for _ in range(concurrency)
        ]
        per_client = max(1, total // concurrency)

        async def one(i: int) -> bool:
            try:
                result = await clients[(i // per_client) % concurrency].call((tool, arguments))
            except AgentBackendError:
                return False
            return result.ok

        yield one


@contextlib.asynccontextmanager
async def plain_calls(
    url: str, tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> AsyncIterator[Caller]:
    """A plain aiohttp ``ClientSession`` doing the Client's per-call work, by hand.

    One session per concurrent caller, each with one keep-alive connection, as
    the ``daemon`` rows: the body serialized with orjson, a fresh
    ``Idempotency-Key``, the answer parsed into a ``ToolResult``.
    """
    headers = {"Authorization": f"Bearer {TOKEN}"}
    target = URL(f"{url}/v1/call")  # parsed once, as Client does
    async with contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(
                aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=1))
            )
            for _ in range(concurrency)
        ]
        per_client = max(1, total // concurrency)

        async def one(i: int) -> bool:
            session = sessions[(i // per_client) % concurrency]
            body = orjson.dumps({"id": f"call_{i}", "name": tool, "arguments": arguments})
            call_headers = {"Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex}
            async with session.post(target, data=body, headers=call_headers) as response:
                answer = await response.read()
                if response.status != 200:
                    return False
            return ToolResult.model_validate_json(answer).ok

        yield one


async def through_daemon(
    url: str, tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> Run:
    async with client_calls(url, tool, arguments, concurrency, total) as one:
        return await load(concurrency, total, one, warmup=200, server_pid=_server_pid())


async def through_aiohttp(
    url: str, tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> Run:
    async with plain_calls(url, tool, arguments, concurrency, total) as one:
        return await load(concurrency, total, one, warmup=200, server_pid=_server_pid())


async def client_vs_plain(
    url: str, concurrency: int, total: int, rounds: int
) -> tuple[list[float], list[Run], list[Run]]:
    """Client and the plain session, both open and warm, in alternating short rounds.

    Short rounds on connections kept open keep the two close in time, so that a
    burst of load from other processes falls on both alike; which goes first
    alternates. Returns the ratio of each round (Client's calls/s over the plain's).
    """
    echo = {"value": "hello"}
    ratios: list[float] = []
    clients: list[Run] = []
    plains: list[Run] = []
    async with (
        client_calls(url, "echo", echo, concurrency, total) as client,
        plain_calls(url, "echo", echo, concurrency, total) as plain,
    ):
        for one in (client, plain):
            for i in range(200):
                await one(i)
        for index in range(rounds):
            pair: list[Run] = []
            for one in (client, plain) if index % 2 == 0 else (plain, client):
                pair.append(await load(concurrency, total, one, warmup=0))
            ours, theirs = pair if index % 2 == 0 else pair[::-1]
            clients.append(ours)
            plains.append(theirs)
            ratios.append(ours.rate / theirs.rate)
    return ratios, clients, plains


async def through_daemon_raw(
    url: str, tool: str, arguments: Mapping[str, object], concurrency: int, total: int
) -> Run:
    """The same calls from a minimal HTTP/1.1 keep-alive client (anyio streams, no library).

    Not one of the issue's figures: it shows how much of the time is the daemon's
    and how much the load generator's.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps({"name": tool, "arguments": arguments})
    request = (
        f"POST /v1/call HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with contextlib.AsyncExitStack() as stack:
        sockets = [
            await stack.enter_async_context(await anyio.connect_tcp(host, int(port)))
            for _ in range(concurrency)
        ]
        buffered = [anyio.streams.buffered.BufferedByteReceiveStream(s) for s in sockets]
        per_client = max(1, total // concurrency)

        async def one(i: int) -> bool:
            index = (i // per_client) % concurrency
            stream = buffered[index]
            await sockets[index].send(request)
            head = await stream.receive_until(b"\r\n\r\n", 65536)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            answer = await stream.receive_exactly(length)
            return head.startswith(b"HTTP/1.1 200") and b'"ok":true' in answer

        return await load(concurrency, total, one, warmup=200, server_pid=_server_pid())


def row(label: str, run: Run) -> str:
    server = f"{run.server_cpu * 1000:>9.3f}" if run.server_cpu else f"{'-':>9}"
    return (
        f"{label:<22} {run.rate:>9,.0f} {run.pct(0.50):>9.3f} {run.pct(0.99):>9.3f}"
        f" {run.errors:>7} {run.client_cpu * 1000:>9.3f} {server}"
    )


async def main(quick: bool) -> int:
    global SERVER
    child, url = start_child()
    SERVER = child
    verdicts: list[tuple[str, bool]] = []
    notes: list[str] = []
    try:
        echo = {"value": "hello"}
        scale = 0.25 if quick else 1.0
        print(f"daemon {url} (child pid {child.pid}); tool: echo (async Python function)")
        print(f"{os.cpu_count()} cores; load average at start: {os.getloadavg()[0]:.2f}")
        print("daemon: agent_backend.Client, one keep-alive connection per concurrent client")
        print("cpu/call: ms of CPU per call in this process (clients; in-process: everything)")
        print("daemon (last column): ms of CPU per call in the daemon's process")
        print(
            f"{'':<22} {'calls/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}"
            f" {'cpu/call':>9} {'daemon':>9}"
        )
        for concurrency in CONCURRENCY:
            total = int((3000 if concurrency == 1 else 12000) * scale)
            local = await in_process("echo", echo, concurrency, total)
            remote = await through_daemon(url, "echo", echo, concurrency, total)
            plain = await through_aiohttp(url, "echo", echo, concurrency, total)
            raw = await through_daemon_raw(url, "echo", echo, concurrency, total)
            print(row(f"in-process  x{concurrency}", local))
            print(row(f"daemon      x{concurrency}", remote))
            print(row(f"  (aiohttp plain x{concurrency})", plain))
            print(row(f"  (raw client x{concurrency})", raw))
            print(
                f"{'':<22} daemon/in-process: {remote.rate / local.rate:.3f}x throughput,"
                f" +{remote.pct(0.5) - local.pct(0.5):.3f} ms p50"
            )
            if concurrency == 1:
                for name, run in (("plain aiohttp session", plain), ("raw client", raw)):
                    notes.append(
                        f"INFO  {name}, 1 client: p50 +{run.pct(0.5) - local.pct(0.5):.3f} ms"
                        " over in-process"
                    )
            if concurrency == 16:
                for name, run in (("plain aiohttp session", plain), ("raw client", raw)):
                    notes.append(
                        f"INFO  {name}, 16 clients: {run.rate:,.0f} calls/s, {run.errors} errors"
                    )
            if concurrency == 1:
                overhead = remote.pct(0.5) - local.pct(0.5)
                verdicts.append(
                    (
                        f"p50 at 1 client within 1 ms of in-process (+{overhead:.3f} ms)",
                        overhead <= 1.0,
                    )
                )
            if concurrency == 16:
                verdicts.append(
                    (
                        f">= 1,500 calls/s at 16 clients, no errors ({remote.rate:,.0f}/s,"
                        f" {remote.errors} errors)",
                        remote.rate >= 1500 and remote.errors == 0,
                    )
                )
        rounds = max(2, int(ROUNDS * scale) // 2 * 2)
        print(
            f"Client vs a plain aiohttp ClientSession doing its per-call work, {rounds}"
            " alternating rounds (ratio: Client's calls/s over the plain session's):"
        )
        for concurrency in COMPARED:
            total = int((200 if concurrency == 1 else 640) * scale)
            ratios, clients, plains = await client_vs_plain(url, concurrency, total, rounds)
            median = statistics.median(ratios)
            cpu = statistics.median(
                c.client_cpu / p.client_cpu for c, p in zip(clients, plains, strict=True)
            )
            print(
                f"  x{concurrency:<3} round ratios: quartiles"
                f" {' '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))},"
                f" min {min(ratios):.3f}, max {max(ratios):.3f}; median {median:.3f}x; Client {statistics.median(c.rate for c in clients):,.0f}"
                f" vs plain {statistics.median(p.rate for p in plains):,.0f} calls/s;"
                f" client CPU per call {cpu:.3f}x the plain session's"
            )
            errors = sum(r.errors for r in clients + plains)
            verdicts.append(
                (
                    f"Client >= {RATIO_BAR}x a plain aiohttp ClientSession's calls/s at"
                    f" {concurrency} client{'s' if concurrency > 1 else ''}"
                    f" (median of {rounds} rounds: {median:.3f}x, {errors} errors)",
                    median >= RATIO_BAR and errors == 0,
                )
            )
        total = int(800 * scale)
        command = {"argv": ["true"]}
        local = await in_process("exec", command, 16, total)
        remote = await through_daemon(url, "exec", command, 16, total)
        print("exec ['true'] (a subprocess per call), 16 clients:")
        print(row("in-process  x16", local))
        print(row("daemon      x16", remote))
    finally:
        child.terminate()
        code = child.wait(timeout=30)
    verdicts.append((f"daemon exited {code} on SIGTERM", code == 0))
    print(f"load average at end: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    for text, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    for note in notes:
        print(note)
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the calls")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        anyio.run(child_main)
    else:
        sys.exit(anyio.run(main, options.quick))
