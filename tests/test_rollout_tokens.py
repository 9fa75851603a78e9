"""Token-in/token-out episodes with a real tokenizer and chat template, tools run for real.

The sampler here is scripted (the fault-injection stand-in for a server: it returns the ids
it is told to); everything else is real: the tiny model's BPE tokenizer and chat templates
(tests/support/tiny_model.py) through transformers, the local pool, the episode loop. The real
server's side is tests/test_vllm_tokens.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from support.policy_server import local_dispatcher
from support.tiny_model import build_tiny_model

from agent_backend.errors import PolicyError
from agent_backend.rollout import (
    ChatTemplate,
    RolloutPool,
    SampledTokens,
    TokenPolicy,
    VLLMTokenSampler,
    run_episode,
)
from agent_backend.rollout.episode import EpisodeIds
from agent_backend.rollout.policy import AssistantTurn

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
transformers = pytest.importorskip("transformers", reason="token-in/token-out needs transformers")

PROMPT = [{"role": "user", "content": "add 2 and 3, then say the sum"}]
IDS = EpisodeIds(rollout_id="r-t", group_id="g-t", prompt_index=0, sample_idx=0)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate.from_pretrained(str(build_tiny_model(tmp_path_factory.mktemp("hermes"))))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    path = build_tiny_model(tmp_path_factory.mktemp("qwen3"), template="qwen3")
    return ChatTemplate.from_pretrained(str(path))


class ScriptedSampler:
    """Returns the completions it is given, as token ids of the real tokenizer; logs prompts."""

    def __init__(self, template: ChatTemplate, texts: Sequence[str], logprob: float = -0.5):
        self.completions = [template.encode(text) for text in texts]
        self.logprob = logprob
        self.prompts: list[list[int]] = []
        self._turn_start = template.encode("<|im_start|>assistant")

    def turn(self, prompt_ids: Sequence[int]) -> int:
        """Which turn of its episode a prompt asks for: its assistant turns so far."""
        mark, ids = self._turn_start, list(prompt_ids)
        starts = sum(ids[i : i + len(mark)] == mark for i in range(len(ids) - len(mark) + 1))
        return starts - 1

    async def sample(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> SampledTokens:
        self.prompts.append(list(prompt_ids))
        ids = self.completions[min(self.turn(prompt_ids), len(self.completions) - 1)]
        return SampledTokens(list(ids), [self.logprob] * len(ids), "stop")


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call><|im_end|>"


async def test_an_episode_is_one_record_whose_prompts_only_grow(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    texts = [
        "I will add." + call_text("add", {"a": 2, "b": "3"}),  # "3": repaired by the tool layer
        "The sum is 5.<|im_end|>",
    ]
    sampler = ScriptedSampler(hermes, texts)
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        tools = dispatcher.registry.to_openai()
        [record] = await run_episode(
            PROMPT, policy=TokenPolicy(sampler, hermes), dispatcher=dispatcher, ids=IDS
        )
    assert record.stop_reason == "stop", record.error
    assert (record.num_turns, record.tool_calls, record.tool_failures) == (2, 1, 0)
    first, second = sampler.prompts
    assert first == hermes.prompt_ids(PROMPT, tools) == record.prompt_ids
    # The second prompt extends the first with exactly what was sampled, then new tokens.
    assert second[: len(first) + len(sampler.completions[0])] == first + sampler.completions[0]
    sampled = [*sampler.completions[0], *sampler.completions[1]]
    assert [t for t, m in zip(record.completion_ids, record.completion_mask, strict=True) if m] == (
        sampled
    )
    assert record.prompt_ids + record.completion_ids == second + sampler.completions[1]
    assert sum(record.completion_mask) == len(sampled)
    # Each turn's sampled tokens, where they lie in the completion.
    [(a0, b0), (a1, b1)] = record.turn_spans
    assert (a0, b0 - a0) == (0, len(sampler.completions[0]))
    assert record.completion_ids[a1:b1] == sampler.completions[1]
    assert b1 == len(record.completion_ids)
    assert all(
        lp == (-0.5 if m else 0.0)
        for lp, m in zip(record.logprobs, record.completion_mask, strict=True)
    )
    # The tool's answer went back as tokens the template wraps: the text of the whole stream
    # is what a full render of the conversation gives (this template keeps history as is).
    appended = hermes.tokenizer.decode(second[len(first) + len(sampler.completions[0]) :])
    assert "<tool_response>" in appended
    assert "5" in appended
    assert record.messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert record.messages[2] == {
        "role": "tool",
        "tool_call_id": record.messages[1]["tool_calls"][0]["id"],
        "name": "add",
        "content": "5",
    }
    # Rendered in full with each assistant turn as the text it sampled, the conversation is
    # the stream: the continuations hold exactly the template's glue and wrappers.
    as_sampled = [
        {"role": "assistant", "content": hermes.tokenizer.decode(ids).removesuffix("<|im_end|>")}
        if m["role"] == "assistant"
        else m
        for m, ids in zip(
            record.messages,
            [[], sampler.completions[0], [], sampler.completions[1]],
            strict=True,
        )
    ]
    full = hermes.render_text(as_sampled, tools, add_generation_prompt=False)
    stream = hermes.tokenizer.decode(record.prompt_ids + record.completion_ids)
    assert stream == full.rstrip("\n")


def chat_server(template: ChatTemplate, sampler: ScriptedSampler) -> Any:
    """A stand-in for a chat endpoint: re-renders the whole conversation every turn."""

    class Chat:
        async def generate(
            self, messages: Sequence[Any], tools: Sequence[Any], *, max_tokens: int | None = None
        ) -> AssistantTurn:
            prompt = template.prompt_ids(messages, tools)
            sampled = await sampler.sample(prompt)
            message, prose, calls = template.assistant_message(sampled.token_ids)
            return AssistantTurn(
                message=message,
                text=prose,
                tool_calls=tuple(calls),
                prompt_ids=prompt,
                completion_ids=sampled.token_ids,
                logprobs=[float(v or 0.0) for v in sampled.logprobs],
                mask=[1] * len(sampled.token_ids),
                finish_reason="stop",
            )

    return Chat()


async def test_a_template_that_drops_earlier_reasoning_splits_chat_mode_but_not_tokens(
    qwen3: ChatTemplate, tmp_path: Path
) -> None:
    """What a model samples is rarely what its template re-renders: reasoning without the
    template's newlines, compact JSON in a call. A chat endpoint re-renders history every turn
    and the prompt ids drift (a new segment per turn); token-in/token-out never re-renders."""
    texts = [
        '<think>need the tool</think><tool_call>{"name":"add","arguments":{"a":1,"b":2}}'
        "</tool_call><|im_end|>",
        '<think>check</think>again<tool_call>{"name":"add","arguments":{"a":3,"b":0}}'
        "</tool_call><|im_end|>",
        "<think>done</think>It is 3.<|im_end|>",
    ]
    prompt = [{"role": "user", "content": "add 1 and 2"}]
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        chat = await run_episode(
            prompt,
            policy=chat_server(qwen3, ScriptedSampler(qwen3, texts)),
            dispatcher=dispatcher,
        )
        tito = await run_episode(
            prompt, policy=TokenPolicy(ScriptedSampler(qwen3, texts), qwen3), dispatcher=dispatcher
        )
    assert [r.stop_reason for r in chat] == ["stop"] * len(chat)
    assert len(chat) == 3
    assert chat[0].extras["history_rewrites"] == 2
    assert len(tito) == 1
    assert "history_rewrites" not in tito[0].extras
    [record] = tito
    assert record.stop_reason == "stop"
    assert record.num_turns == 3
    sampled = [t for t, m in zip(record.completion_ids, record.completion_mask, strict=True) if m]
    assert sampled == [t for text in texts for t in qwen3.encode(text)]


async def test_a_stop_without_the_end_of_turn_token_gets_it_as_an_unsampled_token(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    texts = [call_text("add", {"a": 1, "b": 1}).removesuffix("<|im_end|>"), "two<|im_end|>"]
    sampler = ScriptedSampler(hermes, texts)
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        [record] = await run_episode(
            PROMPT, policy=TokenPolicy(sampler, hermes), dispatcher=dispatcher
        )
    assert record.stop_reason == "stop", record.error
    first_len = len(sampler.completions[0])
    closing = record.completion_ids[first_len]
    assert closing == hermes.end_of_turn_id
    assert record.completion_mask[first_len] == 0


@pytest.mark.parametrize(
    ("non_finite", "stop_reason", "mask_zeros"),
    [("mask", "stop", 1), ("drop", "rollout_error", 1)],
)
async def test_non_finite_logprobs_are_handled_where_they_arrive(
    hermes: ChatTemplate, tmp_path: Path, non_finite: Any, stop_reason: str, mask_zeros: int
) -> None:
    class NaNSampler(ScriptedSampler):
        async def sample(
            self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
        ) -> SampledTokens:
            done = await super().sample(prompt_ids, max_tokens=max_tokens)
            return SampledTokens(done.token_ids, [float("nan"), *done.logprobs[1:]], "stop")

    sampler = NaNSampler(hermes, ["answer<|im_end|>"])
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        [record] = await run_episode(
            PROMPT,
            policy=TokenPolicy(sampler, hermes, non_finite=non_finite),
            dispatcher=dispatcher,
        )
    assert record.stop_reason == stop_reason
    assert record.completion_mask.count(0) == mask_zeros
    assert record.turn_spans == [(0, len(record.completion_ids))]  # the masked token stays in
    assert record.logprobs[0] == 0.0
    assert record.extras["non_finite_logprobs"] == 1


async def test_an_episode_policy_refuses_a_conversation_it_did_not_extend(
    hermes: ChatTemplate,
) -> None:
    episode = TokenPolicy(ScriptedSampler(hermes, ["a<|im_end|>"]), hermes).for_episode()
    await episode.generate(PROMPT, [])
    with pytest.raises(PolicyError, match="only append"):
        await episode.generate([*PROMPT, {"role": "assistant", "content": "a"}], [])


async def test_episodes_started_together_send_their_first_requests_together(
    hermes: ChatTemplate,
) -> None:
    # Each first prompt is rendered before any is sent (one trip through the event loop
    # between), so that a server sees them at once and prefills them in one step. Counted
    # in prompts rendered when each request is sent: the same verdict on any machine.
    rendered = 0
    seen_at_send: list[int] = []

    class Counting(ChatTemplate):
        def prompt_ids(self, *args: Any, **kwargs: Any) -> list[int]:
            nonlocal rendered
            rendered += 1
            return super().prompt_ids(*args, **kwargs)

    class Recording(ScriptedSampler):
        async def sample(
            self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
        ) -> SampledTokens:
            seen_at_send.append(rendered)
            return await super().sample(prompt_ids, max_tokens=max_tokens)

    template = Counting(hermes.tokenizer)
    policy = TokenPolicy(Recording(template, ["a<|im_end|>"]), template)
    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(policy.for_episode().generate, PROMPT, [])
    assert seen_at_send == [4, 4, 4, 4]


@contextlib.asynccontextmanager
async def completions_server(
    answer: Callable[[dict[str, Any]], dict[str, Any]],
) -> AsyncIterator[str]:
    """A real HTTP server on 127.0.0.1 answering ``/v1/completions`` with ``answer(body)``."""

    async def handle(request: web.Request) -> web.Response:
        return web.json_response(answer(await request.json()))

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_vllm_sampler_sends_token_ids_and_reads_ids_and_logprobs() -> None:
    seen: list[dict[str, Any]] = []

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        return {
            "choices": [
                {
                    "token_ids": [5, 6],
                    "logprobs": {"token_logprobs": [-0.1, -0.2]},
                    "finish_reason": "length",
                }
            ]
        }

    async with (
        completions_server(answer) as url,
        VLLMTokenSampler(url, model="m", max_tokens=8, extra_body={"seed": 1}) as sampler,
    ):
        out = await sampler.sample([1, 2, 3], max_tokens=4)
    assert out == SampledTokens([5, 6], [-0.1, -0.2], "length", versions=(0, 0))
    assert sampler.url == f"{url}/v1/completions"
    body = seen[0]
    assert body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == 4
    assert body["seed"] == 1
    assert body["return_token_ids"] is True
    assert body["logprobs"] == 1


@pytest.mark.parametrize(
    ("choice", "match"),
    [
        ({"logprobs": {"token_logprobs": [-0.1]}}, "token ids"),
        ({"token_ids": [1]}, "without logprobs"),
        ({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.1]}}, "align"),
    ],
)
async def test_the_vllm_sampler_refuses_what_a_trainer_cannot_use(
    choice: dict[str, Any], match: str
) -> None:
    async with (
        completions_server(lambda body: {"choices": [choice]}) as url,
        VLLMTokenSampler(url, model="m", max_tokens=4) as sampler,
    ):
        with pytest.raises(PolicyError, match=match):
            await sampler.sample([1])
    assert sampler.statistics().failures == 1


async def test_the_pool_counts_chat_drift_and_token_runs_have_none(
    qwen3: ChatTemplate, tmp_path: Path
) -> None:
    texts = [
        '<think>t</think><tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call><|im_end|>',
        "<think>d</think>3<|im_end|>",
    ]
    prompts = [{"prompt": f"add {i}"} for i in range(3)]
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        for policy, rewrites in [
            (chat_server(qwen3, ScriptedSampler(qwen3, texts)), 3 * 2),
            (TokenPolicy(ScriptedSampler(qwen3, texts), qwen3), 0),
        ]:
            pool = RolloutPool(policy, dispatcher, n=2, concurrency=4)
            async with pool.stream(prompts) as stream:
                records = [t async for batch in stream for t in batch]
            stats = pool.statistics()
            assert (stats.history_rewrites, stats.episodes_split) == (rewrites, rewrites)
            assert len(records) == 6 + rewrites  # one record per episode, plus one per rewrite


async def test_the_vllm_sampler_refuses_to_sample_without_a_token_bound() -> None:
    async with (
        completions_server(lambda body: {}) as url,
        VLLMTokenSampler(url, model="m") as sampler,
    ):
        with pytest.raises(PolicyError, match="16 tokens"):
            await sampler.sample([1])
