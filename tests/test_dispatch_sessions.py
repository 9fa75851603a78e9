"""Sessions: a private workspace pinned to one host, removed on every way out, file tools
confined to it, idle sessions reaped only when nothing holds them (a call in progress, or any
kind of call at all, is activity), and one failing episode never skips another's cleanup."""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from support.proc_helpers import entries, slow_local_disk, watch_loop
from support.ssh_helpers import no_process_left, processes_matching, wait_until

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.dispatch import Dispatcher, Session, builtin_tools
from agent_backend.errors import PoolClosed, PoolError
from agent_backend.tools import ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "workspaces"


@pytest.fixture
async def pool(root: Path) -> AsyncIterator[LocalBackend]:
    async with LocalBackend(LocalPoolConfig(workspace_root=str(root), kill_grace=0.5)) as backend:
        yield backend


def tools() -> ToolRegistry:
    registry = ToolRegistry(builtin_tools())

    @registry.tool
    def ping() -> str:
        """A Python-function tool."""
        return "pong"

    return registry


def workspaces(root: Path) -> list[str]:
    return [name for name in entries(root) if name.startswith("agent-backend-ws-")]


# -- lifecycle: made on entry, pinned, removed on exit / error / cancellation ------------------


async def test_a_session_pins_host_and_workspace_and_removes_it(
    pool: LocalBackend, root: Path
) -> None:
    async with Dispatcher(tools(), pool) as dispatcher:
        async with dispatcher.session() as session:
            assert session.host is pool.host
            assert await anyio.Path(session.workspace).is_dir()
            assert workspaces(root) == [os.path.basename(session.workspace)]
            pwd = await session.call(("exec", {"command": "pwd; touch made-here"}))
            assert pwd.output == f"{session.workspace}\n"
            assert await anyio.Path(session.workspace, "made-here").exists()
            via_dispatcher = await dispatcher.call(("exec", {"argv": ["pwd"]}), session=session)
            assert via_dispatcher.output == pwd.output
            assert repr(session).startswith(f"<Session {session.id} local:{session.workspace}")
            assert session.id.startswith("s1-")
            assert len(session.id) == len("s1-") + 16
            assert dispatcher.statistics().sessions_open == 1
        assert workspaces(root) == []
        assert session.is_closed()
        with pytest.raises(PoolClosed, match="closed"):
            await session.call(("exec", {"command": "true"}))


async def test_opening_and_closing_a_session_with_a_spare_takes_no_trip_through_the_loop(
    pool: LocalBackend,
) -> None:
    """Every trip an episode's open or close takes waits behind all the loop's ready work:
    beside a busy policy server one such trip cost tens of ms (bench/rollout_vllm_bench.py)."""
    trips = 0

    async def count_trips() -> None:
        nonlocal trips
        while True:
            await anyio.lowlevel.checkpoint()
            trips += 1

    async with Dispatcher(tools(), pool) as dispatcher:
        async with dispatcher.session():
            pass  # the first one: spares are made after it
        assert await wait_until(lambda: len(pool.host.spare_workspaces()) == 1, within=10)
        async with anyio.create_task_group() as group:
            group.start_soon(count_trips)
            await anyio.lowlevel.checkpoint()  # the counter runs
            session = dispatcher.session()
            before = trips
            await session.open()
            opened = trips
            path = session.workspace
            await session.aclose()
            closed = trips
            group.cancel_scope.cancel()
        assert path is not None
        assert not await anyio.Path(path).exists()  # removed, or a spare again (renamed)
        assert (opened - before, closed - opened) == (0, 0)


async def test_sessions_are_isolated(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool) as dispatcher,
        dispatcher.session() as first,
        dispatcher.session() as second,
    ):
        assert first.workspace != second.workspace
        await first.call(("write_file", {"path": "mine.txt", "content": "1"}))
        other = await second.call(("read_file", {"path": "mine.txt"}))
        assert other.error_type == "FileError"


async def test_the_workspace_is_removed_on_error(pool: LocalBackend, root: Path) -> None:
    async def episode(dispatcher: Dispatcher) -> None:
        async with dispatcher.session() as session:
            await session.call(("write_file", {"path": "f", "content": "x"}))
            raise RuntimeError("episode failed")

    async with Dispatcher(tools(), pool) as dispatcher:
        with pytest.raises(RuntimeError, match="episode failed"):
            await episode(dispatcher)
        assert workspaces(root) == []


async def test_the_workspace_is_removed_on_cancellation_mid_call(
    pool: LocalBackend, root: Path
) -> None:
    line = "sleep 61.25 & sleep 61.25"  # a background child too: both must die
    async with Dispatcher(tools(), pool) as dispatcher:
        with anyio.CancelScope() as scope:
            async with dispatcher.session() as session, anyio.create_task_group() as group:
                group.start_soon(session.call, ("exec", {"command": line}))
                running = await wait_until(
                    lambda: len(processes_matching("sleep 61.25")) >= 2, within=30
                )
                assert running, "the command never started"
                scope.cancel()
        assert workspaces(root) == []
        assert session.is_closed()
        assert await no_process_left("sleep 61.25") == []


async def test_cancelled_while_opening_leaks_nothing(pool: LocalBackend, root: Path) -> None:
    async with Dispatcher(tools(), pool) as dispatcher:
        for delay in (0, 0.0001, 0.001, 0.003):
            with anyio.move_on_after(delay):
                async with dispatcher.session():
                    await anyio.sleep(10)
        assert workspaces(root) == []
        assert dispatcher.statistics().sessions_open == 0


async def test_many_failing_episodes_leak_no_workspace(pool: LocalBackend, root: Path) -> None:
    # An error in one episode must neither abort the others nor skip cleanup (leaked sandboxes).
    outcomes: list[str] = []

    async def episode(index: int, dispatcher: Dispatcher) -> None:
        try:
            async with dispatcher.session() as session:
                result = await session.call(("exec", {"command": f"echo {index} > f; cat f"}))
                assert result.output == f"{index}\n"
                if index % 3 == 0:
                    raise ValueError(f"episode {index} failed")
                if index % 3 == 1:
                    with anyio.move_on_after(0.01):
                        await session.call(("exec", {"command": "sleep 5"}))
            outcomes.append("ok")
        except ValueError:
            outcomes.append("failed")

    async with Dispatcher(tools(), pool) as dispatcher, anyio.create_task_group() as group:
        for index in range(30):
            group.start_soon(episode, index, dispatcher)
    assert sorted(outcomes) == ["failed"] * 10 + ["ok"] * 20
    assert workspaces(root) == []
    assert pool.statistics().workspaces == 0


async def test_dispatcher_aclose_closes_sessions_and_ends_their_calls(
    pool: LocalBackend, root: Path
) -> None:
    dispatcher = Dispatcher(tools(), pool)
    errors: list[BaseException] = []
    async with dispatcher:
        session = await dispatcher.session().__aenter__()
        idle = await dispatcher.session().__aenter__()

        async def long_call() -> None:
            try:
                await session.call(("exec", {"command": "sleep 60"}))
            except PoolClosed as exc:
                errors.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(long_call)
            await anyio.sleep(0.2)
            started = time.monotonic()
            await dispatcher.aclose()
            await dispatcher.aclose()  # idempotent
            assert time.monotonic() - started < 3
    assert len(errors) == 1
    assert "dispatcher was closed" in str(errors[0])
    assert session.is_closed()
    assert idle.is_closed()
    assert workspaces(root) == []
    assert pool.host.calls_in_flight() == 0
    await session.aclose()  # already closed: fine
    with pytest.raises(PoolClosed):
        dispatcher.session()


async def test_a_session_of_another_dispatcher_is_refused(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool) as first,
        Dispatcher(tools(), pool) as second,
        first.session() as session,
    ):
        with pytest.raises(PoolError, match="another dispatcher"):
            await second.call(("ping", {}), session=session)
        with pytest.raises(PoolError, match="another dispatcher"):
            await second.call_many([("ping", {})], session=session)


async def test_sessions_need_an_open_dispatcher(pool: LocalBackend) -> None:
    dispatcher = Dispatcher(tools(), pool)
    with pytest.raises(PoolError, match="async with Dispatcher"):
        dispatcher.session()
    async with dispatcher:
        session = dispatcher.session()
        with pytest.raises(PoolClosed, match="not open"):
            await session.call(("exec", {"command": "true"}))
        await session.aclose()
    with pytest.raises(PoolError, match="opened once"):
        async with dispatcher:
            pass


# -- file tools are confined to the workspace -------------------------------------------------


async def test_file_tools_work_inside_the_workspace(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool, output_limit=100) as dispatcher,
        dispatcher.session() as session,
    ):
        wrote = await session.call(
            ("write_file", {"path": "src/pkg/mod.py", "content": "print('hi')\n"})
        )
        assert (wrote.ok, wrote.output) == (True, "wrote 12 bytes to src/pkg/mod.py")
        read = await session.call(("read_file", {"path": "src/pkg/mod.py"}))
        assert (read.ok, read.output, read.truncated) == (True, "print('hi')\n", False)
        listing = await session.call(("list_dir", {"path": "src"}))
        assert listing.output == "pkg/"
        await session.call(("exec", {"command": "ln -s src/pkg/mod.py link; mkdir empty"}))
        root_listing = await session.call(("list_dir", {}))
        assert root_listing.output == "empty/\nlink@\nsrc/"
        assert (await session.call(("list_dir", {"path": "empty"}))).output == "(empty)"
        via_link = await session.call(("read_file", {"path": "link"}))
        assert via_link.output == "print('hi')\n"
        inside = await session.call(("read_file", {"path": "src/../src/pkg/mod.py"}))
        assert inside.ok
        absolute = await session.call(
            ("read_file", {"path": f"{session.workspace}/src/pkg/mod.py"})
        )
        assert absolute.ok
        missing = await session.call(("read_file", {"path": "nope.txt"}))
        assert (missing.error_type, missing.error) == (
            "FileError",
            "nope.txt: No such file or directory",
        )
        a_dir = await session.call(("read_file", {"path": "src"}))
        assert a_dir.error_type == "FileError"
        over_a_file = await session.call(
            ("write_file", {"path": "src/pkg/mod.py/x", "content": ""})
        )
        assert over_a_file.error_type == "FileError"


async def test_read_file_offset_and_limit(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool, output_limit=100) as dispatcher,
        dispatcher.session() as session,
    ):
        content = "".join(f"line {i:03}\n" for i in range(50))  # 450 bytes
        await session.call(("write_file", {"path": "f.txt", "content": content}))
        first = await session.call(("read_file", {"path": "f.txt"}))
        assert first.output.startswith(content[:100])
        assert first.output.endswith(
            "[showing bytes 0-100 of 450; read_file with offset=100 to read on]"
        )
        assert (first.truncated, first.output_bytes) == (True, 450)
        middle = await session.call(("read_file", {"path": "f.txt", "offset": 100, "limit": 20}))
        assert middle.output.startswith(content[100:120] + "\n[showing bytes 100-120 of 450")
        last = await session.call(("read_file", {"path": "f.txt", "offset": 400, "limit": 1000}))
        assert last.output == content[400:]
        past = await session.call(("read_file", {"path": "f.txt", "offset": 999}))
        assert past.output == "[the file has 450 bytes; offset 999 is past its end]"


@pytest.mark.parametrize(
    "path",
    [
        "..",
        "../outside.txt",
        "a/../../outside.txt",
        "/etc/passwd",
        "/tmp",
        "escape/passwd",  # a symlink to /etc
        "escape-dir/x",  # a symlink to the workspace's parent
        "hop/../../x",  # through a symlinked directory, then up
    ],
)
async def test_file_tools_refuse_paths_that_leave_the_workspace(
    pool: LocalBackend, path: str
) -> None:
    async with Dispatcher(tools(), pool) as dispatcher, dispatcher.session() as session:
        await session.call(
            (
                "exec",
                # "a" exists: the kernel walks a path name by name, and a missing
                # "a" in "a/../../outside.txt" would be "not found" before ".." is seen.
                {"command": "ln -s /etc escape; ln -s .. escape-dir; mkdir a d; ln -s d hop"},
            )
        )
        parent = Path(session.workspace).parent
        before = sorted(os.listdir(parent))
        for call in [
            ("read_file", {"path": path}),
            ("write_file", {"path": path, "content": "pwned"}),
            ("list_dir", {"path": path}),
        ]:
            result = await session.call(call)
            assert (result.ok, result.error_type) == (False, "PathOutsideWorkspace"), call
            assert "outside the workspace" in result.to_model_message()
        assert sorted(os.listdir(parent)) == before
        assert not await anyio.Path("/etc/passwd/pwned").exists()


async def test_a_nul_in_a_path_is_an_argument_error(pool: LocalBackend) -> None:
    async with Dispatcher(tools(), pool) as dispatcher, dispatcher.session() as session:
        result = await session.call(("read_file", {"path": "a\x00b"}))
        assert result.error_type == "ToolArgumentError"


# -- idle reaping: ownership-checked, idle from the end of the last call ----------------------


async def test_an_idle_session_is_reaped_and_then_refuses_calls(
    pool: LocalBackend, root: Path
) -> None:
    async with (
        Dispatcher(tools(), pool, session_ttl=0.3, reap_interval=0.05) as dispatcher,
        dispatcher.session() as session,
    ):
        assert (await session.call(("exec", {"command": "echo alive"}))).ok
        await anyio.sleep(0.6)
        assert session.is_closed()
        assert workspaces(root) == []  # removed by the reaper
        # Never an empty success on a reaped session: it would look like the command printed nothing.
        with pytest.raises(PoolClosed, match=r"reaped after 0.3 s without a call"):
            await session.call(("exec", {"command": "echo hello"}))
        with pytest.raises(PoolClosed):
            await session.call_many([("ping", {}), ("ping", {})])
        assert dispatcher.statistics().sessions_reaped == 1


async def test_a_call_longer_than_the_ttl_is_not_reaped_underneath(
    pool: LocalBackend, root: Path
) -> None:
    # The call holds a lease, so the reaper passes it by (a call longer than the TTL is not cut),
    # and the idle clock starts only when the call ends.
    async with (
        Dispatcher(tools(), pool, session_ttl=0.2, reap_interval=0.02) as dispatcher,
        dispatcher.session() as session,
    ):
        result = await session.call(
            ("exec", {"command": "sleep 0.8; echo survived > out; cat out"})
        )
        assert (result.ok, result.output) == (True, "survived\n")
        assert session.is_open()
        # Reaping by hand right after the call: not idle long enough yet.
        assert await dispatcher.reap_idle_sessions() == []
        follow_up = await session.call(("read_file", {"path": "out"}))
        assert follow_up.output == "survived\n"
        await anyio.sleep(0.5)
        assert session.is_closed()
        assert workspaces(root) == []


async def test_a_session_with_a_call_in_flight_survives_every_reaper_pass(
    pool: LocalBackend,
) -> None:
    clock_offset = 0.0

    def clock() -> float:
        return time.monotonic() + clock_offset

    async with (
        Dispatcher(tools(), pool, session_ttl=0.1, clock=clock) as dispatcher,
        dispatcher.session() as session,
        anyio.create_task_group() as group,
    ):
        group.start_soon(session.call, ("exec", {"command": "sleep 0.5"}))
        await anyio.sleep(0.1)
        for _ in range(10):
            clock_offset += 100.0  # far past the TTL
            assert await dispatcher.reap_idle_sessions() == []
            await anyio.sleep(0.02)
        assert session.is_open()


async def test_every_kind_of_call_counts_as_activity(pool: LocalBackend) -> None:
    # File tools and function tools keep a session alive, not only exec (else live runs are reaped).
    async with (
        Dispatcher(tools(), pool, session_ttl=0.3, reap_interval=0.02) as dispatcher,
        dispatcher.session() as session,
    ):
        await session.call(("write_file", {"path": "f", "content": "x"}))
        for call in [("read_file", {"path": "f"}), ("list_dir", {}), ("ping", {})] * 4:
            await anyio.sleep(0.15)
            assert (await session.call(call)).ok, call
        assert session.is_open()  # 1.8 s in, with a 0.3 s TTL


async def test_sessions_without_a_ttl_are_never_reaped(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool, session_ttl=None) as dispatcher,
        dispatcher.session() as session,
    ):
        assert await dispatcher.reap_idle_sessions() == []
        assert session.is_open()


async def test_concurrent_calls_in_one_session(pool: LocalBackend) -> None:
    async with (
        Dispatcher(tools(), pool, session_ttl=0.2, reap_interval=0.02) as dispatcher,
        dispatcher.session() as session,
    ):
        started = time.monotonic()
        results = await session.call_many(
            [("exec", {"command": f"sleep 0.4; echo {i} > f{i}; cat f{i}"}) for i in range(6)]
        )
        assert time.monotonic() - started < 1.0
        assert [r.output for r in results] == [f"{i}\n" for i in range(6)]
        listing = await dispatcher.call_many([("list_dir", {})], session=session)
        assert listing[0].output.splitlines() == [f"f{i}  2" for i in range(6)]


async def test_the_loop_stays_responsive_while_sessions_open_and_close(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A gather of session starts on a slow disk must neither
    # freeze the loop (every file operation takes 0.3 s here: 20 episodes x 5
    # operations would take 30 s in series on the loop) nor leak. Without walls: what is
    # measured is the file operations, not 20 sandboxes starting on a busy machine.
    pool = LocalBackend(LocalPoolConfig(isolation="none", workspace_root=str(root)))
    await pool.__aenter__()
    slow_local_disk(monkeypatch, pool.host, 0.3)

    async def episode(dispatcher: Dispatcher) -> None:
        async with dispatcher.session() as session:
            wrote = await session.call(("write_file", {"path": "big", "content": "x" * 500_000}))
            assert wrote.ok, wrote
            assert (await session.call(("read_file", {"path": "big"}))).ok
            assert (await session.call(("list_dir", {}))).ok

    started = time.monotonic()
    async with (
        Dispatcher(tools(), pool) as dispatcher,
        watch_loop() as stall,
        anyio.create_task_group() as group,
    ):
        for _ in range(20):
            group.start_soon(episode, dispatcher)
    elapsed = time.monotonic() - started
    # One kind of operation run on the loop would add 20 x 0.3 = 6 s.
    assert elapsed < 6, f"20 episodes took {elapsed:.1f} s: file operations ran in series"
    assert stall.worst < 1.0, f"the event loop stalled for {stall.worst:.3f} s"
    assert workspaces(root) == []
    await pool.aclose()


async def test_session_repr_before_open(tmp_path: Path) -> None:
    pool = LocalBackend(LocalPoolConfig(workspace_root=str(tmp_path)))
    async with Dispatcher(tools(), pool) as dispatcher:
        session = dispatcher.session()
        assert isinstance(session, Session)
        assert re.fullmatch(r"<Session s1-[0-9a-f]{16} \[calls: 0 active\] new>", repr(session))


async def test_a_failed_removal_is_logged_and_never_stops_the_others(
    pool: LocalBackend,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real_remove = pool.host.remove_workspace
    failing: list[str] = []

    async def remove(path: str) -> None:
        if not failing:
            failing.append(path)
            raise OSError("disk on fire")
        await real_remove(path)

    monkeypatch.setattr(pool.host, "remove_workspace", remove)
    dispatcher = Dispatcher(tools(), pool)
    async with dispatcher:
        sessions = [await dispatcher.session().__aenter__() for _ in range(3)]
    assert all(session.is_closed() for session in sessions)
    assert workspaces(root) == [os.path.basename(failing[0])]
    assert "removing its workspace on local failed" in caplog.text
