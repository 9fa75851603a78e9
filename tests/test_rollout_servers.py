"""Policy servers: load balancing, failover, probing back, and weight updates with each
in-flight policy, against scripted vLLM stand-ins (tests/support/rl_server.py).

The same against the real vLLM CPU server is tests/test_vllm_weights.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.rl_server import RLServer, rl_server
from support.rl_server import fake_checkpoint as checkpoint

from agent_backend.errors import PolicyError
from agent_backend.rollout import SampledTokens, VLLMTokenSampler
from agent_backend.rollout.servers import PolicyServers, Sticky, base_url
from agent_backend.rollout.weight_sync import check_checkpoint, untie_for_vllm

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
async def two() -> AsyncIterator[tuple[RLServer, RLServer]]:
    async with rl_server() as a, rl_server() as b:
        yield a, b


@contextlib.asynccontextmanager
async def turn_held_on(
    server: RLServer, sampler: VLLMTokenSampler, results: dict[str, SampledTokens]
) -> AsyncIterator[None]:
    """One turn sampling on ``server`` (which holds it), in flight for the body; its tokens
    land in ``results["turn"]`` once the body lets it end."""

    async def turn() -> None:
        results["turn"] = await sampler.sample([1])

    async with anyio.create_task_group() as group:
        group.start_soon(turn)
        await server.wait_in_flight(1)
        yield


def test_base_url_strips_endpoints_and_v1() -> None:
    assert base_url("http://h:1/v1/completions") == "http://h:1"
    assert base_url("http://h:1/v1/chat/completions/") == "http://h:1"
    assert base_url("http://h:1/v1") == "http://h:1"
    assert base_url("http://h:1") == "http://h:1"


def test_a_server_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        PolicyServers(["http://h:1", "http://h:1/v1"])


async def test_requests_go_to_the_least_loaded_server_and_an_episode_stays_on_one(
    two: tuple[RLServer, RLServer],
) -> None:
    a, b = two
    a.hold = b.hold = True
    async with (
        PolicyServers([a.url, b.url]) as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler,
    ):
        stickies = [Sticky() for _ in range(4)]
        async with anyio.create_task_group() as group:
            for sticky in stickies:
                group.start_soon(lambda s=sticky: sampler.sample([1, 2], sticky=s))
            await a.wait_in_flight(2)
            await b.wait_in_flight(2)
            a.release()
            b.release()
        assert (len(a.requests), len(b.requests)) == (2, 2)
        a.hold = b.hold = False
        # The next turns of each episode go where its first went.
        for sticky in stickies:
            where = sticky.server
            await sampler.sample([1, 2, 3], sticky=sticky)
            assert sticky.server is where
        assert (len(a.requests), len(b.requests)) == (4, 4)


async def test_a_dead_server_is_taken_out_and_probed_back(
    two: tuple[RLServer, RLServer],
) -> None:
    a, b = two
    async with (
        PolicyServers([a.url, b.url], probe_interval=0.05, max_probe_interval=0.05) as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4, backoff=0.01) as sampler,
    ):
        sticky = Sticky(servers.servers[0])
        port = a.port
        await a.stop()
        out = await sampler.sample([1], sticky=sticky)  # fails over at once
        assert out.token_ids == [0]
        assert sticky.server is servers.servers[1]
        assert not servers.servers[0].up
        assert servers.servers[0].failures == 1
        assert len(b.requests) == 1
        await a.start(port)  # back on the same port
        for _ in range(200):  # bounded: a probe is due every 50 ms
            if servers.servers[0].up:
                break
            await sampler.sample([1])
            await anyio.sleep(0.01)
        assert servers.servers[0].up


async def test_the_last_server_up_stays_in_and_is_retried() -> None:
    async with rl_server() as a:
        port = a.port
        await a.stop()
        async with VLLMTokenSampler(
            f"http://127.0.0.1:{port}", model="m", max_tokens=4, max_retries=2, backoff=0.01
        ) as sampler:
            with pytest.raises(PolicyError, match="gave up after 3 attempts"):
                await sampler.sample([1])
            assert sampler.servers.servers[0].up
            assert sampler.statistics().requests == 3


async def test_drain_lets_in_flight_turns_finish_on_the_old_weights(
    two: tuple[RLServer, RLServer], tmp_path: Path
) -> None:
    a, b = two
    a.hold = True
    async with (
        PolicyServers([a.url, b.url]) as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler,
    ):
        results: dict[str, object] = {}

        async def old_turn() -> None:
            results["old"] = await sampler.sample([1], sticky=Sticky(servers.servers[0]))

        async def update() -> None:
            results["report"] = await servers.update_weights(checkpoint(tmp_path, 1))

        async def new_turn() -> None:
            results["new"] = await sampler.sample([2])

        async with anyio.create_task_group() as group:
            group.start_soon(old_turn)
            await a.wait_in_flight(1)
            group.start_soon(update)
            while not servers.updating:  # noqa: ASYNC110 (the update task's state)
                await anyio.sleep(0.005)
            group.start_soon(new_turn)
            while servers.waiting < 1:  # noqa: ASYNC110 (held back at the gate)
                await anyio.sleep(0.005)
            assert len(a.requests) + len(b.requests) == 1  # no request goes out meanwhile
            assert a.calls == []
            assert b.calls == []
            a.release()
        old, new = results["old"], results["new"]
        assert old.token_ids == [0]
        assert old.versions == (0, 0)
        assert new.token_ids == [1]
        assert new.versions == (1, 1)
        for server in (a, b):
            assert server.calls == ["pause:wait", "reload:ckpt-1", "version:1", "resume"]
        assert servers.version == 1
        assert results["report"].drained == 1  # type: ignore[attr-defined]


async def test_a_drain_that_never_ends_is_refused_after_drain_timeout_and_changes_nothing(
    tmp_path: Path,
) -> None:
    async with rl_server() as a, PolicyServers(a.url, drain_timeout=0.2) as servers:
        a.hold = True
        async with VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler:
            results: dict[str, SampledTokens] = {}
            async with turn_held_on(a, sampler, results):
                with pytest.raises(
                    PolicyError, match=r"1 request\(s\) still in flight after 0\.2 s"
                ):
                    await servers.update_weights(checkpoint(tmp_path, 1))
                assert not servers.updating  # the gate is open again
                assert servers.version == 0
                assert a.calls == []  # the server was never paused
                a.release()
            assert results["turn"].versions == (0, 0)
            # With the request ended, the same update goes through.
            report = await servers.update_weights(checkpoint(tmp_path, 1))
            assert (report.version, report.drained) == (1, 0)


@pytest.mark.parametrize(
    ("in_flight", "versions", "requests", "pause"),
    [
        # Aborted, and sent again on the new weights (not counted as a retry).
        ("abort", (1, 1), 2, "pause:abort"),
        # Held, then frozen by pause(keep), resumed on the new weights: it crossed the update.
        ("continue", (0, 1), 1, "pause:keep"),
    ],
)
async def test_a_turn_held_on_the_server_across_an_update(
    tmp_path: Path, in_flight: Any, versions: tuple[int, int], requests: int, pause: str
) -> None:
    async with rl_server() as a, PolicyServers(a.url) as servers:
        a.hold = True
        async with VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler:
            results: dict[str, SampledTokens] = {}
            async with turn_held_on(a, sampler, results):
                a.hold = False
                await servers.update_weights(checkpoint(tmp_path, 1), in_flight=in_flight)
        out = results["turn"]
        assert out.token_ids == [1]  # its tokens come from the new weights
        assert out.versions == versions
        assert len(a.requests) == requests
        assert servers.statistics().resent_after_abort == requests - 1
        assert a.calls == [pause, "reload:ckpt-1", "version:1", "resume"]


async def test_a_refused_checkpoint_raises_keeps_the_version_and_resumes(
    two: tuple[RLServer, RLServer], tmp_path: Path
) -> None:
    a, b = two
    async with (
        PolicyServers([a.url, b.url]) as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler,
    ):
        with pytest.raises(PolicyError, match="not a folder here"):
            await servers.update_weights(tmp_path / "missing")  # refused before any pause
        assert a.calls == []
        with pytest.raises(PolicyError, match="no such checkpoint"):
            await servers.update_weights(checkpoint(tmp_path, "bad"))  # refused by the servers
        assert servers.version == 0
        assert not servers.updating
        assert a.paused is None
        assert b.paused is None
        assert (await sampler.sample([1])).versions == (0, 0)


async def test_a_server_out_at_an_update_loads_it_before_it_serves_again(
    two: tuple[RLServer, RLServer], tmp_path: Path
) -> None:
    a, b = two
    async with (
        PolicyServers([a.url, b.url], probe_interval=0.05, max_probe_interval=0.05) as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4, backoff=0.01) as sampler,
    ):
        port = a.port
        await a.stop()
        await sampler.sample([1], sticky=Sticky(servers.servers[0]))  # a is taken out
        report = await servers.update_weights(checkpoint(tmp_path, 1))
        assert report.updated == (b.url,)
        assert report.out == (a.url,)
        a.weights = 0  # a restarted server: its original weights
        await a.start(port)
        for _ in range(200):
            if servers.servers[0].up:
                break
            await sampler.sample([1])
            await anyio.sleep(0.01)
        assert servers.servers[0].up
        assert a.calls == ["pause:wait", "reload:ckpt-1", "version:1", "resume"]
        out = await sampler.sample([1], sticky=Sticky(servers.servers[0]))
        assert out.token_ids == [1]
        assert out.versions == (1, 1)


async def test_an_update_without_a_weight_loader_says_how_to_sync() -> None:
    async with PolicyServers("http://127.0.0.1:1", weights=None) as servers:
        with pytest.raises(PolicyError, match="set_version"):
            await servers.update_weights("/nowhere")
        servers.set_version(3)
        assert servers.version == 3
        with pytest.raises(ValueError, match="only go up"):
            servers.set_version(2)


def test_a_tied_checkpoint_without_an_output_layer_is_refused_until_untied(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    check_checkpoint(checkpoint(tmp_path, 1))  # untied: fine
    check_checkpoint(checkpoint(tmp_path, 2, tied=True, head=True))  # tied, head named: fine
    tied = checkpoint(tmp_path, 3, tied=True)
    with pytest.raises(PolicyError, match="untie_for_vllm"):
        check_checkpoint(tied)
    safetensors_torch.save_file(
        {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2)},
        str(tied / "model.safetensors"),
    )
    untie_for_vllm(tied)
    check_checkpoint(tied)
    loaded = safetensors_torch.load_file(str(tied / "model.safetensors"))
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


async def test_sglang_servers_are_updated_through_sglangs_endpoints(tmp_path: Path) -> None:
    async with (
        rl_server() as a,
        PolicyServers(a.url, weights="sglang") as servers,
        VLLMTokenSampler(servers, model="m", max_tokens=4) as sampler,
    ):
        await servers.update_weights(checkpoint(tmp_path, 1))
        assert (await sampler.sample([1])).token_ids == [1]
        await servers.update_weights(checkpoint(tmp_path, 2), in_flight="continue")
        with pytest.raises(PolicyError, match="refused"):
            await servers.update_weights(tmp_path / "missing")
    assert a.calls == [
        "pause_generation:in_place",
        "update_weights_from_disk:ckpt-1:1:flush=True",
        "resume",
        "pause_generation:in_place",
        "update_weights_from_disk:ckpt-2:2:flush=False",  # frozen requests keep their cache
        "resume",
        "pause_generation:in_place",
        "update_weights_from_disk:missing:3:flush=True",
        "resume",  # resumed after the refusal too
    ]
    assert servers.version == 2
