"""Benchmark of the SSH pool against raw asyncssh, on one sshd on loopback, printed as ratios.

    .venv/bin/python bench/ssh_bench.py [--rounds N] [--quick] [--callers 1,8,64] [--target pool]

Starts its own OpenSSH sshd on 127.0.0.1 (``tests/support/sshd.py``: temp keys,
verified host key) and measures ``true`` run remotely, at 1, 8 and 64
concurrent callers, interleaved round by round so that machine noise hits
every arrangement alike:

* ``pool``: ``SSHHost.run(Command(argv=("true",)))`` on an ``SSHBackend`` with
  default settings (8 connections x 8 channels at most);
* ``raw-kept``: asyncssh ``conn.run("true")`` on one kept connection (at most 8
  channels at once, below sshd's MaxSessions of 10; no retry);
* ``raw-NxC``: arrangements built by hand for 64 callers: N kept connections,
  least-loaded, C channels each, refused channel opens retried; the best of
  them is the baseline for the pool's throughput;
* ``new-conn``: a new asyncssh connection per call (``connect`` + ``run`` + close).

Raw arrangements use the pool's default cipher preference (AES-GCM first), so
only the pooling differs. Throughput counts successful calls. Every call's remote cost is the login shell starting and running the
``true`` builtin (the sshd sets ``SHLVL`` so bash skips ``~/.bashrc``), so the
figures are dominated by the SSH round trips and the client, which is what is
being compared. ``--target dispatcher`` is reserved for measuring the same
through ``Dispatcher.call`` once it exists.

Prints p50/p99 latency and calls/s per arrangement and caller count, then the
figures with PASS/FAIL (at 1 caller the arrangements alternate call by call, so
that each latency comparison is paired; at 8 and 64 they alternate round by round,
and the throughput figure is the median of per-round ratios):

* pool / raw-kept per call at 1 caller (p50), target <= 1.10x;
* new-conn / pool per call at 1 caller (p50), target >= 20x;
* pool throughput at 64 callers / the best raw arrangement, target >= 0.90x;
* pool errors at 64 callers, target 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pwd
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import asyncssh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.sshd import SSHServer, generate_keys, sshd_missing_reason  # noqa: E402

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig  # noqa: E402
from agent_backend.dispatch.backend import Command  # noqa: E402

CHANNELS = 8  # per connection, below sshd's MaxSessions (10)
TRUE = Command(argv=("true",), timeout=30)


@dataclasses.dataclass
class Arrangement:
    name: str
    call: Callable[[], Awaitable[None]]
    calls_per_round: Callable[[int], int]
    """Calls per round at a given number of callers."""


@dataclasses.dataclass
class Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: int = 0
    calls: int = 0
    wall: float = 0.0
    first_error: str = ""
    round_rates: list[float] = dataclasses.field(default_factory=list)
    """Successful calls per second in each round (rounds of all arrangements alternate)."""

    @property
    def rate(self) -> float:
        """Successful calls per second (a fast failure is not throughput)."""
        return len(self.latencies) / self.wall if self.wall else 0.0

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def measure_alternating(
    arrangements: list[Arrangement], rounds: int, tallies: list[Tally]
) -> None:
    """One caller: one call of each arrangement in turn, so that each pair of calls sees
    the same machine (the per-call ratios are paired, not minutes apart)."""
    counts = [a.calls_per_round(1) * rounds for a in arrangements]
    steps = max(counts)
    every = [max(1, steps // count) for count in counts]
    for i in range(steps):
        for arrangement, tally, step in zip(arrangements, tallies, every, strict=True):
            if i % step:
                continue
            started = time.perf_counter()
            try:
                await arrangement.call()
            except Exception as exc:
                tally.errors += 1
                tally.first_error = tally.first_error or f"{type(exc).__name__}: {exc}"
            else:
                elapsed = time.perf_counter() - started
                tally.latencies.append(elapsed)
                tally.wall += elapsed
            tally.calls += 1


async def measure(arrangement: Arrangement, callers: int, calls: int, tally: Tally) -> None:
    remaining = calls

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                await arrangement.call()
            except Exception as exc:
                tally.errors += 1
                tally.first_error = tally.first_error or f"{type(exc).__name__}: {exc}"
            else:
                tally.latencies.append(time.perf_counter() - started)
            tally.calls += 1

    done_before = len(tally.latencies)
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(worker)
    wall = time.perf_counter() - started
    tally.wall += wall
    tally.round_rates.append((len(tally.latencies) - done_before) / wall)


class RawConnections:
    """Hand-built pooling: N kept connections, least-loaded, at most C channels each.

    With ``retry``, a channel sshd refuses (it frees sessions lazily) is retried
    after a short pause, as any hand-built pool for 64 callers has to.
    """

    def __init__(
        self, conns: list[asyncssh.SSHClientConnection], channels: int, *, retry: bool
    ) -> None:
        self.conns = conns
        self.retry = retry
        self.load = [0] * len(conns)
        self.free = [anyio.Semaphore(channels) for _ in conns]

    async def call(self) -> None:
        index = min(range(len(self.conns)), key=self.load.__getitem__)
        self.load[index] += 1
        try:
            async with self.free[index]:
                for attempt in range(10 if self.retry else 1):
                    try:
                        result = await self.conns[index].run("true")
                        break
                    except asyncssh.ChannelOpenError:
                        if not self.retry or attempt == 9:
                            raise
                        await anyio.sleep(0.005 * (attempt + 1))
        finally:
            self.load[index] -= 1
        if result.exit_status != 0:
            raise RuntimeError(f"exit status {result.exit_status}")


async def run_bench(args: argparse.Namespace) -> int:
    reason = sshd_missing_reason()
    if reason is not None:
        print(f"cannot run: {reason}")
        return 2
    if args.target != "pool":
        print(f"--target {args.target}: not available yet (only 'pool' is implemented)")
        return 2
    levels = [int(x) for x in args.callers.split(",")]
    scale = 0.5 if args.quick else 1.0
    with tempfile.TemporaryDirectory(prefix="ssh-bench-") as tmp:
        directory = Path(tmp)
        keys = await anyio.to_thread.run_sync(generate_keys, directory / "keys")
        # A high MaxStartups so that new-conn is measured, not sshd's drop policy.
        server = SSHServer(directory / "sshd", keys, user=args.user, max_startups="300:30:600")
        await anyio.to_thread.run_sync(server.start)
        try:
            return await bench_against(server, levels, args.rounds, scale)
        finally:
            await anyio.to_thread.run_sync(server.kill)


async def bench_against(server: SSHServer, levels: list[int], rounds: int, scale: float) -> int:
    known_hosts = asyncssh.read_known_hosts(str(server.known_hosts))
    client_keys = asyncssh.load_keypairs([str(server.keys.client_key)])
    options: dict[str, Any] = {
        "username": server.user,
        "known_hosts": known_hosts,
        "client_keys": client_keys,
        "agent_path": None,
        "config": None,
        "preferred_auth": "publickey",
        # The same cipher preference as the pool's default: a hand-built arrangement would pick it.
        "encryption_algs": "^" + ",".join(SSHHostConfig(host="x").preferred_ciphers),
    }

    async def connect() -> asyncssh.SSHClientConnection:
        return await asyncssh.connect("127.0.0.1", server.port, **options)

    config = SSHPoolConfig(hosts=(SSHHostConfig(**server.client_options()),))
    shell = pwd.getpwnam(server.user).pw_shell
    print(
        f"sshd {server.user}@127.0.0.1:{server.port} (login shell {shell}); pool: {config.hosts[0].max_connections} connections"
        f" x {config.hosts[0].max_channels_per_connection} channels; rounds: {rounds}"
    )

    async with contextlib.AsyncExitStack() as stack:
        backend = await stack.enter_async_context(SSHBackend.from_config(config))
        host = backend.hosts[0]

        async def pool_call() -> None:
            result = await host.run(TRUE)
            if result.exit_status != 0:
                raise RuntimeError(f"exit status {result.exit_status}: {result.stderr.text()}")

        async def new_conn_call() -> None:
            async with await connect() as conn:
                result = await conn.run("true")
            if result.exit_status != 0:
                raise RuntimeError(f"exit status {result.exit_status}")

        raw_sets: dict[int, RawConnections] = {}
        for count in (1, 2, 4, 8):
            conns = [await connect() for _ in range(count)]
            for conn in conns:
                stack.push_async_callback(conn.wait_closed)
                stack.callback(conn.close)
            raw_sets[count] = RawConnections(conns, CHANNELS, retry=count > 1)

        def per_round(one: int, eight: int, many: int) -> Callable[[int], int]:
            def calls(callers: int) -> int:
                base = one if callers == 1 else eight if callers <= 8 else many
                return max(callers, int(base * scale))

            return calls

        pool = Arrangement("pool", pool_call, per_round(60, 240, 640))
        raw_kept = Arrangement("raw-kept", raw_sets[1].call, per_round(60, 240, 640))
        new_conn = Arrangement("new-conn", new_conn_call, per_round(4, 16, 64))
        raws = [
            Arrangement(f"raw-{n}x{CHANNELS}", raw_sets[n].call, per_round(60, 240, 640))
            for n in (2, 4, 8)
        ]

        # Warm up: every arrangement once at the widest level (connections opened, caches hot).
        for arrangement in (pool, raw_kept, *raws):
            await measure(arrangement, max(levels), max(levels), Tally())

        results: dict[tuple[str, int], Tally] = {}
        for callers in levels:
            arrangements = [pool, raw_kept, new_conn] + (raws if callers > CHANNELS else [])
            if callers == 1:
                tallies = [results.setdefault((a.name, 1), Tally()) for a in arrangements]
                await measure_alternating(arrangements, rounds, tallies)
                continue
            for round_index in range(rounds):
                shift = round_index % len(arrangements)
                for arrangement in arrangements[shift:] + arrangements[:shift]:
                    tally = results.setdefault((arrangement.name, callers), Tally())
                    await measure(arrangement, callers, arrangement.calls_per_round(callers), tally)

        print()
        print(
            f"{'arrangement':<12} {'callers':>7} {'calls':>6} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'calls/s':>9}"
        )
        for (name, callers), tally in results.items():
            print(
                f"{name:<12} {callers:>7} {tally.calls:>6} {tally.errors:>6} {tally.percentile(0.5):>8.2f}"
                f" {tally.percentile(0.99):>8.2f} {tally.rate:>9.1f}"
            )
            if tally.errors:
                print(f"{'':<12} first error: {tally.first_error}")
        print()
        print(repr(host))
        stats = host.statistics()
        print(
            f"pool: {stats.handshakes} handshakes, {stats.handshake_failures} failed,"
            f" {stats.channel_refusals} channel refusals, {stats.connections_lost} lost"
        )
        print()
        return report(results, levels)


def report(results: dict[tuple[str, int], Tally], levels: list[int]) -> int:
    failed = 0

    def figure(label: str, value: float, target: str, ok: bool) -> None:
        nonlocal failed
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {label:<58} {value:>8.2f}   target {target}")

    if 1 in levels:
        pool1 = results[("pool", 1)].percentile(0.5)
        raw1 = results[("raw-kept", 1)].percentile(0.5)
        new1 = results[("new-conn", 1)].percentile(0.5)
        figure(
            "pool / raw-kept, per call at 1 caller (p50)",
            pool1 / raw1,
            "<= 1.10x",
            pool1 / raw1 <= 1.10,
        )
        figure(
            "new-conn / pool, per call at 1 caller (p50)",
            new1 / pool1,
            ">= 20x",
            new1 / pool1 >= 20,
        )
    wide = max(levels)
    if wide > CHANNELS:
        raw_rates = {
            name: t.rate
            for (name, callers), t in results.items()
            if callers == wide and name.startswith("raw")
        }
        best = max(raw_rates, key=raw_rates.__getitem__)
        # Paired by round (the same minutes of a shared, noisy machine), median over rounds.
        pool_rounds = results[("pool", wide)].round_rates
        best_rounds = results[(best, wide)].round_rates
        ratio = statistics.median(p / b for p, b in zip(pool_rounds, best_rounds, strict=True))
        figure(
            f"pool / best raw ({best}), calls/s at {wide} callers (median)",
            ratio,
            ">= 0.90x",
            ratio >= 0.90,
        )
        print(
            f"info  pool / {best}, calls/s at {wide} callers over all rounds:"
            f" {results[('pool', wide)].rate / raw_rates[best]:.2f}x"
        )
        errors = results[("pool", wide)].errors
        figure(f"pool errors at {wide} callers", errors, "0", errors == 0)
    for callers in levels:
        if callers == 1:
            continue
        pool_rate = results[("pool", callers)].rate
        raw_rate = results[("raw-kept", callers)].rate
        print(f"info  pool / raw-kept, calls/s at {callers} callers: {pool_rate / raw_rate:.2f}x")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds per caller count")
    parser.add_argument("--quick", action="store_true", help="half the calls per round")
    parser.add_argument("--callers", default="1,8,64", help="comma-separated caller counts")
    parser.add_argument(
        "--user",
        default=None,
        help="remote user (default: the current one); one whose login shell is /bin/sh"
        " (dash) makes each command cheaper, so the pool's own cost shows more",
    )
    parser.add_argument(
        "--target", default="pool", choices=["pool", "dispatcher"], help="what 'pool' measures"
    )
    args = parser.parse_args()
    return anyio.run(run_bench, args)


if __name__ == "__main__":
    sys.exit(main())
