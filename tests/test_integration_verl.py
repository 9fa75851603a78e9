"""verl 0.9's agent loop over agent_backend, run by verl's own classes on CPU.

The trainer's config is composed by hydra from verl's own ``ppo_trainer.yaml``;
verl's real ``AgentLoopWorker`` loads the agent loop YAML, instantiates
:class:`AgentBackendAgentLoop` per row (``hydra.utils.instantiate``, as in
training), and post-processes the outputs into a ``DataProto`` (padding,
``rm_scores``, extra columns), which is unioned with the trainer's own batch
(its ``uid``) by ``DataProto.union``. The tools run for real on the local
pool. The only stand-in is the policy: verl's ``server_manager`` is replaced
by a tiny random Qwen2 model (tests/support/tiny_model.py) on CPU that takes token
ids and returns token ids with the model's own logprobs; it samples freely,
or scores a scripted completion (the tool calls a test needs), chosen by a
``case:NAME`` marker in the prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import os
import re
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.tiny_model import tiny_model_dir_fixture

from agent_backend.errors import NonFiniteLogprobs
from agent_backend.integrations.verl import (
    AGENT_NAME,
    AgentBackendAgentLoop,
    close_dispatchers,
)

with warnings.catch_warnings():
    # verl's imports warn about what a CPU box lacks (torchtitan, ...) and Ray's old state API.
    warnings.simplefilter("ignore")
    import torch
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import DictConfig, OmegaConf
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopWorker,
        DictConfigWrap,
        _agent_loop_registry,
    )
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.workers.rollout.replica import TokenOutput

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]
tiny_model_dir = tiny_model_dir_fixture

PROMPT_LENGTH = 3072  # the four built-in tools' schemas alone are ~2200 tokens of this tokenizer
RESPONSE_LENGTH = 384
END = "<|im_end|>"

# -- the policy: verl's server manager stood in for by the tiny model ----------------------------


def call(command: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "exec", "arguments": {"command": command}})
        + ("</tool_call>")
    )


FAIL = "FAIL"  # the server raises (a dead rollout replica)
SAMPLE = "SAMPLE"  # sample freely from the model

#: case -> the completion of turn N (FAIL, SAMPLE, or text the model is made to produce).
SCRIPTS: dict[str, Callable[[int], str]] = {
    "write_cat": lambda t: [call("echo hello > out.txt"), call("cat out.txt"), "it says hello"][t],
    "fail_first": lambda t: FAIL,
    "long_prompt": lambda t: "unreachable",
    "tool_error": lambda t: [call("echo oops >&2; exit 3"), "never asked"][t],
    "tool_timeout": lambda t: [call("sleep 30"), "the command timed out, giving up"][t],
    "episode_timeout": lambda t: [call("sleep 30"), "never asked"][t],
    "max_turns": lambda t: [call("echo hello > out.txt"), call("echo again")][t],
    "nan_mask": lambda t: "hello there",
    "nan_drop": lambda t: "hello there",
    "free": lambda t: SAMPLE,
    "flood": lambda t: [call("seq 1 3000"), "unreachable: no budget left"][t],
}


@dataclasses.dataclass
class Sampled:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    log_probs: list[float]
    sampling_params: dict[str, Any]


class TinyServerManager:
    """verl's ``server_manager``: ``generate(request_id, prompt_ids=, sampling_params=)``."""

    def __init__(self, model_dir: Path, tokenizer: Any) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids(END)
        self.calls: list[Sampled] = []
        self.global_steps = 7

    @torch.no_grad()
    def _score(self, prompt: list[int], ids: list[int]) -> list[float]:
        logits = self.model(input_ids=torch.tensor([prompt + ids])).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        return [float(logprobs[i, t]) for i, t in enumerate(ids)]

    @torch.no_grad()
    def _sample(self, prompt: list[int], limit: int, seed: int) -> tuple[list[int], list[float]]:
        generator = torch.Generator().manual_seed(seed)
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        ids: list[int] = []
        logprobs: list[float] = []
        while len(ids) < limit:
            step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = int(torch.multinomial(step.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(step[token]))
            if token == self.end_id:
                break
            out = self.model(
                input_ids=torch.tensor([[token]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return ids, logprobs

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        found = re.search(r"case:(\w+)", text)
        assert found is not None, "every test prompt names its case"
        case = found.group(1)
        turn = text.count("<|im_start|>assistant") - 1
        limit = int(sampling_params["max_tokens"])
        action = SCRIPTS[case](turn)
        if action == FAIL:
            raise RuntimeError("the rollout replica is gone")
        # In a worker thread, as a real server runs apart: the event loop (tool timeouts) goes on.
        if action == SAMPLE:
            ids, logprobs = await asyncio.to_thread(
                self._sample, list(prompt_ids), limit, len(self.calls)
            )
        else:
            ids = self.tokenizer.encode(action + END, add_special_tokens=False)[:limit]
            logprobs = await asyncio.to_thread(self._score, list(prompt_ids), ids)
        if case.startswith("nan") and turn == 0:
            logprobs[1] = math.nan  # what a broken server may send
        self.calls.append(Sampled(request_id, list(prompt_ids), ids, logprobs, sampling_params))
        steps = self.global_steps
        if case == "write_cat":
            self.global_steps += 1  # verl synced new weights between two turns of this episode
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": steps},
        )

    def sampled(self, request_id: str) -> tuple[list[int], list[float]]:
        """Everything sampled for one episode, in order."""
        ids: list[int] = []
        logprobs: list[float] = []
        for c in self.calls:
            if c.request_id == request_id:
                ids += c.token_ids
                logprobs += c.log_probs
        return ids, logprobs


# -- verl's config, worker and batches ------------------------------------------------------------


def verl_config(model_dir: Path, agent_loops: Path | None) -> DictConfig:
    """The trainer config as verl's main composes it (hydra, verl's own ppo_trainer.yaml)."""
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.n=1",
    ]
    if agent_loops is not None:
        overrides.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loops}")
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with (
        warnings.catch_warnings(),
        initialize_config_dir(config_dir=config_dir, version_base=None),
    ):
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return compose(config_name="ppo_trainer", overrides=overrides)


def trainer_batch(rows: list[dict[str, Any]]) -> DataProto:
    """A batch as verl's trainer holds it: RLHFDataset-like rows, collated, with the trainer's uid."""
    items = [
        {
            "raw_prompt": [{"role": "user", "content": row.pop("content")}],
            "index": np.int64(i),  # as a parquet dataset's extra_info gives it
            "data_source": "agent_backend_test",
            "extra_info": {},
            "tools_kwargs": {},
            "interaction_kwargs": {},
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
            **row,
        }
        for i, row in enumerate(rows)
    ]
    batch = DataProto.from_single_dict(collate_fn(items))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in items], dtype=object)
    return batch


async def rollout(
    worker: AgentLoopWorker, batch: DataProto, *, n: int = 1
) -> tuple[DataProto, DataProto]:
    """What RayPPOTrainer.fit does around generate_sequences: (the rollout output, the union)."""
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # type: ignore[arg-type]
    out = await worker.generate_sequences(gen_batch.repeat(repeat_times=n, interleave=True))
    return out, batch.repeat(repeat_times=n, interleave=True).union(out)


@pytest.fixture
def pool_file(tmp_path: Path) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(
        f'type = "local"\nworkspace_root = "{tmp_path / "ws"}"\nkill_grace = 0.5\n',
        encoding="utf-8",
    )
    return path


@pytest.fixture
def tools_dir(tmp_path: Path) -> Path:
    """One tool, ``exec`` (the built-in), with a short description: a short prompt."""
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "exec.json").write_text(
        json.dumps(
            {
                "name": "exec",
                "description": "Run a shell command in the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
                "x-agent-backend": {"builtin": "exec"},
            }
        ),
        encoding="utf-8",
    )
    return folder


@pytest.fixture
def agent_loops(tmp_path: Path, pool_file: Path, tools_dir: Path) -> Path:
    """verl's agent loop config file: several entries naming our loop, with different limits."""
    base = {
        "_target_": "agent_backend.integrations.verl.AgentBackendAgentLoop",
        "pool": str(pool_file),
        "tools_dir": str(tools_dir),
        "reward_command": "grep -q hello out.txt",
        "tool_timeout": 2,
        "timeout": 30,
        "max_turns": 4,
    }
    entries = {
        "ab": {},
        "ab_strict": {"max_tool_failures": 1},
        "ab_short": {"timeout": 1.5, "tool_timeout": None},
        "ab_two": {"max_turns": 2},
        "ab_drop": {"non_finite": "drop"},
        "ab_fail": {"non_finite": "fail"},
    }
    path = tmp_path / "agent_loops.yaml"
    OmegaConf.save(
        OmegaConf.create([{"name": name, **base, **extra} for name, extra in entries.items()]),
        path,
    )
    return path


@pytest.fixture
async def shared_cleanup(tmp_path: Path) -> AsyncIterator[None]:
    yield
    await close_dispatchers()
    root = tmp_path / "ws"
    left = sorted(p.name for p in root.iterdir()) if root.exists() else []
    assert [n for n in left if n.startswith(("agent-backend-ws-", "agent-backend-scratch-"))] == []


def worker_for(config: DictConfig) -> AgentLoopWorker:
    """verl's own worker, its server manager the tiny model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        worker = AgentLoopWorker(config, llm_client=None)
    worker.llm_client = TinyServerManager(config.actor_rollout_ref.model.path, worker.tokenizer)
    return worker


def row_view(out: DataProto, i: int) -> dict[str, Any]:
    """One row of the rollout output: its unpadded response, mask, logprobs, reward tensor."""
    prompt_width = out.batch["prompts"].shape[1]
    attention = out.batch["attention_mask"][i]
    n = int(attention[prompt_width:].sum())
    return {
        "prompt_len": int(attention[:prompt_width].sum()),
        "response": out.batch["responses"][i, :n].tolist(),
        "mask": out.batch["response_mask"][i, :n].tolist(),
        "pad_mask": out.batch["response_mask"][i, n:].tolist(),
        "logprobs": out.batch["rollout_log_probs"][i, :n].tolist(),
        "rm_scores": out.batch["rm_scores"][i].tolist() if "rm_scores" in out.batch else None,
        "n": n,
        **{k: out.non_tensor_batch[k][i] for k in out.non_tensor_batch},
    }


def assert_reward_on_last_token(row: dict[str, Any], reward: float) -> None:
    scores = row["rm_scores"]
    assert scores is not None
    assert len(scores) == RESPONSE_LENGTH
    assert scores[row["n"] - 1] == pytest.approx(reward)
    assert all(v == 0.0 for j, v in enumerate(scores) if j != row["n"] - 1)


# -- the tests --------------------------------------------------------------------------------------


async def test_fault_matrix_through_verls_worker_one_valid_row_each(
    tiny_model_dir: Path, agent_loops: Path, shared_cleanup: None
) -> None:
    """Every outcome is one valid row: placed reward, masked tool tokens, the trainer's uid intact."""
    config = verl_config(tiny_model_dir, agent_loops)
    worker = worker_for(config)
    server = worker.llm_client
    assert isinstance(server, TinyServerManager)
    tokenizer = worker.tokenizer
    cases = [
        ("write_cat", "ab"),
        ("fail_first", "ab"),
        ("long_prompt", "ab"),
        ("tool_error", "ab_strict"),
        ("tool_timeout", "ab"),
        ("episode_timeout", "ab_short"),
        ("max_turns", "ab_two"),
        ("nan_mask", "ab"),
        ("nan_drop", "ab_drop"),
        ("free", "ab"),
        ("flood", "ab"),
    ]
    rows = []
    for case, agent in cases:
        content = f"case:{case} please"
        if case == "long_prompt":
            content += " word" * PROMPT_LENGTH
        rows.append({"content": content, "agent_name": agent})
    batch = trainer_batch(rows)

    out, union = await asyncio.wait_for(rollout(worker, batch), timeout=150)

    assert len(out) == len(cases)
    assert out.batch["responses"].shape == (len(cases), RESPONSE_LENGTH)
    assert out.batch["prompts"].shape == (len(cases), PROMPT_LENGTH)
    # The trainer's uid went through untouched, so its union found equal columns.
    assert list(union.non_tensor_batch["uid"]) == list(batch.non_tensor_batch["uid"])
    assert list(out.non_tensor_batch["uid"]) == list(batch.non_tensor_batch["uid"])
    assert "rm_scores" in union.batch
    assert "token_level_scores" not in out.batch
    view = {case: row_view(out, i) for i, (case, _) in enumerate(cases)}
    for case, row in view.items():
        assert row["n"] >= 1, case  # never an empty response
        assert row["pad_mask"] == [0] * (RESPONSE_LENGTH - row["n"]), case
        assert all(math.isfinite(v) for v in row["logprobs"]), case
        assert all(
            lp == 0.0 for lp, m in zip(row["logprobs"], row["mask"], strict=True) if not m
        ), case
        assert isinstance(row["stop_reason"], str), case
        assert row["rollout_id"].startswith("verl-"), case

    # A clean episode: two tool calls run in one workspace, the reward command saw the file.
    ok = view["write_cat"]
    assert (ok["stop_reason"], ok["tool_calls"], ok["tool_failures"]) == ("stop", 2, 0)
    assert ok["__num_turns__"] == 1 + 3 + 2  # verl counts prompt, assistant turns, tool rounds
    assert_reward_on_last_token(ok, 1.0)
    # The mask is 1 exactly on what the server sampled, with its logprobs; 0 on tool output.
    request_id = ok["rollout_id"].removeprefix("verl-")
    sampled_ids, sampled_logprobs = server.sampled(request_id)
    assert [t for t, m in zip(ok["response"], ok["mask"], strict=True) if m] == sampled_ids
    assert [lp for lp, m in zip(ok["logprobs"], ok["mask"], strict=True) if m] == pytest.approx(
        sampled_logprobs
    )
    text_masked = tokenizer.decode(
        [t for t, m in zip(ok["response"], ok["mask"], strict=True) if not m]
    )
    assert "<tool_response>" in text_masked
    assert "hello" in text_masked
    assert "<tool_response>" not in tokenizer.decode(sampled_ids)
    # Token in, token out: each turn's prompt is the previous prompt + what came back.
    calls = [c for c in server.calls if c.request_id == request_id]
    for before, after in itertools.pairwise(calls):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.token_ids)] == (
            before.prompt_ids + before.token_ids
        )
    for c in calls:  # logprobs always asked for; at most what is left of response_length
        assert c.sampling_params["logprobs"] is True
        assert c.sampling_params["max_tokens"] == (
            len(calls[0].prompt_ids) + RESPONSE_LENGTH - len(c.prompt_ids)
        )
    assert (ok["min_global_steps"], ok["max_global_steps"]) == (7, 9)
    # Per turn, the weights verl said sampled it (its global_steps), through verl's own output.
    assert [list(v) for v in ok["turn_versions"]] == [[7, 7], [8, 8], [9, 9]][
        : len(ok["turn_versions"])
    ]
    assert len(ok["turn_versions"]) >= 2

    # Failed before the first turn: a one-token placeholder under mask 0, the failure reward.
    for case, why in (("fail_first", "rollout replica is gone"), ("long_prompt", "prompt_length")):
        row = view[case]
        assert (row["n"], row["mask"], row["stop_reason"]) == (1, [0], "rollout_error"), case
        assert why in row["error"], case
        assert row["placeholder"], case
        assert row["prompt_len"] == 1, case
        assert_reward_on_last_token(row, 0.0)

    # A failing tool ends the episode at max_tool_failures=1: tool_error, failure reward.
    bad = view["tool_error"]
    assert (bad["stop_reason"], bad["tool_failures"]) == ("tool_error", 1)
    assert_reward_on_last_token(bad, 0.0)

    # A tool past its timeout is killed; its error goes back to the model, which goes on.
    slow = view["tool_timeout"]
    assert (slow["stop_reason"], slow["tool_failures"]) == ("stop", 1)
    assert "timed out" in tokenizer.decode(
        [t for t, m in zip(slow["response"], slow["mask"], strict=True) if not m]
    )
    assert_reward_on_last_token(slow, 0.0)  # no out.txt: the reward command failed

    # The episode's own timeout: stop_reason timeout, the sampled turn kept, failure reward.
    late = view["episode_timeout"]
    assert late["stop_reason"] == "timeout"
    assert sum(late["mask"]) > 0
    assert_reward_on_last_token(late, 0.0)

    # max_turns: the last turn's call is not run; the reward is still computed.
    capped = view["max_turns"]
    assert (capped["stop_reason"], capped["tool_calls"]) == ("max_turns", 1)
    assert_reward_on_last_token(capped, 1.0)

    # A NaN logprob: masked (that token only) or the rollout dropped (its whole row masked).
    masked = view["nan_mask"]
    assert masked["stop_reason"] == "stop"
    assert masked["non_finite_logprobs"] == 1
    assert masked["mask"][1] == 0
    assert sum(masked["mask"]) == masked["n"] - 1
    dropped = view["nan_drop"]
    assert dropped["stop_reason"] == "rollout_error"
    assert "non-finite" in dropped["error"]
    assert dropped["n"] > 1
    assert dropped["mask"] == [0] * dropped["n"]
    assert_reward_on_last_token(dropped, 0.0)

    # Free sampling from the model: the response never outgrows verl's response_length.
    free = view["free"]
    assert 1 <= free["n"] <= RESPONSE_LENGTH
    assert sum(free["mask"]) >= 1
    # Tool output past the budget: the server is not asked again, the row is cut to fit.
    flood = view["flood"]
    assert (flood["stop_reason"], flood["truncated"], flood["n"]) == (
        "length",
        True,
        RESPONSE_LENGTH,
    )
    assert len([c for c in server.calls if c.request_id in flood["rollout_id"]]) == 1
    assert_reward_on_last_token(flood, 0.0)


async def test_registered_name_selects_the_loop_and_trainer_columns_win(
    tiny_model_dir: Path, shared_cleanup: None
) -> None:
    """``agent_name: agent_backend`` (verl's register, defaults: built-in tools, this machine).

    No agent_backend reward is configured, so ``reward_score`` stays None and
    verl's own reward would score the rows (no ``rm_scores`` from the loop). A
    dataset column that our loop would also emit (``stop_reason``) keeps the
    dataset's value, so the trainer's union holds; an output with a ``uid`` of
    its own would have broken it, as a user saw with the padded-batch adapter.
    """
    assert _agent_loop_registry[AGENT_NAME] == {
        "_target_": "agent_backend.integrations.verl.AgentBackendAgentLoop"
    }
    worker = worker_for(verl_config(tiny_model_dir, None))
    batch = trainer_batch(
        [
            {"content": "case:write_cat go", "agent_name": AGENT_NAME, "stop_reason": "dataset"},
            {"content": "case:fail_first go", "agent_name": AGENT_NAME, "stop_reason": "dataset"},
        ]
    )
    uids = list(batch.non_tensor_batch["uid"])

    out, union = await asyncio.wait_for(rollout(worker, batch, n=2), timeout=120)

    assert len(out) == 4
    assert "rm_scores" not in out.batch
    assert list(out.non_tensor_batch["stop_reason"]) == ["dataset"] * 4
    # GRPO groups: each prompt's two samples carry the trainer's uid of that prompt.
    assert list(union.non_tensor_batch["uid"]) == [uids[0], uids[0], uids[1], uids[1]]
    for i in (0, 1):
        ok = row_view(out, i)
        assert (ok["tool_calls"], ok["tool_failures"], ok["error"]) == (2, 0, None)
        assert sum(ok["mask"]) > 0
        assert ok["prompt_len"] > 2000  # the four built-ins' schemas are in the prompt
    for i in (2, 3):
        failed = row_view(out, i)
        assert (failed["n"], failed["mask"]) == (1, [0])
        assert failed["placeholder"]

    collided = DataProto.from_single_dict(
        {
            "responses": out.batch["responses"],
            "uid": np.array(["the-adapter's-own"] * 4, dtype=object),
        }
    )
    with pytest.raises(AssertionError, match="uid"):
        batch.repeat(repeat_times=2, interleave=True).union(collided)


async def test_non_finite_fail_policy_stops_the_step(
    tiny_model_dir: Path, agent_loops: Path, shared_cleanup: None
) -> None:
    """``non_finite: fail`` is the one failure that raises through verl: asked for, it stops."""
    worker = worker_for(verl_config(tiny_model_dir, agent_loops))
    batch = trainer_batch([{"content": "case:nan_mask hi", "agent_name": "ab_fail"}])
    with pytest.raises(NonFiniteLogprobs, match="non-finite logprob policy 'fail'"):
        await asyncio.wait_for(rollout(worker, batch), timeout=60)


async def test_direct_instantiation_rejects_bad_options(tiny_model_dir: Path) -> None:
    """Developer errors raise at construction, with verl's real constructor arguments."""
    config = verl_config(tiny_model_dir, None)
    worker = worker_for(config)
    common = {
        "trainer_config": DictConfigWrap(config),
        "server_manager": worker.llm_client,
        "tokenizer": worker.tokenizer,
        "processor": None,
        "dataset_cls": worker.dataset_cls,
        "data_config": DictConfigWrap(config.data),
    }
    with pytest.raises(ValueError, match="not both"):
        AgentBackendAgentLoop(**common, reward="a:b", reward_command="true")
    with pytest.raises(ValueError, match="non_finite"):
        AgentBackendAgentLoop(**common, non_finite="ignore")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        AgentBackendAgentLoop(**common, pool="no/such/pool.toml")
    loop = AgentBackendAgentLoop(**common)
    assert loop.episode.max_turns >= 1
    assert loop.response_length == RESPONSE_LENGTH
