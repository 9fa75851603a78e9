"""The SSH backend over a fleet of real separate hosts: network namespaces, each with its own
sshd and its own link (``tests/support/netns.py``). Placement over hosts, a host whose network
goes away mid-call (packets dropped, not refused) and comes back, loss on a link, and 1,024
concurrent sessions over 8 hosts.

Every call ends within its timeout with a result or an :mod:`agent_backend.errors` type; no
test waits on a sleep for a state, only on the state itself (bounded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.netns import Fleet, NetemMissing, _link_names, remove_stale, require_fleet
from support.ssh_helpers import wait_until
from support.sshd import SSHKeys

from agent_backend.backends.ssh import SSHBackend, SSHHost, SSHHostConfig, SSHPoolConfig
from agent_backend.dispatch import Dispatcher, builtin_tools
from agent_backend.dispatch.backend import Command, CommandResult
from agent_backend.errors import AgentBackendError, BackendUnavailable, WorkerLost
from agent_backend.tools import ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

# Short, so that a partition is found in about a second and every test stays bounded.
FAST: dict[str, Any] = {
    "connect_timeout": 1.0,
    "connect_retries": 0,
    "keepalive_interval": 0.4,
    "keepalive_count_max": 2,
    "down_after_failures": 2,
    "probe_interval": 1.5,
    "retry_backoff": 0.05,
    "retry_backoff_max": 0.2,
    "kill_grace": 0.2,
    "file_op_timeout": 5.0,
}


@pytest.fixture
def fleet_factory(ssh_keys: SSHKeys, tmp_path: Path) -> Iterator[Callable[[int], Fleet]]:
    """``fleet_factory(n)``: n separate hosts; all removed at teardown (asserted)."""
    require_fleet()
    fleets: list[Fleet] = []

    def make(hosts: int) -> Fleet:
        fleet = Fleet(tmp_path / f"fleet-{len(fleets)}", ssh_keys, hosts=hosts)
        fleets.append(fleet)
        fleet.start()
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()
        assert fleet.leftovers() == []


def backend_over(fleet: Fleet, **overrides: Any) -> SSHBackend:
    settings = {**FAST, **overrides}
    close_timeout = settings.pop("close_timeout", 5.0)
    hosts = tuple(SSHHostConfig(**host.server.client_options(**settings)) for host in fleet.hosts)
    return SSHBackend.from_config(SSHPoolConfig(hosts=hosts, close_timeout=close_timeout))


def sleep(seconds: float, *, timeout: float = 10.0) -> Command:
    return Command(argv=("sleep", f"{seconds:g}"), timeout=timeout)


async def run_or_error(host: SSHHost, command: Command) -> CommandResult | AgentBackendError:
    try:
        return await host.run(command)
    except AgentBackendError as exc:
        return exc


# -- the fixture itself -----------------------------------------------------------------------


def test_a_crashed_runs_namespaces_are_removed(ssh_keys: SSHKeys, tmp_path: Path) -> None:
    """A run killed with its fleet up leaves namespaces, links and sshds; the next run's
    remove_stale() removes them (and nothing of a live run)."""
    require_fleet()
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from support.netns import Fleet
        from support.sshd import SSHKeys
        fleet = Fleet(Path({str(tmp_path / "crashed")!r}), SSHKeys(Path({str(ssh_keys.directory)!r})), hosts=2)
        fleet.start()
        print(fleet.prefix, fleet.netns_prefix, *[h.server.pid for h in fleet.hosts], flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            prefix, netns_prefix, *pids = child.stdout.readline().split()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    assert any(name.startswith(prefix) for name in _link_names())
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)  # its sshds outlived it
    removed = remove_stale()
    assert f"{netns_prefix}-0" in removed
    assert f"{netns_prefix}-1" in removed
    assert not any(name.startswith(prefix) for name in _link_names())
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)  # reaped by init: wait for the state, bounded
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


# -- placement ----------------------------------------------------------------------------------


async def test_least_loaded_placement_spreads_calls_over_hosts(
    fleet_factory: Callable[[int], Fleet],
) -> None:
    fleet = fleet_factory(4)
    async with backend_over(fleet) as backend:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(backend.pick_host().run, sleep(0.5))
                    await anyio.lowlevel.checkpoint()
            assert [h.statistics().calls for h in backend.hosts] == [4, 4, 4, 4]
            # Each call ran on its own host: $SSH_CONNECTION names the address it reached.
            seen = [
                (await host.run(Command(shell="echo $SSH_CONNECTION", timeout=5))).stdout.text()
                for host in backend.hosts
            ]
            assert [line.split()[2] for line in seen] == [h.address for h in fleet.hosts]


async def test_a_busier_host_gets_fewer_new_calls(fleet_factory: Callable[[int], Fleet]) -> None:
    fleet = fleet_factory(4)
    async with backend_over(fleet) as backend:
        busy = backend.hosts[0]
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(busy.run, sleep(1.5))
                assert await wait_until(lambda: busy.calls_in_flight() == 6, within=5)
                before = [h.statistics().calls for h in backend.hosts]
                for _ in range(12):
                    tg.start_soon(backend.pick_host().run, sleep(0.3))
                    await anyio.lowlevel.checkpoint()
                placed = [
                    h.statistics().calls - b for h, b in zip(backend.hosts, before, strict=True)
                ]
                # 6, 0, 0, 0 in flight: the 12 go to the three idle hosts, 4 each.
                assert placed == [0, 4, 4, 4]


# -- a host whose network goes away, and comes back ---------------------------------------------


async def test_a_partitioned_host_fails_typed_is_skipped_marked_down_and_probed_back(
    fleet_factory: Callable[[int], Fleet],
) -> None:
    fleet = fleet_factory(4)
    call_timeout = 8.0
    async with (
        backend_over(fleet) as backend,
        Dispatcher(ToolRegistry(builtin_tools()), backend) as dispatcher,
    ):
        lost, *others = backend.hosts
        config = lost.config
        with anyio.fail_after(40):
            # A session on every host: the lost host's first (everything idle: ties go to
            # the first host), the others while it is busy.
            session_lost = await dispatcher.session().__aenter__()
            assert session_lost.host is lost
            results: dict[str, Any] = {}

            async def record(key: str, host: SSHHost, command: Command) -> None:
                results[key] = await run_or_error(host, command)

            async with anyio.create_task_group() as tg:
                tg.start_soon(record, "lost", lost, sleep(30, timeout=call_timeout))
                assert await wait_until(lambda: lost.statistics().channels_open == 1, within=10)
                session_other = await dispatcher.session().__aenter__()
                assert session_other.host is not lost
                for index, host in enumerate(others):
                    tg.start_soon(record, f"other{index}", host, sleep(3, timeout=call_timeout))
                assert await wait_until(
                    lambda: all(h.statistics().channels_open == 1 for h in backend.hosts),
                    within=10,
                )

                fleet.link_down(0)
                cut = time.monotonic()
                # The call on the lost host fails typed, well within its timeout.
                assert await wait_until(lambda: "lost" in results, within=call_timeout)
                failed_after = time.monotonic() - cut
                assert isinstance(results["lost"], WorkerLost), results["lost"]
                assert failed_after < call_timeout
                # Placement skips it from then on, at once (it is suspect, then down).
                assert lost.is_suspect() or not lost.is_up()
                assert all(backend.pick_host() is not lost for _ in range(20))
                # Its session fails typed; a session on another host does not notice.
                with pytest.raises(AgentBackendError):
                    await session_lost.call(("exec", {"command": "true"}))
                ok = await session_other.call(("exec", {"command": "echo fine"}))
                assert ok.output == "fine\n"
                # Marked down after down_after_failures handshakes that time out, with no
                # call needed to find out.
                down_within = (
                    config.keepalive_interval * (config.keepalive_count_max + 1)
                    + config.down_after_failures * (config.connect_timeout + 1.0)
                    + 2 * config.retry_backoff_max
                )
                assert await wait_until(lambda: not lost.is_up(), within=down_within)
                assert time.monotonic() - cut < down_within
                assert backend.capacity() == (3, 4)
                with pytest.raises(BackendUnavailable):
                    await lost.run(Command(argv=("true",), timeout=2))

            # The other hosts' calls were unaffected.
            for index in range(len(others)):
                result = results[f"other{index}"]
                assert isinstance(result, CommandResult), result
                assert result.exit_status == 0, result

            # The link returns: the host is probed back within probe_interval (+ a handshake).
            fleet.link_up(0)
            back = time.monotonic()
            assert await wait_until(
                lambda: lost.is_up(), within=config.probe_interval + config.connect_timeout
            )
            back_after = time.monotonic() - back
            assert back_after <= config.probe_interval + config.connect_timeout
            assert backend.capacity() == (4, 4)
            assert not lost.is_suspect()
            again = await lost.run(Command(argv=("echo", "back"), timeout=5))
            assert again.stdout.text() == "back\n"
            await session_other.__aexit__(None, None, None)
            await session_lost.__aexit__(None, None, None)


async def test_calls_sent_while_the_link_is_down_fail_typed_and_never_hang(
    fleet_factory: Callable[[int], Fleet],
) -> None:
    """Calls placed on the host before anything noticed (no connection yet, link down):
    each ends with an error type within its bound: connect timeout, not a hang."""
    fleet = fleet_factory(2)
    async with backend_over(fleet) as backend:
        host = backend.hosts[0]
        fleet.link_down(0)
        started = time.monotonic()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                outcomes: list[object] = []

                async def one() -> None:
                    outcomes.append(await run_or_error(host, sleep(0.1, timeout=5)))

                for _ in range(5):
                    tg.start_soon(one)
        assert len(outcomes) == 5
        assert all(isinstance(o, BackendUnavailable) for o in outcomes), outcomes
        assert time.monotonic() - started < 5
        assert host.is_suspect() or not host.is_up()
        assert backend.pick_host() is backend.hosts[1]


# -- loss and delay -----------------------------------------------------------------------------


async def test_calls_over_a_lossy_slow_link_finish_or_fail_typed(
    fleet_factory: Callable[[int], Fleet],
) -> None:
    fleet = fleet_factory(2)
    try:
        how = fleet.impair(0, loss_percent=15, delay_ms=30)
    except NetemMissing:
        how = fleet.impair(0, loss_percent=15, rate_kbit=400)  # loss by nft, a slow link by tbf
    assert how
    timeout = 4.0
    async with backend_over(fleet, connect_timeout=2.0) as backend:
        impaired, healthy = backend.hosts
        outcomes: list[tuple[float, object]] = []

        async def one(host: SSHHost, index: int) -> None:
            started = time.monotonic()
            outcome = await run_or_error(
                host, Command(shell=f"echo {index}; head -c 2000 /dev/zero", timeout=timeout)
            )
            outcomes.append((time.monotonic() - started, outcome))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for index in range(24):
                    tg.start_soon(one, impaired, index)
                    tg.start_soon(one, healthy, index)
        assert len(outcomes) == 48
        kinds: Counter[str] = Counter()
        for elapsed, outcome in outcomes:
            assert isinstance(outcome, CommandResult | AgentBackendError), outcome
            kinds[type(outcome).__name__] += 1
            # Bounded: a handshake (with its retries' backoff), the call, the kill sequence.
            assert elapsed < 2.0 + timeout + 3.0, (elapsed, outcome)
        finished = [o for _, o in outcomes if isinstance(o, CommandResult) and o.exit_status == 0]
        assert len(finished) >= 24, kinds  # the healthy host's all did, at least
        fleet.clear(0)


# -- scale --------------------------------------------------------------------------------------


async def test_1024_concurrent_sessions_over_8_hosts(
    fleet_factory: Callable[[int], Fleet],
) -> None:
    fleet = fleet_factory(8)
    # A cold burst's handshakes take seconds on a small machine: not FAST's 1 s.
    async with (
        backend_over(fleet, connect_timeout=5.0, file_op_timeout=30.0) as backend,
        Dispatcher(ToolRegistry(builtin_tools()), backend) as dispatcher,
    ):
        outputs: list[str] = []
        errors: list[BaseException] = []

        async def episode(index: int) -> None:
            try:
                async with dispatcher.session() as session:
                    result = await session.call(("exec", {"command": f"echo {index}"}))
                    outputs.append(result.output)
            except Exception as exc:
                errors.append(exc)

        with anyio.fail_after(50):
            async with anyio.create_task_group() as tg:
                for index in range(1024):
                    tg.start_soon(episode, index)
        assert errors == []
        assert sorted(int(line) for line in outputs) == list(range(1024))
        per_host = [h.statistics() for h in backend.hosts]
        assert all(s.calls > 0 for s in per_host)
        assert sum(s.workspaces for s in per_host) == 0  # every session's removed
        assert all(s.connections_lost == 0 for s in per_host)
