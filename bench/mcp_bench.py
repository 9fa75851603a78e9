"""``/mcp`` against the MCP SDK's own server, the daemon's ``/v1/call`` and the in-process call.

Run: ``.venv/bin/python bench/mcp_bench.py`` (``--quick`` for a short run).

One trivial tool (``echo``: an async Python function returning its input), four ways:

* **in-process**: ``Dispatcher.call`` in this process;
* **/v1/call**: the daemon (``agent-backend``'s own server code) in a child process;
* **/mcp**: the same daemon's MCP endpoint: an ``initialize`` per connection
  (one MCP session each), then ``tools/call`` after ``tools/call``;
* **SDK server**: the ``mcp`` package's high-level ``MCPServer`` with the same
  tool, its streamable HTTP app with default settings (sessions, SSE
  answers), served by uvicorn on a free 127.0.0.1 port in a child process.

Both MCP servers are driven by the same lean load client: hand-written
HTTP/1.1 over anyio streams, one keep-alive connection and one MCP session
per concurrent client, speaking protocol 2025-06-18 (answers read as JSON or
SSE, whichever the server sends). Each figure is the best of two rounds, the
servers measured alternately so that load from other processes hits both.

Figure to reach (issue 12), printed as PASS/FAIL: ``/mcp`` serves at least as
many calls/s as the SDK's server, at 1 and at 16 clients, with no errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.streams.buffered
import orjson

from agent_backend.daemon import DaemonServer, DaemonSettings
from agent_backend.dispatch import Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolRegistry

TOKEN = "bench-token-" + "m" * 24
CONCURRENCY = (1, 16)
VERSION = "2025-06-18"
VALUE = "hello"


def make_registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool
    async def echo(value: str) -> str:
        """Return the input unchanged.

        Args:
            value: Any text.
        """
        return value

    return registry


# -- the servers, each in a child process -----------------------------------------------------------


async def daemon_main() -> None:
    settings = DaemonSettings(tokens=(TOKEN,), port=0, max_concurrent_per_token=256)
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(make_registry(), pool) as dispatcher:
        server = DaemonServer(dispatcher, settings)
        async with anyio.create_task_group() as group:
            url = await group.start(server.serve)
            print(url, flush=True)


def sdk_main() -> None:
    import uvicorn
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("sdk-bench")

    @server.tool()
    async def echo(value: str) -> str:
        """Return the input unchanged."""
        return value

    # As uvicorn binds host and port itself (asyncio then sets TCP_NODELAY on each
    # connection: it does so only for sockets made with IPPROTO_TCP).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)  # connections wait in the backlog until uvicorn accepts
    port = sock.getsockname()[1]
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning")
    print(f"http://127.0.0.1:{port}", flush=True)
    uvicorn.Server(config).run(sockets=[sock])


def start_child(kind: str) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    url = child.stdout.readline().strip()
    if not url.startswith("http://"):
        child.kill()
        raise SystemExit(f"the {kind} server did not start")
    return child, url


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the lean load client ---------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection: POST a body, read the answer (length or chunked)."""

    def __init__(self, stream: anyio.abc.SocketStream, host: str) -> None:
        self.stream = stream
        self.reader = anyio.streams.buffered.BufferedByteReceiveStream(stream)
        self.host = host

    async def post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        await self.stream.send(head.encode() + b"\r\n" + body)
        raw = await self.reader.receive_until(b"\r\n\r\n", 65536)
        lines = raw.split(b"\r\n")
        status = int(lines[0].split()[1])
        fields: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        if b"content-length" in fields:
            content = await self.reader.receive_exactly(int(fields[b"content-length"]))
        elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            chunks = []
            while True:
                size = int((await self.reader.receive_until(b"\r\n", 1024)).split(b";")[0], 16)
                chunk = await self.reader.receive_exactly(size + 2)
                if size == 0:
                    break
                chunks.append(chunk[:-2])
            content = b"".join(chunks)
        else:
            content = b""
        return status, fields, content


def json_rpc_answer(fields: dict[bytes, bytes], content: bytes) -> Any:
    """The JSON-RPC message of an answer, sent as JSON or as SSE events."""
    if fields.get(b"content-type", b"").startswith(b"text/event-stream"):
        for line in content.splitlines():
            if line.startswith(b"data:") and line[5:].strip():
                message = orjson.loads(line[5:])
                if "result" in message or "error" in message:
                    return message
        return None
    return orjson.loads(content)


class McpClient:
    """One MCP session over one connection, as a bare client makes it."""

    def __init__(self, connection: Connection, auth: dict[str, str]) -> None:
        self.connection = connection
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **auth,
        }
        self.ids = 0

    async def initialize(self) -> None:
        init = {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": VERSION,
                "capabilities": {},
                "clientInfo": {"name": "mcp-bench", "version": "1"},
            },
        }
        status, fields, content = await self.connection.post(
            "/mcp", orjson.dumps(init), self.headers
        )
        answer = json_rpc_answer(fields, content)
        if status != 200 or answer is None or "result" not in answer:
            raise SystemExit(f"initialize failed: {status} {content[:300]!r}")
        if b"mcp-session-id" in fields:
            self.headers["Mcp-Session-Id"] = fields[b"mcp-session-id"].decode()
        self.headers["MCP-Protocol-Version"] = VERSION
        note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
        status, _, _ = await self.connection.post("/mcp", note, self.headers)
        if status != 202:
            raise SystemExit(f"notifications/initialized: {status}")

    async def echo(self) -> bool:
        self.ids += 1
        body = orjson.dumps(
            {
                "jsonrpc": "2.0",
                "id": self.ids,
                "method": "tools/call",
                "params": {"name": "echo", "arguments": {"value": VALUE}},
            }
        )
        status, fields, content = await self.connection.post("/mcp", body, self.headers)
        answer = json_rpc_answer(fields, content)
        if status != 200 or answer is None or "result" not in answer:
            return False
        result = answer["result"]
        return not result.get("isError") and result["content"][0]["text"] == VALUE


# -- measuring --------------------------------------------------------------------------------------


class Run:
    def __init__(self, latencies: list[float], wall: float, errors: int, server_cpu: float) -> None:
        self.latencies = sorted(latencies)
        self.wall = wall
        self.errors = errors
        self.server_cpu = server_cpu
        """The server process's CPU seconds per call (0 in-process)."""

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall

    def pct(self, q: float) -> float:
        return self.latencies[min(len(self.latencies) - 1, int(q * len(self.latencies)))] * 1000


async def load(
    calls: list[Callable[[], Awaitable[bool]]], per_client: int, server_pid: int | None
) -> Run:
    for one in calls:  # warm up every connection
        for _ in range(20):
            await one()
    latencies: list[float] = []
    errors = 0

    async def client(one: Callable[[], Awaitable[bool]]) -> None:
        nonlocal errors
        for _ in range(per_client):
            started = time.perf_counter()
            ok = await one()
            latencies.append(time.perf_counter() - started)
            errors += not ok

    server = cpu_seconds(server_pid) if server_pid else 0.0
    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for one in calls:
            group.start_soon(client, one)
    wall = time.perf_counter() - started
    cpu = (cpu_seconds(server_pid) - server) / len(latencies) if server_pid else 0.0
    return Run(latencies, wall, errors, cpu)


async def mcp_run(url: str, pid: int, concurrency: int, total: int, auth: dict[str, str]) -> Run:
    host = url.removeprefix("http://")
    name, port = host.rsplit(":", 1)
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(concurrency):
            stream = await stack.enter_async_context(await anyio.connect_tcp(name, int(port)))
            client = McpClient(Connection(stream, host), auth)
            await client.initialize()
            clients.append(client)
        return await load([c.echo for c in clients], total // concurrency, pid)


async def v1_run(url: str, pid: int, concurrency: int, total: int) -> Run:
    host = url.removeprefix("http://")
    name, port = host.rsplit(":", 1)
    body = orjson.dumps({"name": "echo", "arguments": {"value": VALUE}})
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with contextlib.AsyncExitStack() as stack:
        connections = [
            Connection(
                await stack.enter_async_context(await anyio.connect_tcp(name, int(port))), host
            )
            for _ in range(concurrency)
        ]

        def caller(connection: Connection) -> Callable[[], Awaitable[bool]]:
            async def one() -> bool:
                status, _, content = await connection.post("/v1/call", body, headers)
                return status == 200 and bool(orjson.loads(content)["ok"])

            return one

        return await load([caller(c) for c in connections], total // concurrency, pid)


async def in_process_run(concurrency: int, total: int) -> Run:
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(make_registry(), pool) as dispatcher:

        async def one() -> bool:
            return (await dispatcher.call(("echo", {"value": VALUE}))).ok

        return await load([one] * concurrency, total // concurrency, None)


def row(label: str, run: Run) -> str:
    server = f"{run.server_cpu * 1000:>9.3f}" if run.server_cpu else f"{'-':>9}"
    return (
        f"{label:<24} {run.rate:>9,.0f} {run.pct(0.50):>9.3f} {run.pct(0.99):>9.3f}"
        f" {run.errors:>7} {server}"
    )


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda run: run.rate)


async def main(quick: bool) -> int:
    daemon, daemon_url = start_child("daemon")
    sdk, sdk_url = start_child("sdk")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    verdicts: list[tuple[str, bool]] = []
    try:
        from importlib.metadata import version

        print(f"daemon {daemon_url} (pid {daemon.pid}); MCP SDK server {sdk_url} (pid {sdk.pid})")
        print(f"mcp {version('mcp')} (MCPServer.streamable_http_app(), default settings)")
        print(f"{os.cpu_count()} cores; load average at start: {os.getloadavg()[0]:.2f}")
        print("tool: echo (async Python function); each figure the best of 2 rounds")
        print("server cpu: ms of CPU per call in the server's process")
        print(
            f"{'':<24} {'calls/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7} {'server cpu':>9}"
        )
        scale = 0.25 if quick else 1.0
        for concurrency in CONCURRENCY:
            total = int((2000 if concurrency == 1 else 8000) * scale)
            runs: dict[str, list[Run]] = {"sdk": [], "mcp": [], "v1": [], "local": []}
            for _ in range(2):
                runs["sdk"].append(await mcp_run(sdk_url, sdk.pid, concurrency, total, {}))
                runs["mcp"].append(await mcp_run(daemon_url, daemon.pid, concurrency, total, auth))
                runs["v1"].append(await v1_run(daemon_url, daemon.pid, concurrency, total))
                runs["local"].append(await in_process_run(concurrency, total))
            sdk_run, mcp_r, v1, local = (best(runs[k]) for k in ("sdk", "mcp", "v1", "local"))
            print(row(f"SDK server     x{concurrency}", sdk_run))
            print(row(f"/mcp           x{concurrency}", mcp_r))
            print(row(f"/v1/call       x{concurrency}", v1))
            print(row(f"in-process     x{concurrency}", local))
            print(
                f"{'':<24} /mcp / SDK server {mcp_r.rate / sdk_run.rate:.2f}x,"
                f" /mcp / /v1 {mcp_r.rate / v1.rate:.2f}x,"
                f" /mcp / in-process {mcp_r.rate / local.rate:.2f}x"
            )
            errors = sum(run.errors for run in runs["mcp"] + runs["sdk"])
            verdicts.append(
                (
                    f"/mcp >= SDK server at {concurrency} client(s): {mcp_r.rate:,.0f} vs"
                    f" {sdk_run.rate:,.0f} calls/s ({mcp_r.rate / sdk_run.rate:.2f}x),"
                    f" {errors} errors",
                    mcp_r.rate >= sdk_run.rate and errors == 0,
                )
            )
    finally:
        for child in (daemon, sdk):
            child.terminate()
        codes = [child.wait(timeout=30) for child in (daemon, sdk)]
    verdicts.append((f"daemon exited {codes[0]} on SIGTERM", codes[0] == 0))
    print(f"load average at end: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    for text, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the calls")
    parser.add_argument("--child", choices=("daemon", "sdk"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child == "daemon":
        anyio.run(daemon_main)
    elif options.child == "sdk":
        sdk_main()
    else:
        sys.exit(anyio.run(main, options.quick))
