"""Benchmark of the SSH pool over 8 separate hosts against raw asyncssh, printed as ratios.

    .venv/bin/python bench/ssh_fleet_bench.py [--rounds N] [--quick] [--callers 1,64,1024] [--hosts 8]

Needs root: it builds its own fleet (``tests/support/netns.py``: one network
namespace per host on a private bridge, each with its own OpenSSH sshd, host
keys verified) and measures ``true`` run remotely at 1, 64 and 1,024
concurrent callers, interleaved round by round so that machine noise hits
every arrangement alike:

* ``pool``: ``backend.pick_host().run(Command(argv=("true",)))`` on an
  ``SSHBackend`` over the hosts, default settings (least-loaded placement, up
  to 8 connections x 8 channels per host);
* ``raw-Kx8``: hand-built with asyncssh: K kept connections per host, at most 8
  channels each, least-loaded over every connection of every host, refused
  channel opens retried; the best of them is the baseline.

Then 1,024 concurrent dispatcher sessions (``Dispatcher.session()``: make a
workspace, run one command, remove the workspace) over the same hosts.

Prints p50/p99 latency and calls/s per arrangement and caller count, then the
figures with PASS/FAIL (throughput ratios are medians of per-round ratios):

* pool / best raw, calls/s at 1,024 callers, target >= 0.90x (and at 64, info);
* pool errors at 1,024 callers, target 0;
* 1,024 concurrent sessions over the hosts, errors, target 0.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import asyncssh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from ssh_bench import CHANNELS, TRUE, Arrangement, RawConnections, Tally, measure  # noqa: E402
from support.netns import Fleet, fleet_missing_reason  # noqa: E402
from support.sshd import generate_keys  # noqa: E402

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig  # noqa: E402
from agent_backend.dispatch import Dispatcher, builtin_tools  # noqa: E402
from agent_backend.tools import ToolRegistry  # noqa: E402


async def run_bench(args: argparse.Namespace) -> int:
    reason = fleet_missing_reason()
    if reason is not None:
        print(f"cannot run: {reason}")
        return 2
    levels = [int(x) for x in args.callers.split(",")]
    with tempfile.TemporaryDirectory(prefix="ssh-fleet-bench-") as tmp:
        directory = Path(tmp)
        keys = await anyio.to_thread.run_sync(generate_keys, directory / "keys")
        fleet = Fleet(directory / "fleet", keys, hosts=args.hosts)
        await anyio.to_thread.run_sync(fleet.start)
        try:
            return await bench_against(fleet, levels, args.rounds, 0.5 if args.quick else 1.0)
        finally:
            await anyio.to_thread.run_sync(fleet.close)


async def bench_against(fleet: Fleet, levels: list[int], rounds: int, scale: float) -> int:
    server = fleet.hosts[0].server
    client_keys = asyncssh.load_keypairs([str(server.keys.client_key)])
    ciphers = "^" + ",".join(SSHHostConfig(host="x").preferred_ciphers)

    async def connect(index: int) -> asyncssh.SSHClientConnection:
        host = fleet.hosts[index].server
        return await asyncssh.connect(
            host.address,
            host.port,
            username=host.user,
            known_hosts=asyncssh.read_known_hosts(str(host.known_hosts)),
            client_keys=client_keys,
            agent_path=None,
            config=None,
            preferred_auth="publickey",
            encryption_algs=ciphers,
        )

    config = SSHPoolConfig(
        hosts=tuple(SSHHostConfig(**h.server.client_options()) for h in fleet.hosts)
    )
    first = config.hosts[0]
    print(
        f"{len(fleet.hosts)} hosts ({fleet.subnet}, one network namespace and sshd each);"
        f" pool: {first.max_connections} connections x {first.max_channels_per_connection}"
        f" channels per host; rounds: {rounds}"
    )
    failed = 0

    def figure(label: str, value: float, target: str, ok: bool) -> None:
        nonlocal failed
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {label:<62} {value:>8.2f}   target {target}")

    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(SSHBackend.from_config(config))

        async def pool_call() -> None:
            result = await backend.pick_host().run(TRUE)
            if result.exit_status != 0:
                raise RuntimeError(f"exit status {result.exit_status}: {result.stderr.text()}")

        raws: list[Arrangement] = []
        for per_host in (1, 2, 4):
            conns = []
            for _ in range(per_host):
                for index in range(len(fleet.hosts)):
                    conn = await connect(index)
                    stack.push_async_callback(conn.wait_closed)
                    stack.callback(conn.close)
                    conns.append(conn)
            raw = RawConnections(conns, CHANNELS, retry=True)
            raws.append(Arrangement(f"raw-{per_host}x{CHANNELS}", raw.call, lambda c: c))
        pool = Arrangement("pool", pool_call, lambda c: c)

        def calls_for(callers: int) -> int:
            return max(callers, int({1: 100, 64: 1024}.get(callers, 2 * callers) * scale))

        # Warm up: every arrangement once at the widest level (connections opened, caches hot).
        for arrangement in (pool, *raws):
            await measure(arrangement, max(levels), max(levels), Tally())

        results: dict[tuple[str, int], Tally] = {}
        arrangements = [pool, *raws]
        for callers in levels:
            for round_index in range(rounds):
                shift = round_index % len(arrangements)
                for arrangement in arrangements[shift:] + arrangements[:shift]:
                    tally = results.setdefault((arrangement.name, callers), Tally())
                    await measure(arrangement, callers, calls_for(callers), tally)

        print()
        print(
            f"{'arrangement':<12} {'callers':>7} {'calls':>6} {'errors':>6} {'p50 ms':>8}"
            f" {'p99 ms':>8} {'calls/s':>9}"
        )
        for (name, callers), tally in results.items():
            print(
                f"{name:<12} {callers:>7} {tally.calls:>6} {tally.errors:>6}"
                f" {tally.percentile(0.5):>8.2f} {tally.percentile(0.99):>8.2f} {tally.rate:>9.1f}"
            )
            if tally.errors:
                print(f"{'':<12} first error: {tally.first_error}")
        print()
        for host in backend.hosts:
            print(repr(host))
        print()

        for callers in levels:
            raw_rates = {
                a.name: results[(a.name, callers)].rate
                for a in raws
                if (a.name, callers) in results
            }
            best = max(raw_rates, key=raw_rates.__getitem__)
            pool_rounds = results[("pool", callers)].round_rates
            best_rounds = results[(best, callers)].round_rates
            ratio = statistics.median(p / b for p, b in zip(pool_rounds, best_rounds, strict=True))
            label = f"pool / best raw ({best}), calls/s at {callers} callers (median)"
            if callers == max(levels):
                figure(label, ratio, ">= 0.90x", ratio >= 0.90)
            else:
                print(f"info  {label:<62} {ratio:>8.2f}")
        wide = max(levels)
        errors = results[("pool", wide)].errors
        figure(f"pool errors at {wide} callers", errors, "0", errors == 0)

        sessions_errors, took = await sessions(backend, 1024)
        print(f"info  1024 concurrent sessions over {len(fleet.hosts)} hosts took {took:.1f} s")
        figure(
            f"errors of 1024 concurrent sessions over {len(fleet.hosts)} hosts",
            sessions_errors,
            "0",
            sessions_errors == 0,
        )
    return 1 if failed else 0


async def sessions(backend: SSHBackend, count: int) -> tuple[int, float]:
    """``count`` concurrent dispatcher sessions, each running one command; (errors, seconds)."""
    errors: list[BaseException] = []
    first: list[Any] = []
    async with Dispatcher(ToolRegistry(builtin_tools()), backend) as dispatcher:

        async def episode(index: int) -> None:
            try:
                async with dispatcher.session() as session:
                    result = await session.call(("exec", {"command": f"echo {index}"}))
                    if result.output != f"{index}\n":
                        raise RuntimeError(f"session {index} printed {result.output!r}")
            except Exception as exc:
                errors.append(exc)
                first.append(exc)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index in range(count):
                tg.start_soon(episode, index)
        took = time.perf_counter() - started
    if first:
        print(f"info  first session error: {type(first[0]).__name__}: {first[0]}")
    return len(errors), took


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per caller count")
    parser.add_argument("--quick", action="store_true", help="half the calls per round")
    parser.add_argument("--callers", default="1,64,1024", help="comma-separated caller counts")
    parser.add_argument("--hosts", type=int, default=8, help="separate hosts in the fleet")
    args = parser.parse_args()
    return anyio.run(run_bench, args)


if __name__ == "__main__":
    sys.exit(main())
