"""Spawning commands: ``echo hi`` by the local backend and through the daemon, against the machine and the peers.

Run: ``.venv/bin/python bench/exec_bench.py`` (``--quick`` for a short run).

Every figure is measured in the same run, in interleaved rounds (the order
rotates each round), so that load from other processes on this machine falls
on all alike; each ratio is the median of the per-round ratios.

In this process:

* **raw posix_spawn**: a plain ``os.posix_spawn`` loop with a pipe, one call
  after the other (one core): what the machine can spawn. The child gets the
  same environment as the backend's children (the default pool's
  ``env_passthrough``): with ``LANG`` set, ``echo`` loads a locale, which
  costs it a third more CPU, so any other environment would not be the same
  work;
* **asyncio subprocess**: ``asyncio.create_subprocess_exec`` + ``communicate``
  at 16 concurrent callers, as a typical Python tool server spawns;
* **LocalHost.run**: the local backend's exec (``Command(argv=("echo", "hi"))``)
  at 16 concurrent callers. Target: at least 0.8x the raw loop.

Servers, each in a child process on a free 127.0.0.1 port, driven by the same
lean HTTP/1.1 client (``mcp_bench.py``'s) with 16 keep-alive connections:

* **daemon**: ``agent-backend``'s server on the default (local) pool, its
  ``exec`` tool, ``POST /v1/call``;
* **MCP SDK server**: the ``mcp`` package's ``MCPServer`` (streamable HTTP,
  default settings, uvicorn) with a tool running the command the way a
  typical MCP server does (``asyncio.create_subprocess_exec``);
* **SWE-ReX**: ``swerex-remote``'s ``POST /execute`` (install it with
  ``python3 -m venv .bench/swerex && .bench/swerex/bin/pip install swe-rex``).

Target: through the daemon at least 2x every peer's calls/s. The ``cpu/call``
column is the server process's CPU (its children's excluded) per call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import orjson
from mcp_bench import Connection, cpu_seconds, json_rpc_answer

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.daemon import DaemonServer, DaemonSettings
from agent_backend.dispatch import Command, Dispatcher
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolRegistry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEREX = os.path.join(ROOT, ".bench", "swerex", "bin", "swerex-remote")
TOKEN = "bench-token-" + "e" * 24
CLIENTS = 16
ARGV = ("echo", "hi")
OUTPUT = b"hi\n"
LOCAL_BAR = 0.8
SERVER_BAR = 2.0
VERSION = "2025-06-18"


def child_env() -> dict[str, str]:
    """The environment the local backend gives its children (the default pool's)."""
    config = LocalPoolConfig()
    return {k: os.environ[k] for k in config.env_passthrough if k in os.environ}


# -- in this process ---------------------------------------------------------------------------------


def raw_loop(calls: int, program: str, env: dict[str, str]) -> float:
    """The plain posix_spawn loop: spawn, read the pipe to its end, reap; calls/s."""
    argv = list(ARGV)
    started = time.perf_counter()
    for _ in range(calls):
        read, write = os.pipe()
        actions = [
            (os.POSIX_SPAWN_DUP2, write, 1),
            (os.POSIX_SPAWN_CLOSE, read),
            (os.POSIX_SPAWN_CLOSE, write),
        ]
        pid = os.posix_spawn(program, argv, env, file_actions=actions)
        os.close(write)
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
        os.close(read)
        os.waitpid(pid, 0)
        assert data == OUTPUT
    return calls / (time.perf_counter() - started)


async def concurrently(calls: int, one: Callable[[], Awaitable[bool]]) -> tuple[float, int]:
    """``calls`` calls of ``one`` by CLIENTS concurrent callers: calls/s and errors."""
    errors = 0

    async def caller() -> None:
        nonlocal errors
        for _ in range(calls // CLIENTS):
            errors += not await one()

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(CLIENTS):
            group.start_soon(caller)
    return calls // CLIENTS * CLIENTS / (time.perf_counter() - started), errors


async def asyncio_once(env: dict[str, str]) -> bool:
    process = await asyncio.create_subprocess_exec(
        *ARGV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    out, _ = await process.communicate()
    return process.returncode == 0 and out == OUTPUT


async def in_process(rounds: int, calls: int) -> list[tuple[str, bool]]:
    env = child_env()
    program = shutil.which(ARGV[0], path=env.get("PATH"))
    assert program is not None
    command = Command(argv=ARGV, timeout=30)
    rates: dict[str, list[float]] = {"raw": [], "asyncio": [], "backend": []}
    errors = 0
    async with LocalBackend() as backend:

        async def backend_once() -> bool:
            result = await backend.host.run(command)
            return result.exit_status == 0 and result.stdout.data == OUTPUT

        async def measure(name: str) -> None:
            nonlocal errors
            if name == "raw":
                rates[name].append(raw_loop(calls, program, env))
                return
            one = backend_once if name == "backend" else lambda: asyncio_once(env)
            rate, failed = await concurrently(calls, one)
            rates[name].append(rate)
            errors += failed

        for name in rates:  # warm-up
            await measure(name)
            rates[name].clear()
        order = list(rates)
        for index in range(rounds):
            for name in order[index % 3 :] + order[: index % 3]:
                await measure(name)
    print(
        f"in this process, {rounds} rounds of {calls} calls each"
        f" (x{CLIENTS}: {CLIENTS} concurrent callers), median calls/s and ratio to the raw loop:"
    )
    raw = rates["raw"]
    labels = {
        "raw": "raw posix_spawn loop (x1)",
        "asyncio": f"asyncio subprocess (x{CLIENTS})",
        "backend": f"LocalHost.run (x{CLIENTS})",
    }
    for name, label in labels.items():
        ratio = statistics.median(r / b for r, b in zip(rates[name], raw, strict=True))
        print(f"  {label:<30} {statistics.median(rates[name]):>8,.0f}/s  {ratio:.2f}x")
    ratio = statistics.median(r / b for r, b in zip(rates["backend"], raw, strict=True))
    return [
        (
            f"LocalHost.run x{CLIENTS} >= {LOCAL_BAR}x the raw posix_spawn loop"
            f" ({ratio:.2f}x, {errors} errors)",
            ratio >= LOCAL_BAR and errors == 0,
        )
    ]


# -- the servers, each in a child process ------------------------------------------------------------


async def daemon_main() -> None:
    registry = ToolRegistry.from_dir(os.path.join(ROOT, "schemas", "tools"))
    settings = DaemonSettings(tokens=(TOKEN,), port=0, max_concurrent_per_token=256, mcp=False)
    async with load_pool(DEFAULT_POOL) as pool, Dispatcher(registry, pool) as dispatcher:
        server = DaemonServer(dispatcher, settings)
        async with anyio.create_task_group() as group:
            url = await group.start(server.serve)
            print(url, flush=True)


def sdk_main() -> None:
    import logging

    import uvicorn
    from mcp.server.mcpserver import MCPServer

    logging.getLogger("mcp").setLevel(logging.WARNING)  # a line per session otherwise
    server = MCPServer("exec-bench")

    @server.tool()
    async def run(argv: list[str]) -> str:
        """Run a program and return its output."""
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await process.communicate()
        return out.decode() + err.decode()

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def start_swerex(token: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    child = subprocess.Popen(  # noqa: ASYNC220 - returns at once, the server runs on
        [SWEREX, "--host", "127.0.0.1", "--port", str(port), "--auth-token", token],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it answers /is_alive
        with contextlib.suppress(OSError):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(
                    f"GET /is_alive HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {token}\r\n\r\n".encode()
                )
                if (await stream.receive()).startswith(b"HTTP/1.1 200"):
                    return child, f"http://127.0.0.1:{port}"
        if child.poll() is not None:
            break
        await anyio.sleep(0.1)
    child.kill()
    child.wait()
    raise SystemExit("swerex-remote did not start")


Caller = Callable[[], Awaitable[bool]]


@contextlib.asynccontextmanager
async def connections(url: str) -> AsyncIterator[list[Connection]]:
    host = url.removeprefix("http://")
    name, port = host.rsplit(":", 1)
    async with contextlib.AsyncExitStack() as stack:
        yield [
            Connection(
                await stack.enter_async_context(await anyio.connect_tcp(name, int(port))), host
            )
            for _ in range(CLIENTS)
        ]


def daemon_caller(connection: Connection) -> Caller:
    body = orjson.dumps({"name": "exec", "arguments": {"argv": list(ARGV)}})
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    async def one() -> bool:
        status, _, content = await connection.post("/v1/call", body, headers)
        answer = orjson.loads(content)
        return status == 200 and answer["ok"] and answer["output"] == OUTPUT.decode()

    return one


async def sdk_caller(connection: Connection) -> Caller:
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": VERSION,
            "capabilities": {},
            "clientInfo": {"name": "exec-bench", "version": "1"},
        },
    }
    status, fields, content = await connection.post("/mcp", orjson.dumps(init), headers)
    if status != 200 or b"mcp-session-id" not in fields:
        raise SystemExit(f"MCP initialize failed: {status} {content[:300]!r}")
    headers["Mcp-Session-Id"] = fields[b"mcp-session-id"].decode()
    headers["MCP-Protocol-Version"] = VERSION
    note = orjson.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
    await connection.post("/mcp", note, headers)
    ids = 0

    async def one() -> bool:
        nonlocal ids
        ids += 1
        body = {
            "jsonrpc": "2.0",
            "id": ids,
            "method": "tools/call",
            "params": {"name": "run", "arguments": {"argv": list(ARGV)}},
        }
        status, fields, content = await connection.post("/mcp", orjson.dumps(body), headers)
        answer = json_rpc_answer(fields, content)
        if status != 200 or answer is None or "result" not in answer:
            return False
        result = answer["result"]
        return not result.get("isError") and result["content"][0]["text"] == OUTPUT.decode()

    return one


def swerex_caller(connection: Connection, token: str) -> Caller:
    body = orjson.dumps({"command": list(ARGV), "timeout": 30})
    headers = {"X-API-Key": token, "Content-Type": "application/json"}

    async def one() -> bool:
        status, _, content = await connection.post("/execute", body, headers)
        answer = orjson.loads(content)
        return status == 200 and answer["exit_code"] == 0 and answer["stdout"] == OUTPUT.decode()

    return one


async def servers(rounds: int, calls: int) -> list[tuple[str, bool]]:
    token = secrets.token_hex(16)
    children: list[subprocess.Popen[str] | subprocess.Popen[bytes]] = []
    verdicts: list[tuple[str, bool]] = []
    try:
        daemon, daemon_url = start_child("daemon")
        children.append(daemon)
        sdk, sdk_url = start_child("sdk")
        children.append(sdk)
        pids = {"daemon": daemon.pid, "MCP SDK server": sdk.pid}
        urls = {"daemon": daemon_url, "MCP SDK server": sdk_url}
        if os.path.exists(SWEREX):  # noqa: ASYNC240 - once, before any load
            swerex, swerex_url = await start_swerex(token)
            children.append(swerex)
            pids["SWE-ReX /execute"] = swerex.pid
            urls["SWE-ReX /execute"] = swerex_url
        else:
            verdicts.append(
                (f"SWE-ReX is not installed ({SWEREX} is missing): not measured", False)
            )
        rates: dict[str, list[float]] = {name: [] for name in urls}
        cpu: dict[str, list[float]] = {name: [] for name in urls}
        errors: dict[str, int] = dict.fromkeys(urls, 0)

        async def measure(name: str) -> None:
            # Fresh connections (and MCP sessions) each round, made and warmed before the clock
            # starts: uvicorn closes a keep-alive connection idle for 5 s, as while the others run.
            async with connections(urls[name]) as conns:
                if name == "daemon":
                    callers = [daemon_caller(c) for c in conns]
                elif name == "MCP SDK server":
                    callers = [await sdk_caller(c) for c in conns]
                else:
                    callers = [swerex_caller(c, token) for c in conns]
                for one in callers:
                    await one()
                failed = 0

                async def caller(one: Caller) -> None:
                    nonlocal failed
                    for _ in range(calls // CLIENTS):
                        failed += not await one()

                before = cpu_seconds(pids[name])
                started = time.perf_counter()
                async with anyio.create_task_group() as group:
                    for one in callers:
                        group.start_soon(caller, one)
                wall = time.perf_counter() - started
            done = calls // CLIENTS * CLIENTS
            rates[name].append(done / wall)
            cpu[name].append((cpu_seconds(pids[name]) - before) / done)
            errors[name] += failed

        for name in urls:  # warm-up
            await measure(name)
            rates[name].clear()
            cpu[name].clear()
            errors[name] = 0
        order = list(urls)
        for index in range(rounds):
            shift = index % len(order)
            for name in order[shift:] + order[:shift]:
                await measure(name)
        print(
            f"servers, {CLIENTS} keep-alive clients, {rounds} rounds of {calls} calls each;"
            " ratio: the daemon's calls/s over the server's, median of the rounds:"
        )
        print(f"  {'':<22} {'calls/s':>8} {'cpu/call':>9} {'errors':>7} {'daemon/it':>10}")
        for name in rates:
            ratio = statistics.median(
                d / r for d, r in zip(rates["daemon"], rates[name], strict=True)
            )
            print(
                f"  {name:<22} {statistics.median(rates[name]):>8,.0f}"
                f" {statistics.median(cpu[name]) * 1000:>7.3f}ms {errors[name]:>7} {ratio:>9.2f}x"
            )
            if name != "daemon":
                verdicts.append(
                    (
                        f"daemon exec >= {SERVER_BAR}x {name} ({ratio:.2f}x,"
                        f" errors: daemon {errors['daemon']}, {name} {errors[name]})",
                        ratio >= SERVER_BAR and errors["daemon"] == 0 and errors[name] == 0,
                    )
                )
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return verdicts


async def main(quick: bool) -> int:
    scale = 0.25 if quick else 1.0
    print(f"{os.cpu_count()} cores; load average at start: {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join(ARGV)}; children's environment: {sorted(child_env())}")
    verdicts = await in_process(max(3, int(12 * scale)), 320)
    verdicts += await servers(max(3, int(10 * scale)), 320)
    print(f"load average at end: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    for text, ok in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0 if all(ok for _, ok in verdicts) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--child", choices=("daemon", "sdk"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child == "daemon":
        anyio.run(daemon_main)
    elif options.child == "sdk":
        sdk_main()
    else:
        sys.exit(anyio.run(main, options.quick))
