"""Forks and grading snapshots of a session, through the library and the daemon, on the
default tier (namespaces): the workspace-level mechanics are in tests/test_workspace_layers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from support.ssh_helpers import wait_until
from support.walls import require_walls

from agent_backend import Client
from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.daemon import DaemonSettings, run_in_thread
from agent_backend.dispatch import Dispatcher, Session, builtin_tools
from agent_backend.errors import PoolClosed, PoolError, TooManySessions
from agent_backend.tools import ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOKEN = "fork-token-" + "f" * 24


@pytest.fixture
async def dispatcher(tmp_path: Path) -> AsyncIterator[Dispatcher]:
    require_walls()
    config = LocalPoolConfig(workspace_root=str(tmp_path / "ws"), spare_workspaces=2)
    async with (
        LocalBackend(config) as pool,
        Dispatcher(ToolRegistry(builtin_tools()), pool) as running,
    ):
        yield running


async def run(session: Session, command: str) -> str:
    result = await session.call(("exec", {"command": command}))
    assert result.ok, result
    return result.output


async def test_forks_start_as_copies_and_go_their_own_ways(dispatcher: Dispatcher) -> None:
    async with dispatcher.session() as base:
        await run(base, "mkdir -p repo && echo v1 > repo/file && ln -s file repo/link")
        forks = await base.fork(3)
        try:
            assert len({fork.id for fork in forks} | {base.id}) == 4
            assert len({fork.workspace for fork in forks} | {base.workspace}) == 4
            for index, fork in enumerate(forks):
                assert await run(fork, "cat repo/link") == "v1\n"
                await run(fork, f"echo fork-{index} > repo/file; echo only-{index} > mine")
            await run(base, "echo base-after > repo/file")
            for index, fork in enumerate(forks):
                assert await run(fork, "cat repo/file; ls") == f"fork-{index}\nmine\nrepo\n"
                # Each fork is its own sandbox: a uid of its own, the others' files unseen.
                uid = await run(fork, "id -u")
                assert uid != await run(base, "id -u")
            assert await run(base, "cat repo/file; ls") == "base-after\nrepo\n"
            assert dispatcher.statistics().sessions_open == 4
            paths = [fork.workspace for fork in forks]
        finally:
            for fork in forks:
                await fork.aclose()
        for path in paths:
            assert path is not None
            assert not await anyio.Path(path).exists()
        # A fork of a fork.
        (child,) = await base.fork(1)
        async with child:
            (grandchild,) = await child.fork(1)
            async with grandchild:
                await run(child, "echo child > repo/file")
                assert await run(grandchild, "cat repo/file") == "base-after\n"


async def test_a_fork_is_refused_while_a_call_runs(dispatcher: Dispatcher) -> None:
    async with dispatcher.session() as base, anyio.create_task_group() as group:
        started = anyio.Event()

        async def long_call() -> None:
            started.set()
            await base.call(("exec", {"command": "sleep 300"}))

        group.start_soon(long_call)
        await started.wait()
        # In flight once it holds its cancel scope.
        assert await wait_until(lambda: bool(base._calls), within=60)
        with pytest.raises(PoolError, match="in flight: fork it between calls"):
            await base.fork(2)
        with pytest.raises(PoolError, match="in flight: snapshot it between calls"):
            await base.snapshot()
        group.cancel_scope.cancel()
    with pytest.raises(PoolClosed):
        await base.fork(1)


async def test_a_grader_sees_the_snapshot_and_its_assets_and_the_agent_sees_neither(
    dispatcher: Dispatcher, tmp_path: Path
) -> None:
    hidden = tmp_path / "hidden-tests"
    hidden.mkdir()
    (hidden / "test_answer.sh").write_text('test "$(cat answer)" = 42 && echo PASS\n')
    async with dispatcher.session() as agent:
        await run(agent, "echo 42 > answer")
        async with await agent.snapshot() as snapshot:
            # After the snapshot the agent cheats, and looks for the hidden tests.
            await run(agent, "echo 41 > answer")
            found = await agent.call(("exec", {"command": f"ls {hidden}"}))
            assert not found.ok  # not in its sandbox
            graded = await snapshot.run(
                'sh "$GRADER_ASSETS/hidden-tests/test_answer.sh"; echo tampered > answer',
                assets=[str(hidden)],
                timeout=60,
            )
            assert graded.exit_status == 0, graded
            assert graded.stdout.text() == "PASS\n"
            again = await snapshot.run("cat answer", timeout=60)  # the grader's write is gone
            assert again.stdout.text() == "42\n"
        assert snapshot.is_closed()
        with pytest.raises(PoolClosed):
            await snapshot.run("true")
        assert await run(agent, "cat answer") == "41\n"


async def test_the_daemon_forks_a_session_within_the_tokens_session_cap(tmp_path: Path) -> None:
    require_walls()
    settings = DaemonSettings(tokens=(TOKEN,), port=0, max_sessions_per_token=4)
    pool = LocalPoolConfig(workspace_root=str(tmp_path / "ws"))
    registry = ToolRegistry(builtin_tools())
    with run_in_thread(registry, settings, pool=pool) as daemon:
        async with (
            # busy_timeout=0: a fork past the cap is raised, not waited on for a slot.
            Client(daemon.url, token=TOKEN, retries=0, busy_timeout=0) as client,
            client.session() as base,
        ):
            await base.call(("exec", {"command": "echo prepared > state"}))
            forks = await base.fork(2)
            assert len({fork.id for fork in forks}) == 2
            for fork in forks:
                result = await fork.call(("exec", {"command": "cat state; echo f > state"}))
                assert result.output == "prepared\n"
            again = await base.call(("exec", {"command": "cat state"}))
            assert again.output == "prepared\n"
            with pytest.raises(TooManySessions):
                await base.fork(2)  # 3 open, cap 4
            for fork in forks:
                await fork.aclose()
