"""OpenAICompatiblePolicy against the scripted server on a real uvicorn: what it asks for,
what it refuses (no logprobs, no token ids: never a silently zeroed mask), non-finite logprobs
handled where they arrive, retries on 5xx and connection errors, the client-side timeout."""

from __future__ import annotations

import math
import time

import anyio
import pytest
from support.policy_server import END, PolicyServer, Reply, encode, policy_server_fixture, render
from support.ports import unused_port

from agent_backend.errors import NonFiniteLogprobs, PolicyError
from agent_backend.rollout.logprobs import NonFiniteCounters
from agent_backend.rollout.policy import (
    AssistantTurn,
    OpenAICompatiblePolicy,
    Policy,
    chat_completions_url,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
policy_server = policy_server_fixture

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "exec",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
MESSAGES = [{"role": "user", "content": "list the files"}]


def policy_for(server: PolicyServer, model: str, **options: object) -> OpenAICompatiblePolicy:
    options.setdefault("backoff", 0.01)
    return OpenAICompatiblePolicy(server.url, model=model, **options)  # type: ignore[arg-type]


def test_endpoint_url() -> None:
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert (
        chat_completions_url("http://h/x/v1/chat/completions") == "http://h/x/v1/chat/completions"
    )


async def test_asks_for_logprobs_top_logprobs_and_token_ids(policy_server: PolicyServer) -> None:
    model = policy_server.add("ask", [Reply("hello")])
    async with policy_for(policy_server, model, top_logprobs=2, max_tokens=64) as policy:
        assert isinstance(policy, Policy)
        await policy.generate(MESSAGES, TOOLS, max_tokens=32)
    [body] = policy_server.requests_for(model)
    assert body["logprobs"] is True
    assert body["top_logprobs"] == 2
    assert body["return_token_ids"] is True
    assert body["tools"] == TOOLS
    assert body["max_tokens"] == 32  # the smaller of the turn's bound and the policy's
    assert body["messages"] == MESSAGES
    with pytest.raises(ValueError, match="top_logprobs"):
        OpenAICompatiblePolicy(policy_server.url, top_logprobs=0)


async def test_structured_tool_calls_with_token_ids_and_logprobs(
    policy_server: PolicyServer,
) -> None:
    model = policy_server.add(
        "structured", [Reply("let me look", tool_calls=[("exec", {"command": "ls -la"})])]
    )
    async with policy_for(policy_server, model) as policy:
        turn = await policy.generate(MESSAGES, TOOLS)
    assert isinstance(turn, AssistantTurn)
    assert turn.prompt_ids == encode(render(MESSAGES, TOOLS))
    sampled = (
        'let me look<tool_call>{"name": "exec", "arguments": {"command": "ls -la"}}</tool_call>'
    )
    assert turn.completion_ids == encode(sampled + END)
    assert len(turn.logprobs) == len(turn.completion_ids) == len(turn.mask)
    assert all(lp < 0 and math.isfinite(lp) for lp in turn.logprobs)
    assert turn.mask == [1] * len(turn.completion_ids)
    assert turn.finish_reason == "tool_calls"
    assert turn.text == "let me look"
    [call] = turn.tool_calls
    assert (call.name, call.format, call.error) == ("exec", "openai", None)
    assert call.arguments == '{"command": "ls -la"}'
    assert turn.message["tool_calls"][0]["function"]["name"] == "exec"


async def test_hermes_tool_calls_in_text(policy_server: PolicyServer) -> None:
    model = policy_server.add(
        "hermes",
        [Reply("thinking", tool_calls=[("exec", {"command": "pwd"})], format="hermes")],
    )
    async with policy_for(policy_server, model) as policy:
        turn = await policy.generate(MESSAGES, TOOLS)
    [call] = turn.tool_calls
    assert (call.name, call.format, dict(call.arguments)) == ("exec", "hermes", {"command": "pwd"})
    assert turn.text == "thinking"
    assert "tool_calls" not in turn.message  # the text is kept as sampled, for the template
    assert "<tool_call>" in turn.message["content"]


@pytest.mark.parametrize("flavor", ["sglang", "sglext"])
async def test_sglang_token_id_locations(policy_server: PolicyServer, flavor: str) -> None:
    model = policy_server.add(f"flavor-{flavor}", [Reply("ok")], flavor=flavor)  # type: ignore[arg-type]
    async with policy_for(policy_server, model) as policy:
        turn = await policy.generate(MESSAGES, [])
    assert turn.prompt_ids == encode(render(MESSAGES, []))
    assert turn.completion_ids == encode("ok" + END)


@pytest.mark.parametrize(
    ("omit", "message"),
    [
        ("logprobs", "without logprobs"),
        ("token_ids", "without the completion's token ids"),
        ("prompt_token_ids", "without the prompt's token ids"),
    ],
)
async def test_missing_fields_are_errors_not_zeroed_masks(
    policy_server: PolicyServer, omit: str, message: str
) -> None:
    model = policy_server.add(f"omit-{omit}", [Reply("hi", omit=frozenset({omit}))])
    async with policy_for(policy_server, model) as policy:
        with pytest.raises(PolicyError, match=message) as caught:
            await policy.generate(MESSAGES, [])
        assert policy.statistics().failures == 1
        assert policy.statistics().retries == 0  # an unusable answer is not retried
    assert caught.value.status == 200
    assert caught.value.retryable is False


async def test_token_id_strings_are_a_fallback_for_completion_ids(
    policy_server: PolicyServer,
) -> None:
    model = policy_server.add("as-ids", [Reply("fine", omit=frozenset({"token_ids"}))])
    policy = policy_for(policy_server, model, extra_body={"return_tokens_as_token_ids": True})
    try:
        turn = await policy.generate(MESSAGES, [])
    finally:
        await policy.aclose()
    assert turn.completion_ids == encode("fine" + END)


@pytest.mark.parametrize("fault", ["nan_at", "inf_at", "null_at"])
async def test_non_finite_logprobs_masked(policy_server: PolicyServer, fault: str) -> None:
    model = policy_server.add(f"mask-{fault}", [Reply("abcdef", **{fault: (1, 4)})])  # type: ignore[arg-type]
    counters = NonFiniteCounters()
    async with policy_for(policy_server, model, non_finite="mask", counters=counters) as policy:
        turn = await policy.generate(MESSAGES, [])
    assert [i for i, m in enumerate(turn.mask) if m == 0] == [1, 4]
    assert turn.logprobs[1] == turn.logprobs[4] == 0.0
    assert all(math.isfinite(lp) for lp in turn.logprobs)
    assert turn.non_finite == 2
    assert turn.drop_error is None
    stats = counters.snapshot()
    assert (stats.non_finite_tokens, stats.masked_tokens) == (2, 2)


async def test_non_finite_logprobs_drop_and_fail(policy_server: PolicyServer) -> None:
    model = policy_server.add("nan-drop", [Reply("abcdef", nan_at=(3,))])
    async with policy_for(policy_server, model, non_finite="drop") as policy:
        turn = await policy.generate(MESSAGES, [])
    assert turn.drop_error is not None
    assert "non-finite" in turn.drop_error
    assert all(math.isfinite(lp) for lp in turn.logprobs)
    async with policy_for(policy_server, model, non_finite="fail") as policy:
        with pytest.raises(NonFiniteLogprobs) as caught:
            await policy.generate(MESSAGES, [])
    assert caught.value.positions == (3,)


async def test_5xx_is_retried_with_backoff(policy_server: PolicyServer) -> None:
    model = policy_server.add("flaky", [Reply("made it", fail_first=2)])
    async with policy_for(policy_server, model, max_retries=3) as policy:
        turn = await policy.generate(MESSAGES, [])
        stats = policy.statistics()
    assert turn.completion_ids == encode("made it" + END)
    assert (stats.requests, stats.retries, stats.failures) == (3, 2, 0)
    assert len(policy_server.requests_for(model)) == 3


async def test_5xx_gives_up_after_bounded_retries(policy_server: PolicyServer) -> None:
    model = policy_server.add("down", [Reply(status=502)])
    async with policy_for(policy_server, model, max_retries=2) as policy:
        with pytest.raises(PolicyError, match=r"HTTP 502.*gave up after 3 attempts") as caught:
            await policy.generate(MESSAGES, [])
    assert (caught.value.status, caught.value.retryable) == (502, True)
    assert len(policy_server.requests_for(model)) == 3


async def test_4xx_is_not_retried(policy_server: PolicyServer) -> None:
    async with policy_for(policy_server, "no-such-model", max_retries=3) as policy:
        with pytest.raises(PolicyError, match="HTTP 404") as caught:
            await policy.generate(MESSAGES, [])
    assert caught.value.retryable is False
    assert len(policy_server.requests_for("no-such-model")) == 1


async def test_connection_refused_is_retried_then_raised() -> None:
    url = f"http://127.0.0.1:{unused_port()}/v1"  # nothing listens there
    async with OpenAICompatiblePolicy(url, model="m", max_retries=2, backoff=0.01) as policy:
        with pytest.raises(PolicyError, match="ClientConnectorError") as caught:
            await policy.generate(MESSAGES, [])
        assert policy.statistics().requests == 3
    assert caught.value.retryable is True
    assert caught.value.status is None


async def test_client_side_timeout_bounds_a_slow_server(policy_server: PolicyServer) -> None:
    model = policy_server.add("slow", [Reply("late", delay=5.0)])
    started = time.monotonic()
    async with policy_for(policy_server, model, timeout=0.3, max_retries=1) as policy:
        with pytest.raises(PolicyError, match="timed out"):
            await policy.generate(MESSAGES, [])
    assert time.monotonic() - started < 3.0


async def test_length_finish_reason(policy_server: PolicyServer) -> None:
    model = policy_server.add("long", [Reply("x" * 100)])
    async with policy_for(policy_server, model) as policy:
        turn = await policy.generate(MESSAGES, [], max_tokens=10)
    assert turn.finish_reason == "length"
    assert len(turn.completion_ids) == 10 == len(turn.logprobs)


async def test_model_name_discovered_when_not_given(policy_server: PolicyServer) -> None:
    policy_server.add("discovered", [Reply("yes")])
    async with OpenAICompatiblePolicy(policy_server.url) as policy:
        await policy.generate(MESSAGES, [])
        assert policy.model is not None
        assert policy.model in {r["model"] for r in policy_server.requests}


async def test_aclose_is_idempotent_and_refuses_later_turns(policy_server: PolicyServer) -> None:
    policy = policy_for(policy_server, policy_server.add("closing", [Reply("x")]))
    await policy.aclose()
    await policy.aclose()
    with pytest.raises(PolicyError, match="closed"):
        await policy.generate(MESSAGES, [])
    assert "closed" in repr(policy)


async def test_concurrent_turns_share_one_client(policy_server: PolicyServer) -> None:
    model = policy_server.add("many", [Reply("same", delay=0.05)])
    async with policy_for(policy_server, model) as policy:
        turns: list[AssistantTurn] = []

        async def one() -> None:
            turns.append(await policy.generate(MESSAGES, []))

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for _ in range(16):
                group.start_soon(one)
        elapsed = time.monotonic() - started
    assert len(turns) == 16
    assert elapsed < 16 * 0.05  # concurrent, not one after another
