"""Asynchronous RL through the rollout pool: weight updates between batches, versions on every
turn, staleness at admission, and a resume after a crash between an update and a checkpoint.

The policy servers are scripted vLLM stand-ins (tests/support/rl_server.py, fault injection:
each sampled token is the number of the weights that sampled it); the tokenizer and chat
template are the tiny model's, the tools run on the real local pool. The same against the
real vLLM CPU server is tests/test_vllm_weights.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.policy_server import local_dispatcher
from support.rl_server import RLServer, rl_server
from support.rl_server import fake_checkpoint as checkpoint
from support.tiny_model import build_tiny_model

from agent_backend.dispatch import Dispatcher
from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    ResumeLedger,
    RolloutPool,
    TokenPolicy,
    Trajectory,
    VLLMTokenSampler,
)
from agent_backend.rollout.servers import PolicyServers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
pytest.importorskip("transformers", reason="token-in/token-out needs transformers")

PROMPTS = [[{"role": "user", "content": f"task {i}"}] for i in range(12)]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate.from_pretrained(str(build_tiny_model(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture
async def dispatcher(tmp_path: Path) -> AsyncIterator[Dispatcher]:
    async with local_dispatcher(tmp_path / "ws") as opened:
        yield opened


def pool_for(
    server: RLServer,
    servers: PolicyServers,
    template: ChatTemplate,
    dispatcher: Dispatcher,
    **options: Any,
) -> tuple[RolloutPool, VLLMTokenSampler]:
    sampler = VLLMTokenSampler(servers, model="m", max_tokens=1)
    policy = TokenPolicy(sampler, template)
    pool = RolloutPool(
        policy,
        dispatcher,
        n=2,
        concurrency=4,
        episode=EpisodeConfig(max_turns=1, max_tokens_per_turn=1),
        **options,
    )
    return pool, sampler


def weights_of(record: Trajectory) -> int:
    """The scripted server samples the number of its weights as the token."""
    start, _stop = record.turn_spans[0]
    return record.completion_ids[start]


async def test_updates_between_batches_version_every_turn_and_reach_the_trainer(
    template: ChatTemplate, dispatcher: Dispatcher, tmp_path: Path
) -> None:
    async with rl_server() as server, PolicyServers(server.url) as servers:
        pool, sampler = pool_for(server, servers, template, dispatcher, max_staleness=1)
        async with sampler:
            seen: list[tuple[int, list[Trajectory]]] = []
            async with pool.stream(PROMPTS[:6], groups_per_batch=1) as batches:
                async for batch in batches:
                    seen.append((pool.policy_version, batch))
                    report = await pool.update_weights(checkpoint(tmp_path, len(seen)))
                    assert report.version == len(seen)
        stats = pool.statistics()
    assert stats.groups_delivered == 6
    assert stats.groups_stale == 0
    for version, batch in seen:
        for record in batch:
            sent, answered = record.turn_versions[0]
            assert sent == answered == record.policy_version_start
            assert weights_of(record) == sent  # the weights that sampled it are its version
            assert version - record.policy_version_start <= 1


async def test_admission_starts_no_group_that_would_be_dropped_as_stale(
    template: ChatTemplate, dispatcher: Dispatcher, tmp_path: Path
) -> None:
    """The trainer lets the pool run ahead before it takes the first batch: with drop at
    delivery the groups sampled meanwhile arrive stale; with admission none is started."""
    results: dict[bool, tuple[int, int]] = {}
    for admission in (False, True):
        async with rl_server() as server, PolicyServers(server.url) as servers:
            pool, sampler = pool_for(
                server, servers, template, dispatcher, max_staleness=1, admission=admission
            )
            async with sampler, pool.stream(PROMPTS, groups_per_batch=1) as batches:
                # Ahead: as many groups as the pool runs and buffers (or admits).
                ahead = 2 if admission else 6
                while pool.statistics().episodes_done < 2 * ahead:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                step = 0
                async for _batch in batches:
                    step += 1
                    await pool.update_weights(checkpoint(tmp_path, step))
            stats = pool.statistics()
            results[admission] = (stats.groups_stale, stats.groups_delivered)
            assert stats.groups_delivered + stats.groups_stale == len(PROMPTS)
    assert results[True] == (0, len(PROMPTS))
    assert results[False][0] > 0  # what admission saves: groups sampled for nothing


async def test_a_crash_between_an_update_and_the_next_checkpoint_loses_and_repeats_nothing(
    template: ChatTemplate, dispatcher: Dispatcher, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.json"
    committed: list[int] = []  # prompts of batches trained and checkpointed (run 1)
    async with rl_server() as server:
        async with PolicyServers(server.url) as servers:
            pool, sampler = pool_for(server, servers, template, dispatcher, max_staleness=1)
            ledger = ResumeLedger.open(path, num_prompts=len(PROMPTS))
            pending: list[int] = []

            async def train_then_crash() -> None:
                nonlocal pending
                async with (
                    sampler,
                    pool.stream(PROMPTS, ledger=ledger, groups_per_batch=2) as batches,
                ):
                    step = 0
                    async for batch in batches:
                        step += 1
                        pending = sorted({r.prompt_index for r in batch})
                        await pool.update_weights(checkpoint(tmp_path, step))
                        if step == 3:
                            raise RuntimeError("crash after the update, before the checkpoint")
                        batches.checkpoint(extra={"step": step})  # with the weights
                        committed.extend(pending)

            with pytest.raises(RuntimeError, match="crash"):
                await train_then_crash()
            assert server.weights == 3  # the servers hold the weights of the lost step
        # Resume: the ledger's checkpoint says step 2; the trainer restores its step-2 weights.
        ledger = ResumeLedger.open(path, num_prompts=len(PROMPTS))
        step = int(ledger.extra["step"])
        assert step == 2
        async with PolicyServers(server.url, version=3) as servers:
            pool, sampler = pool_for(server, servers, template, dispatcher, max_staleness=1)
            await pool.restore_weights(checkpoint(tmp_path, step), version=step)
            assert server.weights == 2
            resumed: list[int] = []
            async with sampler, pool.stream(PROMPTS, ledger=ledger, groups_per_batch=2) as batches:
                async for batch in batches:
                    for r in batch:  # sampled by the restored weights or later ones, as recorded
                        assert weights_of(r) == r.turn_versions[0][0] >= 2
                    resumed.extend(sorted({r.prompt_index for r in batch}))
                    step += 1
                    await pool.update_weights(checkpoint(tmp_path, step))
                    batches.checkpoint(extra={"step": step})
    assert sorted(committed + resumed) == list(range(len(PROMPTS)))  # none lost, none twice
    assert set(pending) <= set(resumed)  # the batch trained in the lost step is redone
