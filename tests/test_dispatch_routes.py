"""Routes: one Dispatcher over several pools.

The routing function alone (pure), then a dispatcher over two real local
pools (workspaces made per pool on first use, closed together, a pool that
is down fails naming it while the other serves), then the mixed case the
feature exists for: shell tools on a real sshd, a reward tool on a real
local Ray, in one session.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from support.daemon_fixtures import TOKEN
from support.policy_server import (
    PolicyServer,
    Reply,
    Turn,
    leftover_workspaces,
    policy_server_fixture,
)
from support.ray_fixtures import RayCluster, pool_config, ray_cluster
from support.ssh_helpers import backend_for
from support.sshd import SSHServer

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.backends.ssh import SSHHostConfig, SSHPoolConfig
from agent_backend.backends.ssh.walls import ssh_guarantees
from agent_backend.daemon import DaemonSettings, run_in_thread
from agent_backend.dispatch import (
    DEFAULT_POOL_NAME,
    Dispatcher,
    PoolShape,
    Route,
    builtin_tools,
    route,
)
from agent_backend.errors import BackendError, BackendUnavailable, ConfigError
from agent_backend.pool_file import PoolSetConfig
from agent_backend.sandbox import SandboxLimits
from agent_backend.tools import Tool, ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]
policy_server = policy_server_fixture
__all__ = ["ray_cluster"]  # a fixture, used by name

CMD = PoolShape("cmd", "ssh", has_hosts=True)
LOCAL = PoolShape("local", "local", has_hosts=True)
GPU = PoolShape("gpu", "ray", has_hosts=False, hosted=frozenset({"score"}))
POOLS = {"cmd": CMD, "local": LOCAL, "gpu": GPU}


def command_tool(name: str = "grep", **block: Any) -> Tool:
    return Tool(
        name,
        meta={"x-agent-backend": {"command": ["grep", "-r"], **block}},
        source=f"tools/{name}.json",
    )


def builtin(name: str) -> Tool:
    return next(tool for tool in builtin_tools() if tool.name == name)


# -- the routing function alone -------------------------------------------------------------


def test_host_tools_go_to_the_default_pool_and_functions_stay_here() -> None:
    assert route(builtin("exec"), POOLS, "cmd") == Route("cmd", "builtin")
    assert route(command_tool(), POOLS, "local") == Route("local", "command")
    assert route(Tool("f", function=lambda: 1), POOLS, "cmd") == Route(None, "function")


def test_a_default_pool_without_hosts_sends_host_tools_to_the_first_with_hosts() -> None:
    assert route(builtin("read_file"), POOLS, "gpu") == Route("cmd", "builtin")


def test_the_backend_key_narrows_host_tools_to_pools_of_that_kind() -> None:
    assert route(command_tool(backend="local"), POOLS, "cmd") == Route("local", "command")
    with pytest.raises(ConfigError, match="must run on a 'ssh' pool") as caught:
        route(command_tool(backend="ssh"), {"local": LOCAL}, "local")
    assert caught.value.key == "x-agent-backend.backend"


def test_the_pool_key_routes_explicitly() -> None:
    assert route(command_tool(pool="local"), POOLS, "cmd") == Route("local", "command")
    # A Python function named for a pool whose workers run it: the hosted tool's declaration.
    declared = Tool("score", function=lambda: 0.0, meta={"x-agent-backend": {"pool": "gpu"}})
    assert route(declared, POOLS, "cmd") == Route("gpu", "hosted")
    # A definition without a function or command, for a pool not open yet (its tools unknown).
    later = PoolShape("later", "ray", has_hosts=False, hosted=None)
    bare = Tool("rank", meta={"x-agent-backend": {"pool": "later"}}, source="tools/rank.json")
    assert route(bare, {**POOLS, "later": later}, "cmd") == Route("later", "hosted")
    # A tool a pool hosts (the very object it gave) goes there whatever else it says.
    assert route(Tool("score"), POOLS, "cmd", hosted_by="gpu") == Route("gpu", "hosted")


@pytest.mark.parametrize(
    ("tool", "key", "match"),
    [
        (command_tool(pool="nope"), "x-agent-backend.pool", "names pool 'nope'"),
        (command_tool(pool="gpu"), "x-agent-backend.pool", "has no hosts"),
        (command_tool(pool=""), "x-agent-backend.pool", "expected a pool name"),
        (command_tool(pool="cmd", backend="local"), "x-agent-backend.backend", "'local' pool"),
        (
            Tool("rank", function=lambda: 0, meta={"x-agent-backend": {"pool": "gpu"}}),
            "x-agent-backend.pool",
            "run no tool of that name",
        ),
        (command_tool(timeout=-1), "x-agent-backend.timeout", "greater than 0"),
    ],
    ids=["unknown", "no-hosts", "empty", "wrong-kind", "not-hosted", "bad-block"],
)
def test_a_tool_no_pool_can_run_is_a_config_error_naming_its_key(
    tool: Tool, key: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        route(tool, POOLS, "cmd")
    assert caught.value.key == key


def test_registry_tool_decorator_takes_the_pool() -> None:
    registry = ToolRegistry()

    @registry.tool(pool="gpu")
    def score(text: str) -> float:
        """Score a text."""
        return float(len(text))

    assert registry.get("score").meta["x-agent-backend"] == {"pool": "gpu"}
    assert score("ab") == 2.0  # the function itself is returned unchanged
    assert route(registry.get("score"), POOLS, "cmd") == Route("gpu", "hosted")


def test_backend_errors_pickle_with_the_pool() -> None:
    error = BackendUnavailable("pool 'gpu' is down", backend="ray", host="n1", pool="gpu")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.pool, clone.backend, clone.host, str(clone)) == ("gpu", "ray", "n1", str(error))


# -- two real local pools -------------------------------------------------------------------


@pytest.fixture
async def two_pools(tmp_path: Path) -> AsyncIterator[dict[str, LocalBackend]]:
    roots = {name: tmp_path / name for name in ("a", "b")}
    async with (
        LocalBackend(LocalPoolConfig(workspace_root=str(roots["a"]), spare_workspaces=0)) as a,
        LocalBackend(LocalPoolConfig(workspace_root=str(roots["b"]), spare_workspaces=0)) as b,
    ):
        yield {"a": a, "b": b}


def made_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("agent-backend-ws-*")) if root.is_dir() else []


def two_pool_registry() -> ToolRegistry:
    registry = ToolRegistry(builtin_tools())
    registry.add(
        Tool(
            "where_b",
            meta={"x-agent-backend": {"command": ["pwd"], "pool": "b"}},
            source="tools/where_b.json",
        )
    )

    @registry.tool
    def ping() -> str:
        """Runs in this process."""
        return "pong"

    return registry


async def test_one_pool_keeps_its_name_and_its_eager_workspace(
    two_pools: dict[str, LocalBackend], tmp_path: Path
) -> None:
    async with Dispatcher(ToolRegistry(builtin_tools()), two_pools["a"]) as dispatcher:
        assert list(dispatcher.pools) == [DEFAULT_POOL_NAME]
        assert dispatcher.default == "default"
        assert "pool=local" in repr(dispatcher)
        async with dispatcher.session() as session:
            assert session.workspace is not None  # made on entry, as before routes
            assert len(made_in(tmp_path / "a")) == 1
        assert made_in(tmp_path / "a") == []


async def test_a_session_makes_a_workspace_per_pool_on_first_use_and_closes_them_together(
    two_pools: dict[str, LocalBackend], tmp_path: Path
) -> None:
    async with Dispatcher(two_pool_registry(), pools=two_pools, default="a") as dispatcher:
        assert "pools=a:local,b:local" in repr(dispatcher)
        async with dispatcher.session() as session:
            assert (await session.call(("ping", {}))).output == "pong"
            assert session.workspaces() == {}
            assert session.workspace is None
            assert made_in(tmp_path / "a") == made_in(tmp_path / "b") == []

            on_b = await session.call(("where_b", {}))
            assert on_b.ok, on_b
            assert made_in(tmp_path / "a") == []  # pool a not used yet: nothing made there
            assert on_b.output.strip() == session.workspaces()["b"][1]
            assert on_b.output.strip().startswith(str(await anyio.Path(tmp_path / "b").resolve()))

            on_a = await session.call(("exec", {"command": "pwd"}))
            assert on_a.output.strip() == session.workspace
            assert set(session.workspaces()) == {"a", "b"}
            again = await session.call(("where_b", {}))  # the same workspace, not a new one
            assert again.output == on_b.output
            assert len(made_in(tmp_path / "b")) == 1
        assert made_in(tmp_path / "a") == made_in(tmp_path / "b") == []


async def test_concurrent_first_calls_make_one_workspace(
    two_pools: dict[str, LocalBackend], tmp_path: Path
) -> None:
    dispatcher = Dispatcher(two_pool_registry(), pools=two_pools, default="a")
    async with dispatcher, dispatcher.session() as session:
        results = await session.call_many([("where_b", {})] * 8)
        assert {result.output for result in results} == {results[0].output}
        assert len(made_in(tmp_path / "b")) == 1


async def test_a_pool_that_is_down_fails_naming_it_and_the_other_keeps_serving(
    two_pools: dict[str, LocalBackend], tmp_path: Path
) -> None:
    async with Dispatcher(two_pool_registry(), pools=two_pools, default="a") as dispatcher:
        async with dispatcher.session() as session:
            assert (await session.call(("exec", {"command": "true"}))).ok
            await two_pools["b"].aclose()
            with pytest.raises(BackendUnavailable, match="pool 'b'") as caught:
                await session.call(("where_b", {}))
            assert caught.value.pool == "b"
            assert caught.value.backend == "local"
            with pytest.raises(BackendUnavailable) as sessionless:
                await dispatcher.call(("where_b", {}))
            assert sessionless.value.pool == "b"
            assert (await session.call(("exec", {"command": "echo still"}))).output == "still\n"
        # The other pool's workspace went, even though its sibling pool was down.
        assert made_in(tmp_path / "a") == []


async def test_closing_a_session_removes_every_workspace_even_when_one_removal_fails(
    two_pools: dict[str, LocalBackend], tmp_path: Path
) -> None:
    async with Dispatcher(two_pool_registry(), pools=two_pools, default="a") as dispatcher:
        session = await dispatcher.session().__aenter__()
        assert (await session.call(("where_b", {}))).ok
        assert (await session.call(("exec", {"command": "true"}))).ok
        await two_pools["b"].aclose()  # removing b's workspace now fails (logged)
        with anyio.CancelScope() as scope:
            scope.cancel()  # closing is shielded: a cancelled closer still closes everything
            await session.aclose()
        assert session.is_closed()
        assert made_in(tmp_path / "a") == []
        await session.aclose()  # idempotent


def test_pools_are_given_one_way() -> None:
    registry = ToolRegistry()
    with pytest.raises(TypeError):
        Dispatcher(registry)
    with pytest.raises(ValueError, match="default pool 'x'"):
        Dispatcher(registry, pools={"a": LocalBackend(LocalPoolConfig())}, default="x")


# -- the mixed case: shell tools on a real sshd, a reward tool on a real local Ray ----------


def mixed_registry() -> ToolRegistry:
    """The built-ins (to the SSH pool) and ``echo``, declared here and run by the Ray actors."""
    registry = ToolRegistry(builtin_tools())

    @registry.tool(pool="gpu")
    def echo(text: str) -> str:
        """Return the text.

        Args:
            text: What to return.
        """
        raise AssertionError("routed to the Ray actors: never runs in this process")

    return registry


def ray_config() -> Any:
    return pool_config("support.ray_tools:echo", "support.ray_tools:whoami", name="routes")


def ssh_config(sshd: SSHServer, root: Path, **options: Any) -> Any:
    host = SSHHostConfig(**sshd.client_options(workspace_root=str(root), **options))
    return SSHPoolConfig(hosts=(host,), close_timeout=5.0)


async def test_one_session_spans_an_ssh_pool_and_a_ray_pool_and_each_can_go_down_alone(
    sshd: SSHServer, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    from agent_backend.backends.ray import RayBackend

    root = tmp_path / "ssh-ws"
    async with (
        backend_for(sshd, workspace_root=str(root), connect_retries=0) as ssh,
        RayBackend.from_config(ray_config()) as ray,
        Dispatcher(mixed_registry(), pools={"cmd": ssh, "gpu": ray}, default="cmd") as dispatcher,
    ):
        host = ssh.hosts[0]
        async with dispatcher.session() as session:
            echoed = await session.call(("echo", {"text": "from ray"}))
            assert echoed.ok, echoed
            assert echoed.output == "from ray"
            assert echoed.host is not None
            assert echoed.host.startswith("routes-")
            assert (await session.call(("whoami", {}))).ok  # a hosted tool the registry lacked
            assert host.workspaces() == frozenset()  # Ray calls only: no SSH workspace
            where = await session.call(("exec", {"command": "pwd"}))
            assert where.ok, where
            assert where.host == host.name
            assert where.output.strip() == session.workspace
            assert len(host.workspaces()) == 1
        assert host.workspaces() == frozenset()
        assert leftover_workspaces(root) == []

        # A Ray pool that is down (here: never started) fails naming it; SSH keeps serving.
        unstarted = {"cmd": ssh, "gpu": RayBackend.from_config(ray_config())}
        async with Dispatcher(mixed_registry(), pools=unstarted) as other, other.session() as s:
            with pytest.raises(BackendUnavailable, match="pool 'gpu'") as not_started:
                await s.call(("echo", {"text": "x"}))
            assert not_started.value.pool == "gpu"
            assert (await s.call(("exec", {"command": "echo up"}))).output == "up\n"

        # Every host of pool cmd unreachable: its calls fail naming it; Ray keeps serving.
        async with dispatcher.session() as session:
            assert (await session.call(("exec", {"command": "true"}))).ok
            sshd.kill()
            with pytest.raises(BackendError) as down:
                await session.call(("exec", {"command": "true"}))
            assert down.value.pool == "cmd"
            assert (await session.call(("echo", {"text": "still"}))).output == "still"


async def test_an_episode_through_the_daemon_on_ssh_and_ray(
    sshd: SSHServer, ray_cluster: RayCluster, tmp_path: Path
) -> None:
    root = tmp_path / "ssh-ws"
    # Down after one failed connection attempt, so that readiness sees it at once.
    cmd = ssh_config(sshd, root, connect_retries=0, down_after_failures=1)
    pools = PoolSetConfig({"cmd": cmd, "gpu": ray_config()}, "cmd")
    settings = DaemonSettings(tokens=(TOKEN,), port=0, grace=2.0)
    with run_in_thread(mixed_registry(), settings, pool=pools) as daemon:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=daemon.url, headers=headers, timeout=30) as http:
            names = {t["function"]["name"] for t in (await http.get("/v1/tools")).json()["tools"]}
            assert {"exec", "echo", "whoami"} <= names
            opened = await http.post("/v1/sessions")
            assert opened.status_code == 201, opened.text
            sid = opened.json()["id"]
            calls = [
                {"name": "echo", "arguments": {"text": "reward 1.0"}},
                {"name": "write_file", "arguments": {"path": "a.txt", "content": "on ssh"}},
            ]
            batch = await http.post("/v1/batch", json={"calls": calls, "session": sid})
            assert [r["ok"] for r in batch.json()["results"]] == [True, True], batch.text
            read = await http.post(
                "/v1/call",
                json={"name": "exec", "arguments": {"command": "cat a.txt"}, "session": sid},
            )
            assert read.json()["output"] == "on ssh", read.text
            assert len(leftover_workspaces(root)) == 1
            assert (await http.delete(f"/v1/sessions/{sid}")).status_code == 204
            assert leftover_workspaces(root) == []

            # Readiness and metrics speak of every pool, by name.
            ready = (await http.get("/v1/health/ready")).json()
            assert ready["status"] == "ready", ready
            # An SSH pool declares its walls, as the local pool does (docs/sandboxes.md).
            walls = ssh_guarantees("namespaces", SandboxLimits()).lines()
            assert walls
            assert ready["pools"]["cmd"] == {
                "backend": "ssh",
                "up": 1,
                "total": 1,
                "guarantees": walls,
            }
            assert ready["pools"]["gpu"]["backend"] == "ray"
            assert ready["pools"]["gpu"]["up"] == ready["pools"]["gpu"]["total"] >= 1
            metrics = (await http.get("/metrics")).text
            assert 'agent_backend_pool_hosts_up{backend="ssh",pool="cmd"} 1.0' in metrics
            assert 'agent_backend_pool_hosts_up{backend="ray",pool="gpu"}' in metrics
            assert metrics.count("# TYPE agent_backend_pool_hosts_up gauge") == 1

            # The SSH pool goes down: the daemon is not ready and says which pool; Ray serves.
            sshd.kill()
            for _ in range(5):  # the first failed call loses the connection, the next is down
                await http.post("/v1/call", json={"name": "exec", "arguments": {"command": "true"}})
                readiness = await http.get("/v1/health/ready")
                if readiness.status_code == 503:
                    break
            assert readiness.status_code == 503, readiness.text
            assert "pool 'cmd': no ssh host is up" in readiness.json()["reason"]
            assert readiness.json()["pools"]["gpu"]["up"] >= 1
            echo = await http.post("/v1/call", json={"name": "echo", "arguments": {"text": "up"}})
            assert echo.json()["output"] == "up", echo.text


def ssh_then_ray(turn: Turn) -> Reply:
    """One shell call (SSH) and one reward-side call (Ray), then an answer quoting both."""
    if turn.index == 0:
        task = turn.messages[0]["content"]
        return Reply(
            "",
            tool_calls=[("exec", {"command": f"echo '{task}'"}), ("echo", {"text": "scored"})],
        )
    return Reply("done: " + " | ".join(result.strip() for result in turn.last_tool_results()))


async def test_a_rollout_whose_episodes_use_ssh_and_ray(
    sshd: SSHServer, ray_cluster: RayCluster, policy_server: PolicyServer, tmp_path: Path
) -> None:
    from agent_backend.backends.ray import RayBackend
    from agent_backend.rollout.episode import EpisodeConfig
    from agent_backend.rollout.ledger import ResumeLedger
    from agent_backend.rollout.policy import OpenAICompatiblePolicy
    from agent_backend.rollout.pool import RolloutPool
    from agent_backend.rollout.writers import JsonlWriter, read_trajectories

    model = policy_server.add("routes-mixed", ssh_then_ray)
    root = tmp_path / "ssh-ws"
    rows = [{"prompt": f"task {i}", "answer": i} for i in range(3)]

    def reward(episode: Any) -> float:
        expected = f"done: task {episode.prompt['answer']} | scored"
        return 1.0 if episode.final_text == expected else 0.0

    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=len(rows))
    async with (
        backend_for(sshd, workspace_root=str(root)) as ssh,
        RayBackend.from_config(ray_config()) as ray,
        Dispatcher(mixed_registry(), pools={"cmd": ssh, "gpu": ray}, default="cmd") as dispatcher,
        OpenAICompatiblePolicy(policy_server.url, model=model, backoff=0.01) as policy,
    ):
        rollouts = RolloutPool(
            policy, dispatcher, reward=reward, n=2, concurrency=4, episode=EpisodeConfig(timeout=60)
        )
        with JsonlWriter.open(tmp_path / "out.jsonl") as writer:
            stats = await rollouts.run(rows, ledger=ledger, writer=writer)
        assert dispatcher.statistics().sessions_open == 0
        assert ssh.hosts[0].workspaces() == frozenset()
        ssh_host = ssh.hosts[0].name
    assert leftover_workspaces(root) == []
    records = list(read_trajectories(tmp_path / "out.jsonl"))
    assert len(records) == 6
    # Where each ran: the workspace is on SSH (Ray's actors keep none), made on the first exec.
    assert {t.extras["host"] for t in records} == {ssh_host}
    assert all(t.reward == 1.0 for t in records), [(t.final_text, t.error) for t in records]
    assert stats.tool_calls == 12


def test_the_block_schema_file_is_in_sync_and_takes_the_pool_key() -> None:
    """schemas/x-agent-backend.schema.json is execution_block_schema() (rewrite it from that)."""
    import json

    import jsonschema

    from agent_backend.dispatch.routes import execution_block_schema

    path = Path(__file__).resolve().parents[1] / "schemas" / "x-agent-backend.schema.json"
    schema = execution_block_schema()
    assert path.read_text() == json.dumps(schema, indent=2) + "\n"
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"command": ["grep", "-r"], "pool": "cmd", "timeout": 5})
    assert validator.is_valid({"pool": "gpu"})
    assert not validator.is_valid({"pool": ""})
    assert not validator.is_valid({"pool": "gpu", "bogus": 1})
    for tool in builtin_tools():
        assert validator.is_valid(dict(tool.meta["x-agent-backend"])), tool.name
