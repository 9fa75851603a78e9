"""Token-in/token-out episodes through the real vLLM CPU server, tools running for real.

Multi-turn episodes with a :class:`TokenPolicy` over :class:`VLLMTokenSampler`: the first
turn is guided (``structured_outputs``) so that a random model calls ``exec`` on the local
pool; the tool's output goes back as tokens; the next turn samples freely. Then the same
tiny model in transformers, teacher-forced on each record's whole token stream, must give
the sampler's logprobs on the sampled tokens: within 1e-3 where sampling was free (the
context the server conditioned on is exactly the recorded stream), and never below the
model's own where the grammar masked the distribution (guided logprobs are those of the
renormalised, masked distribution: documented in docs/rollouts.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import pydantic
import pytest
from support.policy_server import leftover_workspaces, local_dispatcher
from support.vllm_server import STARTUP_TIMEOUT, VLLMServer, vllm_server_fixture  # noqa: F401

from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    RolloutPool,
    TokenPolicy,
    Trajectory,
    VLLMTokenSampler,
)
from agent_backend.tools import ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(STARTUP_TIMEOUT + 120)]

EXEC_CALL = (
    r'<tool_call>\{"name": "exec", "arguments": \{"command": "echo [a-z]{2,8}"\}\}</tool_call>'
)


class FirstTurnGuided(VLLMTokenSampler):
    """Guides the first turn of each episode to an ``exec`` call; later turns sample freely."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_prompt_lengths: set[int] = set()

    def request_body(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> dict[str, Any]:
        body = super().request_body(prompt_ids, max_tokens=max_tokens)
        if len(prompt_ids) in self.first_prompt_lengths:
            # Guided ids come out a character at a time (`</tool_call>` as 8 tokens): room.
            body["structured_outputs"] = {"regex": EXEC_CALL}
            body["max_tokens"] = 160
        return body


def teacher_forced(model: Any, record: Trajectory) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) under the transformers model."""
    import torch

    stream = record.prompt_ids + record.completion_ids
    with torch.no_grad():
        logits = model(torch.tensor([stream])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(record.prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(record.completion_ids)]


def turn_spans(record: Trajectory) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of sampled tokens (mask 1): one per turn."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*record.completion_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


async def test_multi_turn_token_episodes_match_the_trainers_forward_pass(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    template = ChatTemplate.from_pretrained(str(vllm_server.model_dir))
    prompts = [{"prompt": f"print the word number {i} with exec, then explain"} for i in range(3)]
    async with (
        local_dispatcher(tmp_path / "ws") as dispatcher,
        FirstTurnGuided(
            vllm_server.url, model=vllm_server.model, max_tokens=40, extra_body={"seed": 17}
        ) as sampler,
    ):
        # exec alone: the tiny tokenizer spends ~1,200 tokens on its schema (2,048 of context).
        tools = [t for t in dispatcher.registry.to_openai() if t["function"]["name"] == "exec"]
        sampler.first_prompt_lengths = {
            len(template.prompt_ids([{"role": "user", "content": p["prompt"]}], tools))
            for p in prompts
        }
        pool = RolloutPool(
            TokenPolicy(sampler, template),
            dispatcher,
            tools=tools,
            n=2,
            concurrency=6,
            episode=EpisodeConfig(max_turns=2),
        )
        async with pool.stream(prompts, groups_per_batch=3) as stream:
            records = [t async for batch in stream for t in batch]
        stats = pool.statistics()
        assert stats.history_rewrites == 0
        assert stats.groups_failed == 0, stats
    assert leftover_workspaces(tmp_path / "ws") == []
    assert len(records) == 6  # one record per episode
    assert len({(r.prompt_index, r.sample_idx) for r in records}) == 6

    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype="float32").eval()
    free_errors: list[float] = []
    for record in records:
        assert record.stop_reason in ("length", "stop", "max_turns"), record.error
        assert (record.num_turns, record.tool_calls, record.tool_failures) == (2, 1, 0)
        tool_message = record.messages[2]
        assert tool_message["role"] == "tool"
        word = record.messages[1]["tool_calls"][0]["function"]["arguments"]
        assert tool_message["content"].strip() in word  # exec really ran: echo's output
        guided, free = turn_spans(record)
        reference = teacher_forced(model, record)
        sampler_lp = record.logprobs
        for i in range(*guided):  # masked distribution: renormalised, never below the model's
            assert sampler_lp[i] >= reference[i] - 1e-4
        free_errors.extend(abs(sampler_lp[i] - reference[i]) for i in range(*free))
    worst = max(free_errors)
    print(
        f"logprob agreement on {len(free_errors)} freely sampled tokens of 6 two-turn episodes: "
        f"max |vLLM - transformers| = {worst:.2e}"
    )
    assert worst < 1e-3


DIGIT_CALL = (
    r'<tool_call>\{"name": "exec", "arguments": \{"command": "echo [1-9] \| tee answer\.txt"\}\}'
    r"</tool_call>"
)


def test_trl_trains_on_token_episodes_sampled_by_the_real_server(
    vllm_server: VLLMServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's GRPOTrainer, its rollout_func a TRLRollout over vLLM: two steps on CPU.

    The server samples (guided to an ``exec`` call that writes a digit), exec runs on the local
    pool, a ToolReward reads the digit back; TRL's loss mask keeps the tool's tokens out and
    the weights move. The server is not given the new weights (docs/rollouts.md: staying
    on-policy), so only the first step is on-policy here.
    """
    trl = pytest.importorskip("trl")
    from test_integration_trl import (
        digit_reward,
        exec_only,
        grpo_config,
        pool_config,
        train,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_backend.integrations.trl import TRLRollout
    from agent_backend.rollout import ToolReward

    assert trl.__version__
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype="float32")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    class DigitFirst(VLLMTokenSampler):
        def request_body(
            self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
        ) -> dict[str, Any]:
            body = super().request_body(prompt_ids, max_tokens=max_tokens)
            if tokenizer.convert_tokens_to_ids("<tool_response>") not in prompt_ids:
                body["structured_outputs"] = {"regex": DIGIT_CALL}
                body["max_tokens"] = 160
            return body

    sampler = DigitFirst(vllm_server.url, model=vllm_server.model, max_tokens=8, temperature=2.0)
    policy = TokenPolicy(sampler, ChatTemplate(tokenizer))
    reward = ToolReward(("exec", {"command": "cat answer.txt"}), score=digit_reward)
    with TRLRollout(
        policy,
        tools=exec_only(),
        pool=pool_config(tmp_path),
        reward=reward,
        episode=EpisodeConfig(max_turns=2, timeout=120),
        concurrency=8,
    ) as rollout:
        args = grpo_config(tmp_path, per_device_train_batch_size=8, max_completion_length=256)
        trainer, recorder = train(
            model, tokenizer, rollout, [f"Pick a digit, {i}." for i in range(8)], args
        )
        assert trainer.state.global_step == 2
    assert leftover_workspaces(tmp_path / "ws") == []
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    for (prompts, out), scored in zip(recorder.calls, recorder.scored, strict=True):
        assert len(out["completion_ids"]) == len(prompts) == 8
        loss_mask = (scored["completion_mask"] * scored["tool_mask"]).tolist()
        for row, (ids, env) in enumerate(zip(out["completion_ids"], out["env_mask"], strict=True)):
            assert out["tool_calls"][row] == 1, out["error"][row]
            assert loss_mask[row][: len(ids)] == env
            assert loss_mask[row][ids.index(response)] == 0
            assert 0 < sum(env) < len(ids)
    changed = max(
        float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()
    )
    assert changed > 0


WORD_CALL = r'<tool_call>\{"name": "word", "arguments": \{"text": "[a-z]{1,8}"\}\}</tool_call>'


def word_registry() -> Any:
    """One tool whose arguments a random model cannot make long: a short lowercase word."""
    registry = ToolRegistry()

    @registry.tool
    def word(text: Annotated[str, pydantic.Field(pattern="^[a-z]{1,8}$")]) -> str:
        """Say a word back.

        Args:
            text: A short lowercase word.
        """
        return text.upper()

    return registry


async def test_chat_mode_splits_where_calls_are_re_rendered_and_token_mode_does_not(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    """Through the real server: the chat endpoint samples a call in its guided form and the
    template re-renders it as its own, so every later prompt stops extending the sampled
    tokens (one more record per turn); token in, token out keeps one record."""
    from agent_backend import DEFAULT_POOL, Dispatcher, load_pool
    from agent_backend.rollout import OpenAICompatiblePolicy, run_episode

    template = ChatTemplate.from_pretrained(str(vllm_server.model_dir))
    prompt = [{"role": "user", "content": "say three words"}]
    config = EpisodeConfig(max_turns=3)
    pool = DEFAULT_POOL.model_copy(update={"workspace_root": str(tmp_path / "ws")})
    async with load_pool(pool) as backend, Dispatcher(word_registry(), backend) as dispatcher:
        async with OpenAICompatiblePolicy(
            vllm_server.url,
            model=vllm_server.model,
            max_tokens=160,
            extra_body={"tool_choice": "required", "parallel_tool_calls": False, "seed": 5},
        ) as chat:
            chat_records = await run_episode(
                prompt, policy=chat, dispatcher=dispatcher, config=config
            )
        async with VLLMTokenSampler(
            vllm_server.url,
            model=vllm_server.model,
            max_tokens=160,
            extra_body={"structured_outputs": {"regex": WORD_CALL}, "seed": 5},
        ) as sampler:
            token_records = await run_episode(
                prompt, policy=TokenPolicy(sampler, template), dispatcher=dispatcher, config=config
            )
    for records in (chat_records, token_records):
        assert records[0].stop_reason == "max_turns", (records[0].error, records[0].messages)
        assert (records[0].num_turns, records[0].tool_calls, records[0].tool_failures) == (3, 2, 0)
    print(
        f"3-turn episode through vLLM: chat mode {len(chat_records)} records "
        f"({chat_records[0].extras.get('history_rewrites', 0)} history rewrites), "
        f"token in/token out {len(token_records)}"
    )
    assert len(chat_records) == 3
    assert chat_records[0].extras["history_rewrites"] == 2
    assert len(token_records) == 1
    assert "history_rewrites" not in token_records[0].extras
