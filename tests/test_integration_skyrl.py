"""SkyRL's generator over agent_backend, checked by SkyRL's own code (``skyrl`` 0.4.0).

What is real: SkyRL's classes and functions (``InferenceEngineInterface``,
``TrajectoryID``, ``prepare_generator_input``, ``get_sampling_params_for_backend``,
``validate_generator_output``, ``concatenate_generator_outputs``, and its trainer's
``postprocess_generator_output``, ``convert_to_training_input`` and
``compute_advantages_and_returns``), the tiny model's tokenizer and chat templates
(tests/support/tiny_model.py), the local tool pool, the episode loop and the rollout pool. What
is scripted: the inference engine behind SkyRL's ``InferenceEngineInterface`` (vLLM on
a GPU cannot run here). It answers each prompt with the token ids its task's script
says, which is how the fault matrix is injected. The trainer's methods run on a
stand-in ``self`` that holds a real ``SkyRLTrainConfig``, the real tokenizer, and a
one-rank stand-in for the worker group (which needs GPUs).

SkyRL requires Python 3.12; the project's venv is 3.11, where
``agent_backend.integrations.skyrl`` imports it all the same (its module docstring says
how). Installed with ``pip install --no-deps --ignore-requires-python skyrl==0.4.0
skyrl-gym==0.4.0 cloudpathlib loguru pybase64 jaxtyping wadler-lindig``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import types
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from support.policy_server import leftover_workspaces, local_dispatcher
from support.tiny_model import build_tiny_model
from support.vllm_server import STARTUP_TIMEOUT, VLLMServer, vllm_server_fixture  # noqa: F401

from agent_backend import DEFAULT_POOL, ToolRegistry
from agent_backend.errors import PolicyError, RolloutError
from agent_backend.rollout import AssistantTurn, ChatTemplate, EpisodeConfig, ToolReward

if importlib.util.find_spec("skyrl") is None:  # pragma: no cover - the venv has it
    if os.environ.get("CI") == "true":
        pytest.fail("CI=true and skyrl is not installed (see this module's docstring)")
    pytest.skip("skyrl is not installed (see this module's docstring)", allow_module_level=True)

# First: on Python 3.11 SkyRL imports only through the integration (its module docstring).
integration = importlib.import_module("agent_backend.integrations.skyrl")
AgentBackendGenerator = integration.AgentBackendGenerator
SkyRLTokenSampler = integration.SkyRLTokenSampler

from skyrl.backends.skyrl_train.inference_servers.base import (  # noqa: E402
    InferenceEngineInterface,
    InferenceEngineOutput,
)
from skyrl.backends.skyrl_train.inference_servers.engine_utils import (  # noqa: E402
    get_sampling_params_for_backend,
)
from skyrl.train.config import SamplingParams, SkyRLTrainConfig  # noqa: E402
from skyrl.train.generators.base import GeneratorInterface  # noqa: E402
from skyrl.train.generators.utils import (  # noqa: E402
    concatenate_generator_outputs,
    prepare_generator_input,
)
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402
from skyrl.train.utils.trainer_utils import validate_generator_output  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

REWARD = ToolReward(("exec", {"command": "grep -q 42 a.txt"}))  # runs in the episode's workspace
EPISODE = EpisodeConfig(max_turns=3, timeout=6.0, tool_timeout=1.0, max_tool_failures=2)


@pytest.fixture(scope="module", autouse=True)
def without_ray() -> Iterator[None]:
    """skyrl's trainer code syncs its registries to a Ray actor whenever Ray is initialized.

    The session's test cluster (tests/support/ray_fixtures.py, started by whichever module needs it
    first) would make it do so here, and that actor's import of ``skyrl.tinker.types`` fails on
    Python 3.11 (a ``typing.TypedDict`` pydantic refuses before 3.12). These tests run skyrl's
    trainer without Ray, as on a single CPU box; the next module that needs Ray starts it again.
    """
    try:
        import ray
    except ImportError:
        yield
        return
    if ray.is_initialized():
        ray.shutdown()
    yield


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate.from_pretrained(str(build_tiny_model(tmp_path_factory.mktemp("hermes"))))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    path = build_tiny_model(tmp_path_factory.mktemp("qwen3"), template="qwen3")
    return ChatTemplate.from_pretrained(str(path))


def call(name: str, arguments: Mapping[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call><|im_end|>"


WRITE = call("write_file", {"path": "a.txt", "content": "42"})
DONE = "Done.<|im_end|>"


class EngineDown(RuntimeError):
    pass


#: What the engine answers, by the task named in the prompt and the turn: (text, finish
#: reason, logprob of the first token); an exception class is raised instead.
Step = tuple[str, str, float] | type[BaseException] | None
SCRIPTS: dict[str, Callable[[int, int], Step]] = {
    "write": lambda turn, seen: ((WRITE, "stop", -0.5), (DONE, "stop", -0.5))[min(turn, 1)],
    # The first request of the task fails: that episode ends before its first turn.
    "fail_once": lambda turn, seen: (
        EngineDown if seen == 0 else ((WRITE, "stop", -0.5), (DONE, "stop", -0.5))[min(turn, 1)]
    ),
    # Every request fails: the whole group fails, is sampled again, and is left out.
    "engine_down": lambda turn, seen: EngineDown,
    "tool_error": lambda turn, seen: (call("exec", {"command": "exit 3"}), "stop", -0.5),
    "tool_timeout": lambda turn, seen: (
        (call("exec", {"command": "sleep 30"}), "stop", -0.5),
        ("gave up<|im_end|>", "stop", -0.5),
    )[min(turn, 1)],
    # The second turn never answers: the episode's timeout ends it, with its first turn.
    "episode_timeout": lambda turn, seen: (WRITE, "stop", -0.5) if turn == 0 else None,
    "max_turns": lambda turn, seen: (call("add", {"a": 1, "b": 2}), "stop", -0.5),
    "nan": lambda turn, seen: ("four two<|im_end|>", "stop", math.nan),
    "length": lambda turn, seen: ("and so on and so", "length", -0.5),
    "unknown_tool": lambda turn, seen: (
        (call("nope", {}), "stop", -0.5),
        ("sorry<|im_end|>", "stop", -0.5),
    )[min(turn, 1)],
}


class ScriptedEngine(InferenceEngineInterface):  # type: ignore[misc]
    """SkyRL's engine interface, answering from :data:`SCRIPTS` with the tiny tokenizer's ids."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.requests: list[dict[str, Any]] = []
        self.seen: Counter[str] = Counter()
        self.logprobs = True
        self.weight_version = 7  # as RemoteInferenceClient counts weight syncs

    @property
    def model_name(self) -> str:
        return "tiny"

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        [prompt] = input_batch["prompt_token_ids"]
        self.requests.append({"prompt": list(prompt), **input_batch, "model": model})
        text = self.template.tokenizer.decode(prompt)
        task = re.search(r"task:(\w+)", text).group(1)  # type: ignore[union-attr]
        turn = text.count("<|im_start|>assistant") - 1
        step = SCRIPTS[task](turn, self.seen[task])
        self.seen[task] += 1
        if step is None:
            await anyio.sleep_forever()
        if isinstance(step, type):
            raise step(f"engine down for {task}")
        assert isinstance(step, tuple)
        completion, finish, first = step
        ids = self.template.encode(completion)
        max_tokens = input_batch["sampling_params"].get("max_tokens")
        if max_tokens is not None and len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        logprobs = [first] + [-0.25] * (len(ids) - 1)
        return InferenceEngineOutput(
            responses=[self.template.tokenizer.decode(ids)],
            response_ids=[ids],
            stop_reasons=[finish],
            response_logprobs=[logprobs] if self.logprobs else None,
            prompt_logprobs=None,
            rollout_expert_indices=None,
            rollout_sample_support=None,
        )

    def get_endpoint_url(self) -> str:
        raise NotImplementedError

    async def chat_completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def render_chat_completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def completion(self, request_payload: Any) -> Any:
        raise NotImplementedError

    async def wake_up(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def sleep(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def update_named_weights(self, request: Any) -> Any:
        raise NotImplementedError

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> Any:
        raise NotImplementedError

    async def teardown(self) -> None:
        raise NotImplementedError

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> Any:
        raise NotImplementedError

    async def pause_generation(self) -> None:
        raise NotImplementedError

    async def resume_generation(self) -> None:
        raise NotImplementedError

    async def finish_session(self, session_id: str) -> None:
        raise NotImplementedError

    async def get_world_size(self) -> tuple[int, int]:
        raise NotImplementedError


def generator_input(tasks: Sequence[str], n: int, *, step: int = 3) -> Any:
    """SkyRL's own GeneratorInput for one prompt per task, ``n`` samples each."""
    prompts = [
        {
            "prompt": [{"role": "user", "content": f"Put 42 in a.txt. task:{task}"}],
            "env_class": "agent_backend",
            "env_extras": {"task": task},
            "uid": f"uid-{task}",
        }
        for task in tasks
    ]
    sampling = get_sampling_params_for_backend("vllm", SamplingParams(max_generate_length=96))
    batch, uids = prepare_generator_input(prompts, n, sampling, "agent_backend", "train", step)
    assert uids == [f"uid-{t}" for t in tasks for _ in range(n)]
    return batch


def trainer_self(tokenizer: Any, *, prompts: int, n: int, step_wise: bool = False) -> Any:
    """What RayPPOTrainer's data methods read of ``self``: a real config, the real tokenizer."""
    cfg = SkyRLTrainConfig()
    cfg.trainer.train_batch_size = cfg.trainer.policy_mini_batch_size = prompts
    cfg.generator.n_samples_per_prompt = n
    cfg.generator.step_wise_trajectories = step_wise
    one_rank = types.SimpleNamespace(get_lcm_dp_size=lambda: 1)
    return types.SimpleNamespace(cfg=cfg, tokenizer=tokenizer, all_metrics={}, dispatch=one_rank)


def train_step(tokenizer: Any, output: Any, uids: list[str], *, n: int, step_wise: bool) -> Any:
    """SkyRL's trainer from generator output to advantages, on a stand-in self."""
    me = trainer_self(tokenizer, prompts=len(set(uids)), n=n, step_wise=step_wise)
    output, uids = RayPPOTrainer.postprocess_generator_output(me, output, uids)
    data = RayPPOTrainer.convert_to_training_input(me, output, uids)
    data["values"] = None  # GRPO has no critic
    return RayPPOTrainer.compute_advantages_and_returns(me, data)


def check_rows(output: Any, batch: Any) -> None:
    """What every output must be, whatever went wrong in its episodes."""
    rows = len(output["response_ids"])
    for key in ("prompt_token_ids", "rewards", "loss_masks", "rollout_logprobs", "stop_reasons"):
        assert len(output[key]) == rows, key
    for prompt, response, mask, logprobs in zip(
        output["prompt_token_ids"],
        output["response_ids"],
        output["loss_masks"],
        output["rollout_logprobs"],
        strict=True,
    ):
        assert prompt, "a row without prompt tokens"
        assert response, "a row without response tokens"
        assert len(mask) == len(logprobs) == len(response)
        assert set(mask) <= {0, 1}
        assert all(math.isfinite(lp) for lp in logprobs)
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    for reward in output["rewards"]:
        assert all(math.isfinite(r) for r in (reward if isinstance(reward, list) else [reward]))
    if output["is_last_step"] is None:
        assert output["trajectory_ids"] == batch["trajectory_ids"]  # echoed, same order


def by_task(output: Any, n: int) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {}
    for i, tid in enumerate(output["trajectory_ids"]):
        rows.setdefault(tid.instance_id.removeprefix("uid-"), []).append(i)
    return rows


async def test_the_fault_matrix_gives_one_valid_row_per_prompt(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    n = 2
    batch = generator_input(list(SCRIPTS), n)
    engine = ScriptedEngine(hermes)
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        generator = AgentBackendGenerator(
            inference_engine_client=engine,
            tokenizer=hermes.tokenizer,
            model="tiny-lora",
            dispatcher=dispatcher,
            reward=REWARD,
            episode=EPISODE,
        )
        assert isinstance(generator, GeneratorInterface)
        with anyio.fail_after(60):
            output = await generator.generate(batch)
        await generator.aclose()
        assert dispatcher.statistics().sessions_open == 0
    assert leftover_workspaces(tmp_path / "ws") == []

    validate_generator_output(len(batch["prompts"]), output)  # SkyRL's own checks
    check_rows(output, batch)
    assert len(output["response_ids"]) == len(SCRIPTS) * n
    rows = by_task(output, n)
    reasons = {task: [output["stop_reasons"][i] for i in idx] for task, idx in rows.items()}
    rewards = {task: [output["rewards"][i] for i in idx] for task, idx in rows.items()}
    trained = {task: [sum(output["loss_masks"][i]) for i in idx] for task, idx in rows.items()}
    extras = {task: [output["env_metrics"][i] for i in idx] for task, idx in rows.items()}

    assert reasons["write"] == ["stop", "stop"]
    assert rewards["write"] == [1.0, 1.0]
    # One episode failed before its first turn: a mask-0 row with its group's mean reward.
    assert sorted(reasons["fail_once"]) == ["rollout_error", "stop"]
    assert rewards["fail_once"] == [1.0, 1.0]
    assert sorted(m["placeholder"] for m in extras["fail_once"]) == [False, True]
    assert min(trained["fail_once"]) == 0
    # The group the engine never answered has no record: two mask-0 rows, failure reward.
    assert trained["engine_down"] == [0, 0]
    assert rewards["engine_down"] == [0.0, 0.0]
    assert all(m["placeholder"] and "no record" in m["error"] for m in extras["engine_down"])
    assert reasons["tool_error"] == ["tool_error"] * 2
    assert all(m["tool_failures"] == 2 for m in extras["tool_error"])
    assert all(t > 0 for t in trained["tool_error"]), "its sampled tokens are trained on"
    assert reasons["tool_timeout"] == ["stop"] * 2
    assert all(m["tool_failures"] == 1 for m in extras["tool_timeout"])
    assert reasons["episode_timeout"] == ["timeout"] * 2
    assert all(t > 0 for t in trained["episode_timeout"])
    assert reasons["max_turns"] == ["max_turns"] * 2
    assert all(m["num_turns"] == EPISODE.max_turns for m in extras["max_turns"])
    assert reasons["length"] == ["length"] * 2
    assert reasons["unknown_tool"] == ["stop"] * 2
    assert all(m["tool_failures"] == 1 for m in extras["unknown_tool"])
    # A NaN logprob (non_finite="mask"): that token is in the row, masked, logprob 0.0.
    for i in rows["nan"]:
        assert output["loss_masks"][i][0] == 0
        assert output["rollout_logprobs"][i][0] == 0.0
        assert sum(output["loss_masks"][i]) == len(output["response_ids"][i]) - 1

    metrics = output["rollout_metrics"]
    assert metrics["agent_backend/episodes"] == len(SCRIPTS) * n
    assert metrics["agent_backend/placeholder_rows"] == 3
    assert metrics["agent_backend/non_finite_logprobs"] == n
    assert metrics["agent_backend/stop_reason/timeout"] == n
    assert "generate/avg_num_tokens" in metrics  # SkyRL's own metrics too
    # Records carry the engines' weight version (placeholders of missing groups: none).
    versions = {
        m["policy_version"] for m in output["env_metrics"] if "no record" not in (m["error"] or "")
    }
    assert versions == {7}

    # The engine got token ids, the batch's sampling params, the served name, and logprobs.
    assert all(r["sampling_params"]["logprobs"] == 1 for r in engine.requests)
    assert all(r["model"] == "tiny-lora" for r in engine.requests)
    assert all(r["sampling_params"]["max_tokens"] == 96 for r in engine.requests)

    # SkyRL's trainer takes it from there: per-token rewards, padded tensors, GRPO advantages.
    uids = [tid.instance_id for tid in output["trajectory_ids"]]
    data = train_step(hermes.tokenizer, output, uids, n=n, step_wise=False)
    assert data["sequences"].shape[0] == len(SCRIPTS) * n
    loss_mask = data["loss_mask"]
    assert int(loss_mask.sum()) == sum(sum(m) for m in output["loss_masks"])
    assert all(math.isfinite(float(a)) for a in data["advantages"].flatten())


async def test_calls_from_several_tasks_share_the_pool_the_generator_opened(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    # As SkyRL's fully async trainer: generate() from several tasks at once, one group each.
    config = {"workspace_root": str(tmp_path / "ws"), "kill_grace": 0.5}
    generator = AgentBackendGenerator(
        inference_engine_client=ScriptedEngine(hermes),
        tokenizer=hermes.tokenizer,
        pool=DEFAULT_POOL.model_copy(update=config),
        reward=REWARD,
        episode=EPISODE,
    )
    outputs: dict[str, Any] = {}

    async def one(task: str) -> None:
        outputs[task] = await generator.generate(generator_input([task], 2, step=1))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                for task in ("write", "fail_once", "max_turns"):
                    tasks.start_soon(one, task)
            again = await generator.generate(generator_input(["write"], 2, step=2))
    finally:
        await generator.aclose()
    await generator.aclose()  # idempotent
    assert leftover_workspaces(tmp_path / "ws") == []
    # SkyRL concatenates the groups and validates the result.
    order = ("write", "fail_once", "max_turns")
    merged = concatenate_generator_outputs([*(outputs[t] for t in order), again])
    assert [t.instance_id for t in merged["trajectory_ids"]] == [
        f"uid-{task}" for task in (*order, "write") for _ in range(2)
    ]
    with pytest.raises(RolloutError, match="closed"):
        await generator.generate(generator_input(["write"], 1))


async def test_a_dropped_rollout_is_a_mask_zero_row(hermes: ChatTemplate, tmp_path: Path) -> None:
    batch = generator_input(["write", "nan"], 2)
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        generator = AgentBackendGenerator(
            inference_engine_client=ScriptedEngine(hermes),
            tokenizer=hermes.tokenizer,
            dispatcher=dispatcher,
            reward=REWARD,
            episode=EPISODE,
            non_finite="drop",
            token_level_rewards=True,
            max_failed_groups=None,
        )
        with anyio.fail_after(60):
            output = await generator.generate(batch)
    validate_generator_output(len(batch["prompts"]), output)
    check_rows(output, batch)
    rows = by_task(output, 2)
    assert [sum(output["loss_masks"][i]) for i in rows["nan"]] == [0, 0]
    assert all(output["env_metrics"][i]["placeholder"] for i in rows["nan"])
    assert output["rollout_metrics"]["agent_backend/rollouts_dropped"] >= 2
    # Token-level rewards: one list per row, the reward on its last token.
    for i in rows["write"]:
        assert output["rewards"][i][-1] == 1.0
        assert sum(output["rewards"][i]) == 1.0


class ChatPolicy:
    """A chat endpoint's way: the whole conversation re-rendered every turn (qwen3 drops and
    re-renders reasoning, so the token stream restarts: segments). Samples through SkyRL."""

    def __init__(self, template: ChatTemplate, sampler: SkyRLTokenSampler) -> None:
        self.template = template
        self.sampler = sampler

    async def generate(
        self, messages: Sequence[Any], tools: Sequence[Any], *, max_tokens: int | None = None
    ) -> AssistantTurn:
        prompt = self.template.prompt_ids(messages, tools)
        sampled = await self.sampler.sample(prompt, max_tokens=max_tokens)
        message, prose, calls = self.template.assistant_message(sampled.token_ids)
        logprobs = [float(lp) for lp in sampled.logprobs if lp is not None]
        return AssistantTurn(
            message=message,
            text=prose,
            tool_calls=tuple(calls),
            prompt_ids=prompt,
            completion_ids=list(sampled.token_ids),
            logprobs=logprobs,
            mask=[1] * len(logprobs),
            finish_reason=sampled.finish_reason,
        )


async def test_step_wise_rows_are_segments_that_skyrl_trains_on(
    qwen3: ChatTemplate, tmp_path: Path
) -> None:
    # "<think>plan</think>" comes back re-rendered as "<think>\nplan\n</think>\n\n": each
    # turn after a reasoning turn starts a new segment.
    think_write = "<think>plan</think>" + WRITE
    SCRIPTS["think"] = lambda turn, seen: ((think_write, "stop", -0.5), (DONE, "stop", -0.5))[
        min(turn, 1)
    ]
    try:
        n = 2
        batch = generator_input(["think", "write", "engine_down"], n)
        sampler = SkyRLTokenSampler(ScriptedEngine(qwen3), sampling_params=batch["sampling_params"])
        async with local_dispatcher(tmp_path / "ws") as dispatcher:
            generator = AgentBackendGenerator(
                policy=ChatPolicy(qwen3, sampler),
                placeholder_token_id=qwen3.tokenizer.pad_token_id,
                dispatcher=dispatcher,
                reward=REWARD,
                episode=EPISODE,
                step_wise=True,
            )
            with anyio.fail_after(60):
                output = await generator.generate(batch)
    finally:
        del SCRIPTS["think"]
    # SkyRL's step-wise checks: is_last_step, ids present and contiguous, boundaries agree.
    validate_generator_output(len(batch["prompts"]), output, step_wise=True)
    check_rows(output, batch)
    ids = [t.to_string() for t in output["trajectory_ids"]]
    last = output["is_last_step"]
    assert sum(last) == len(batch["prompts"]), "one last step per episode"
    episodes = [tid.to_string() for tid in batch["trajectory_ids"]]
    assert list(dict.fromkeys(ids)) == episodes, "episodes in order, each one's steps together"
    steps = Counter(ids)
    assert [steps[e] for e in episodes[:2]] == [2, 2], "the reasoning episode has two segments"
    assert [steps[e] for e in episodes[2:]] == [1, 1, 1, 1]
    for i, is_last in enumerate(last):
        if not is_last:
            assert output["rewards"][i] == 0.0
    # Without an engine client, the policy version is the batch's global step.
    assert {m["policy_version"] for m in output["env_metrics"][:4]} == {3}
    # Per turn too: each real row's turns were sent and answered at that version.
    for m in output["env_metrics"][:4]:
        assert m["policy_version_end"] == 3
        assert m["turn_versions"]
        assert all(v == [3, 3] for v in m["turn_versions"])
    # SkyRL's trainer, step-wise: advantages from each episode's last step, broadcast.
    uids = [t.instance_id for t in output["trajectory_ids"]]
    data = train_step(qwen3.tokenizer, output, uids, n=n, step_wise=True)
    assert data["advantages"].shape[0] == len(ids)


async def test_the_sampler_asks_for_logprobs_and_refuses_an_answer_without_them(
    hermes: ChatTemplate,
) -> None:
    engine = ScriptedEngine(hermes)
    prompt = hermes.prompt_ids([{"role": "user", "content": "task:write"}], [])
    sampler = SkyRLTokenSampler(engine, sampling_params={"max_tokens": 64, "logprobs": None})
    sampled = await sampler.sample(prompt, max_tokens=8)
    assert engine.requests[-1]["sampling_params"] == {"max_tokens": 8, "logprobs": 1}
    assert len(sampled.token_ids) == len(sampled.logprobs) == 8
    assert sampled.finish_reason == "length"
    engine.logprobs = False
    with pytest.raises(PolicyError, match="no response_logprobs"):
        await sampler.sample(prompt)
    with pytest.raises(ValueError, match="n must be 1"):
        SkyRLTokenSampler(engine, sampling_params={"n": 2})
    engine.logprobs = True
    failing = SkyRLTokenSampler(engine)
    with pytest.raises(PolicyError, match="EngineDown"):
        await failing.sample(
            hermes.prompt_ids([{"role": "user", "content": "task:engine_down"}], [])
        )


def test_the_generator_refuses_what_it_cannot_use(hermes: ChatTemplate) -> None:
    engine = ScriptedEngine(hermes)
    with pytest.raises(ValueError, match="one of them"):
        AgentBackendGenerator()
    with pytest.raises(ValueError, match="needs its tokenizer"):
        AgentBackendGenerator(inference_engine_client=engine)
    with pytest.raises(ValueError, match="placeholder_token_id"):
        AgentBackendGenerator(policy=ChatPolicy(hermes, SkyRLTokenSampler(engine)))
    ok = AgentBackendGenerator(inference_engine_client=engine, tokenizer=hermes)
    assert ok.placeholder_token_id == hermes.tokenizer.pad_token_id


async def run_on_real_engines(url: str, model: str, model_dir: Path, workspaces: Path) -> Any:
    """The generator over SkyRL's own HTTP client, against a real vLLM serving the tiny model."""
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )

    template = ChatTemplate.from_pretrained(str(model_dir))
    client = RemoteInferenceClient(
        proxy_url=url,
        server_urls=[url],
        data_parallel_size=1,
        model_name=model,
        tokenizer=template.tokenizer,
    )
    batch = generator_input(["real"], 2)
    batch["sampling_params"]["max_tokens"] = 12
    tools = ToolRegistry()  # one small tool: the served context is 2048 tokens

    @tools.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: First.
            b: Second.
        """
        return a + b

    generator = AgentBackendGenerator(
        inference_engine_client=client,
        tokenizer=template.tokenizer,
        tools=tools,
        pool=DEFAULT_POOL.model_copy(update={"workspace_root": str(workspaces)}),
        episode=EpisodeConfig(max_turns=2, timeout=120),
    )
    try:
        with anyio.fail_after(120):
            output = await generator.generate(batch)
    finally:
        await generator.aclose()
        await client.aclose()
    assert leftover_workspaces(workspaces) == []
    validate_generator_output(len(batch["prompts"]), output)
    check_rows(output, batch)
    for mask, logprobs in zip(output["loss_masks"], output["rollout_logprobs"], strict=True):
        sampled = [lp for lp, m in zip(logprobs, mask, strict=True) if m]
        assert sampled, "the engine's tokens are trained on"
        assert all(lp < 0.0 for lp in sampled), "with the engine's logprobs"
    uids = [tid.instance_id for tid in output["trajectory_ids"]]
    train_step(template.tokenizer, output, uids, n=2, step_wise=False)
    return output


@pytest.mark.timeout(STARTUP_TIMEOUT + 180)
async def test_on_skyrls_http_client_and_a_real_vllm(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    # SkyRL's RemoteInferenceClient posts token ids to vLLM's /inference/v1/generate, one of
    # the endpoints `vllm serve --enable-scale-out` adds (403 without it).
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30.0) as http:
        probe = await http.post("/inference/v1/generate", json={})
    # The fixture starts vLLM with that flag: a server without the endpoint is a broken set-up.
    if probe.status_code in (403, 404):
        pytest.fail(
            "the vLLM test server has no /inference/v1/generate (SkyRL's token endpoint): "
            "it needs --enable-scale-out (tests/support/vllm_server.py)"
        )
    output = await run_on_real_engines(
        vllm_server.url, vllm_server.model, vllm_server.model_dir, tmp_path / "ws"
    )
    assert set(output["stop_reasons"]) <= {"length", "stop", "max_turns"}  # random weights
