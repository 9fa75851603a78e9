"""TRL 1.16's real GRPOTrainer on CPU, its rollout_func an agent_backend TRLRollout.

A tiny random Qwen2 (tests/support/tiny_model.py) trains for real: its episodes call ``exec`` on the
local pool, TRL's loss mask keeps the tool tokens out, and the weights move. The fault matrix
runs through the same trainer: whatever happens to an episode, TRL gets exactly one row per
prompt entry, in order, never an empty one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
from support.policy_server import leftover_workspaces
from support.tiny_model import tiny_model_dir_fixture

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry, load_pool
from agent_backend.dispatch import builtin_tools
from agent_backend.errors import PolicyError, RolloutError
from agent_backend.integrations.trl import TRLRollout, trl_reward
from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    NonFinitePolicy,
    RewardInput,
    SampledTokens,
    TokenPolicy,
    ToolReward,
)

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

pytestmark = pytest.mark.timeout(180)
tiny_model_dir = tiny_model_dir_fixture


@pytest.fixture(autouse=True)
def _quiet_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    # rollout_func is experimental in TRL 1.16 and says so with a UserWarning (an error here).
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def pool_config(tmp_path: Path) -> Any:
    return DEFAULT_POOL.model_copy(
        update={"workspace_root": str(tmp_path / "ws"), "kill_grace": 0.5}
    )


def exec_only() -> ToolRegistry:
    """Only ``exec`` of the built-ins: the tool list in the system prompt stays short."""
    return ToolRegistry([t for t in builtin_tools() if t.name == "exec"])


def grpo_config(tmp_path: Path, **options: Any) -> Any:
    """The smallest GRPO run: CPU, nothing saved or reported."""
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 64,
        "max_steps": 2,
        "learning_rate": 1e-2,
        "beta": 0.0,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        "gradient_checkpointing": False,
    }
    settings.update(options)
    return trl.GRPOConfig(**settings)


def dataset(tasks: Sequence[str]) -> Any:
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in tasks]})


class Recorder:
    """Wraps the rollout (what TRL got back) and the trainer's scoring step (what TRL made of it)."""

    def __init__(self, rollout: TRLRollout) -> None:
        self.rollout = rollout
        self.calls: list[tuple[list[Any], dict[str, list[Any]]]] = []
        self.scored: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self.rollout(prompts, trainer)
        self.calls.append((list(prompts), out))
        return out

    def watch(self, trainer: Any) -> None:
        # The dict TRL's scoring step hands its loss: completion_mask, and tool_mask (env_mask).
        score = trainer._generate_and_score_completions

        def scored(inputs: Any) -> Any:
            output = score(inputs)
            self.scored.append(output)
            return output

        trainer._generate_and_score_completions = scored


def load_model(tokenizer: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path)


def train(
    model: Any, tokenizer: Any, rollout: TRLRollout, tasks: Sequence[str], args: Any
) -> tuple[Any, Recorder]:
    recorder = Recorder(rollout)
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=trl_reward,
        rollout_func=recorder,
        args=args,
        train_dataset=dataset(tasks),
    )
    recorder.watch(trainer)
    trainer.train()
    return trainer, recorder


# -- the real run: the model being trained samples, exec runs on the local pool ------------------


class GuidedSampler:
    """Samples from the model being trained (in this process: on-policy), under a grammar.

    Guided decoding, as vLLM's structured outputs do it: the first turn must be one ``exec``
    call ``echo D | tee answer.txt`` whose digit D the model samples; after a tool response
    the model writes freely (no new call), at most ``answer_tokens`` tokens or up to its end
    of turn. Logprobs are the processed ones (after the grammar's mask): 0.0 where the grammar
    left a single choice. ``temperature`` 2 makes two samples of a prompt pick the same digit
    a quarter of the time (at 1, this peaked random model does so 69% of the time).
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, answer_tokens: int = 6, temperature: float = 2.0
    ) -> None:
        def encode(text: str) -> list[int]:
            return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

        self.model = model
        self.eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.tool_response = int(tokenizer.convert_tokens_to_ids("<tool_response>"))
        self.banned = [int(tokenizer.convert_tokens_to_ids("<tool_call>"))]
        self.head = encode('<tool_call>{"name": "exec", "arguments": {"command": "echo ')
        self.tail = [*encode(' | tee answer.txt"}}</tool_call>'), self.eos]
        self.digits = [encode(str(d)) for d in range(1, 10)]
        assert all(len(d) == 1 for d in self.digits)
        self.answer_tokens = answer_tokens
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(0)
        self.lock = threading.Lock()
        self.calls = 0

    async def sample(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None) -> Any:
        return await anyio.to_thread.run_sync(self._sample, list(prompt_ids), max_tokens)

    def _sample(self, prompt_ids: list[int], max_tokens: int | None) -> SampledTokens:
        first_turn = self.tool_response not in prompt_ids
        limit = self.answer_tokens if max_tokens is None else min(max_tokens, self.answer_tokens)
        plan: list[list[int] | None] = (
            [[t] for t in self.head] + [[d[0] for d in self.digits]] + [[t] for t in self.tail]
            if first_turn
            else [None] * limit  # None: any token but the banned ones
        )
        tokens: list[int] = []
        logprobs: list[float | None] = []
        with self.lock, torch.no_grad():
            self.calls += 1
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            for allowed in plan:
                logits = out.logits[0, -1].float() / self.temperature
                if allowed is not None and len(allowed) == 1:
                    token, logprob = allowed[0], 0.0
                else:
                    if allowed is None:
                        logits[self.banned] = float("-inf")
                        choices = None
                    else:
                        choices = torch.tensor(allowed)
                        logits = logits[choices]
                    logp = torch.log_softmax(logits, dim=-1)
                    k = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                    token = int(choices[k]) if choices is not None else k
                    logprob = float(logp[k])
                tokens.append(token)
                logprobs.append(logprob)
                if token == self.eos:
                    break
                out = self.model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        finish = "stop" if tokens[-1] == self.eos else "length"
        return SampledTokens(token_ids=tokens, logprobs=logprobs, finish_reason=finish)


def digit_reward(result: Any) -> float:
    return int(result.output.strip()) / 9


def test_grpo_trains_on_agent_episodes_with_tools_masked(tokenizer: Any, tmp_path: Path) -> None:
    model = load_model(tokenizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sampler = GuidedSampler(model, tokenizer)
    policy = TokenPolicy(sampler, ChatTemplate(tokenizer))
    registry = exec_only()
    # The reward reads what the episode's own exec call wrote into its workspace.
    reward = ToolReward(("exec", {"command": "cat answer.txt"}), score=digit_reward)
    started = time.perf_counter()
    with TRLRollout(
        policy,
        tools=registry,
        pool=pool_config(tmp_path),
        reward=reward,
        episode=EpisodeConfig(max_turns=2, max_tokens_per_turn=48, timeout=60),
        concurrency=8,
    ) as rollout:
        # Four groups of two per step: at least one of the eight has two different digits
        # (all tie with probability 0.25**8), so GRPO has a signal and the weights move.
        args = grpo_config(tmp_path, per_device_train_batch_size=8)
        tasks = [f"Pick a digit, {i}." for i in range(8)]
        trainer, recorder = train(model, tokenizer, rollout, tasks, args)
        elapsed = time.perf_counter() - started
        assert trainer.state.global_step == 2
        assert rollout.last_statistics is not None
        assert rollout.last_statistics.episodes_done == 8
        assert rollout.last_statistics.tool_calls == 8
        assert rollout.dispatcher.statistics().sessions_open == 0
    assert leftover_workspaces(tmp_path / "ws") == []

    assert len(recorder.calls) == 2  # one generation per optimizer step
    response = tokenizer.convert_tokens_to_ids("<tool_response>")
    for (prompts, out), scored in zip(recorder.calls, recorder.scored, strict=True):
        assert len(prompts) == 8
        for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "reward"):
            assert len(out[key]) == 8, key
        # Each group is one prompt's samples, in TRL's order.
        assert [len(set(out["group_id"][i : i + 2])) for i in range(0, 8, 2)] == [1] * 4
        assert len(set(out["group_id"])) == 4
        assert out["sample_idx"] == [0, 1] * 4
        loss_mask = (scored["completion_mask"] * scored["tool_mask"]).tolist()
        for row, (ids, env) in enumerate(zip(out["completion_ids"], out["env_mask"], strict=True)):
            assert out["stop_reason"][row] in ("stop", "length")
            assert out["tool_calls"][row] == 1
            assert response in ids
            # TRL's loss mask is ours: 1 on sampled tokens, 0 on the tool's output and the
            # template around it, and 0 on its own padding.
            assert loss_mask[row][: len(ids)] == env
            assert not any(loss_mask[row][len(ids) :])
            tool_part = tokenizer.decode([t for t, m in zip(ids, env, strict=True) if not m])
            digit = round(out["reward"][row] * 9)
            assert f"<tool_response>\n{digit}\n" in tool_part
            assert 0 < sum(env) < len(ids)
            assert loss_mask[row][ids.index(response)] == 0
    # The weights moved, and every sampled turn came from the model being trained.
    changed = max(
        float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()
    )
    assert changed > 0
    assert sampler.calls == 2 * 8 * 2  # two steps, eight episodes, two turns
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"\nGRPO: 2 steps in {elapsed:.1f} s, losses {losses}, max |dparam| {changed:.3g}")
    assert len(losses) == 2


def test_what_the_adapter_opens_it_closes_and_an_open_dispatcher_stays_the_callers(
    tokenizer: Any, tmp_path: Path
) -> None:
    model = load_model(tokenizer)
    policy = TokenPolicy(GuidedSampler(model, tokenizer), ChatTemplate(tokenizer))
    trainer = trl.GRPOTrainer(  # TRL's own trainer object, as rollout_func gets it; not trained
        model=model,
        processing_class=tokenizer,
        reward_funcs=trl_reward,
        rollout_func=lambda prompts, trainer: {},
        args=grpo_config(tmp_path),
        train_dataset=dataset(["a"]),
    )
    prompts = [[{"role": "user", "content": "Pick a digit."}]] * 2
    config = pool_config(tmp_path)
    # Given unopened, the dispatcher and its pool are opened on the adapter's loop and closed.
    dispatcher = Dispatcher(exec_only(), load_pool(config))
    with pytest.raises(ValueError, match="not both"):
        TRLRollout(policy, tools=exec_only(), dispatcher=dispatcher)
    with TRLRollout(policy, dispatcher=dispatcher) as rollout:
        assert dispatcher.statistics().state == "open"
        out = rollout(prompts, trainer)
        with pytest.raises(ValueError, match="not 2 copies of one prompt"):
            rollout(
                [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], trainer
            )
    assert dispatcher.statistics().state == "closed"
    assert len(out["completion_ids"]) == 2
    assert out["sample_idx"] == [0, 1]
    rollout.close()  # idempotent
    with pytest.raises(RolloutError, match="closed"):
        rollout(prompts, trainer)
    with pytest.raises(ValueError, match="closed"):
        TRLRollout(policy, dispatcher=dispatcher)
    # Open on the caller's loop: it takes that loop's portal, and stays open.
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(load_pool(config)) as backend,
        portal.wrap_async_context_manager(Dispatcher(exec_only(), backend)) as theirs,
    ):
        with pytest.raises(ValueError, match="portal"):
            TRLRollout(policy, dispatcher=theirs)
        with TRLRollout(policy, dispatcher=theirs, portal=portal) as rollout:
            out = rollout(prompts, trainer)
        assert theirs.statistics().state == "open"
        assert len(out["env_mask"]) == 2
        assert all(out["env_mask"])
    assert leftover_workspaces(tmp_path / "ws") == []


# -- the fault matrix: a scripted sampler (fault injection only) ---------------------------------


class FaultSampler:
    """Emits token ids of the tiny tokenizer; what it does depends on the task in the prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.calls: dict[str, int] = {}
        self.never = anyio.Event()  # never set: a hang bounded by the episode's timeout

    def reply(self, text: str, *, nan_at: int | None = None) -> SampledTokens:
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
        logprobs: list[float | None] = [-0.5] * len(ids)
        if nan_at is not None:
            logprobs[nan_at] = float("nan")
        return SampledTokens(token_ids=ids, logprobs=logprobs, finish_reason="stop")

    @staticmethod
    def call(name: str, arguments: str = "{}") -> str:
        return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'

    async def sample(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None) -> Any:
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        task = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        turn = text.count("<tool_response>")
        seen = self.calls[task] = self.calls.get(task, 0) + 1
        echo = self.call("exec", '{"command": "echo ok"}')
        if task == "fail-all" or (task == "fail-first" and seen == 1):
            raise PolicyError("the policy server is down")
        if task in ("nan", "nan-all") or (task == "nan-first" and seen == 1):
            return self.reply("done", nan_at=0)
        if task == "loops":
            return self.reply(echo)
        if turn == 0:
            name = {"tool-raises": "explode", "tool-hangs": "hang"}.get(task)
            return self.reply(self.call(name) if name else echo)
        if task == "episode-hangs":
            await self.never.wait()
        return self.reply("done")


def fault_tools() -> ToolRegistry:
    registry = exec_only()

    @registry.tool
    def explode() -> str:
        """Raise, as a buggy tool does."""
        raise RuntimeError("boom")

    @registry.tool
    async def hang() -> str:
        """Never finish on its own (stopped at the episode's tool_timeout)."""
        await anyio.Event().wait()
        return "unreachable"

    return registry


def scored_reward(episode: RewardInput) -> float:
    return 1.0 if episode.stop_reason == "stop" else 0.5


FAULT_EPISODE = EpisodeConfig(max_turns=3, timeout=3.0, tool_timeout=0.5, failure_reward=-1.0)


def fault_run(
    tokenizer: Any, tmp_path: Path, tasks: list[str], non_finite: NonFinitePolicy
) -> tuple[dict[str, dict[str, list[Any]]], TRLRollout, FaultSampler]:
    sampler = FaultSampler(tokenizer)
    policy = TokenPolicy(sampler, ChatTemplate(tokenizer), non_finite=non_finite)
    with TRLRollout(
        policy,
        tools=fault_tools(),
        pool=pool_config(tmp_path),
        reward=scored_reward,
        episode=FAULT_EPISODE,
        concurrency=len(tasks) * 2,
    ) as rollout:
        args = grpo_config(tmp_path, per_device_train_batch_size=len(tasks) * 2, max_steps=1)
        trainer, recorder = train(load_model(tokenizer), tokenizer, rollout, tasks, args)
        assert trainer.state.global_step == 1  # no crash: the step trained
        assert rollout.dispatcher.statistics().sessions_open == 0
    assert leftover_workspaces(tmp_path / "ws") == []
    [(prompts, out)] = recorder.calls
    assert len(prompts) == len(tasks) * 2
    for key, values in out.items():
        assert len(values) == len(prompts), key
    assert all(ids for ids in out["completion_ids"])
    assert all(ids for ids in out["prompt_ids"])
    by_task: dict[str, dict[str, list[Any]]] = {}
    for row, prompt in enumerate(prompts):
        group = by_task.setdefault(prompt[0]["content"], {key: [] for key in out})
        for key, values in out.items():
            group[key].append(values[row])
    # TRL's loss mask is the rows' env_mask, placeholders all zero.
    [scored] = recorder.scored
    loss_mask = (scored["completion_mask"] * scored["tool_mask"]).tolist()
    for row, env in enumerate(out["env_mask"]):
        assert loss_mask[row][: len(env)] == env
    return by_task, rollout, sampler


def is_placeholder(group: dict[str, list[Any]], i: int, pad: int) -> bool:
    return (
        group["completion_ids"][i] == [pad]
        and group["prompt_ids"][i] == [pad]
        and group["env_mask"][i] == [0]
        and "placeholder" in group["extras"][i]
    )


def test_fault_matrix_through_grpo_gives_one_row_per_entry(tokenizer: Any, tmp_path: Path) -> None:
    tasks = [
        "ok",
        "fail-first",
        "fail-all",
        "tool-raises",
        "tool-hangs",
        "episode-hangs",
        "loops",
        "nan",
    ]
    groups, rollout, sampler = fault_run(tokenizer, tmp_path, tasks, "mask")
    pad = tokenizer.pad_token_id
    decode = tokenizer.decode

    def env_text(group: dict[str, list[Any]], i: int) -> str:
        ids, mask = group["completion_ids"][i], group["env_mask"][i]
        return decode([t for t, m in zip(ids, mask, strict=True) if not m])

    ok = groups["ok"]
    assert ok["stop_reason"] == ["stop", "stop"]
    assert ok["reward"] == [1.0, 1.0]
    assert all("<tool_response>\nok\n" in env_text(ok, i) for i in range(2))

    # Failed before its first turn: a placeholder beside its real sibling, the group's mean reward.
    first = groups["fail-first"]
    holes = [i for i in range(2) if is_placeholder(first, i, pad)]
    assert len(holes) == 1
    hole, real = holes[0], 1 - holes[0]
    assert first["stop_reason"][hole] == "rollout_error"
    assert "PolicyError" in first["error"][hole]
    assert first["reward"] == [1.0, 1.0]
    assert first["stop_reason"][real] == "stop"
    assert sum(first["env_mask"][real]) > 0

    # Every episode failed, twice (one group retry): the pool withheld the group; no record.
    missing = groups["fail-all"]
    assert all(is_placeholder(missing, i, pad) for i in range(2))
    assert missing["reward"] == [-1.0, -1.0]
    assert all("no record" in missing["error"][i] for i in range(2))
    assert sampler.calls["fail-all"] == 4
    assert rollout.last_statistics is not None
    assert rollout.last_statistics.groups_failed == 1

    # A tool that raised, a tool stopped at tool_timeout: the model read why, and went on.
    for task, said in (
        ("tool-raises", "the tool raised RuntimeError: boom"),
        ("tool-hangs", "did not finish within 0.5 s"),
    ):
        group = groups[task]
        assert group["stop_reason"] == ["stop", "stop"], task
        assert group["tool_failures"] == [1, 1], task
        assert all(said in env_text(group, i) for i in range(2)), task

    # Past the episode's timeout: real rows (the first turn was sampled), the failure reward.
    late = groups["episode-hangs"]
    assert late["stop_reason"] == ["timeout", "timeout"]
    assert late["reward"] == [-1.0, -1.0]
    assert not any(is_placeholder(late, i, pad) for i in range(2))
    assert all(all(late["env_mask"][i]) for i in range(2))  # turn 1 only: all sampled

    loops = groups["loops"]
    assert loops["stop_reason"] == ["max_turns", "max_turns"]
    assert loops["num_turns"] == [3, 3]
    assert loops["tool_calls"] == [2, 2]
    assert loops["reward"] == [0.5, 0.5]

    # A NaN logprob under "mask": the token stays, untrained (mask 0, logprob 0.0).
    nan = groups["nan"]
    assert nan["stop_reason"] == ["stop", "stop"]
    for i in range(2):
        assert nan["env_mask"][i][0] == 0
        assert nan["logprobs"][i][0] == 0.0
        assert all(nan["env_mask"][i][1:])
    stats = rollout.last_statistics
    assert stats.non_finite.masked_tokens == 2


def test_dropped_rollouts_become_placeholders(tokenizer: Any, tmp_path: Path) -> None:
    groups, rollout, _ = fault_run(tokenizer, tmp_path, ["nan-first", "nan-all"], "drop")
    pad = tokenizer.pad_token_id
    # One sample dropped for a NaN: its row is a placeholder with its sibling's reward.
    first = groups["nan-first"]
    holes = [i for i in range(2) if is_placeholder(first, i, pad)]
    assert len(holes) == 1
    assert first["reward"] == [1.0, 1.0]
    assert "no record" in first["error"][holes[0]]
    # Both dropped: the group is dropped, its rows placeholders with the failure reward.
    dropped = groups["nan-all"]
    assert all(is_placeholder(dropped, i, pad) for i in range(2))
    assert dropped["reward"] == [-1.0, -1.0]
    assert rollout.last_statistics is not None
    assert rollout.last_statistics.rollouts_dropped == 3
    assert rollout.last_statistics.groups_dropped == 1
