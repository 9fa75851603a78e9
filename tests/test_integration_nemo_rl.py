"""NeMo RL's message logs from agent_backend records, checked against a PINNED COPY of its shape.

NeMo RL cannot be installed here, so these tests do not run its code: PyPI's ``nemo-rl``
is an empty 0.0.0 placeholder (``nemo_rl/__init__.py`` and ``package_info.py``, no
``nemo_rl.data`` nor ``nemo_rl.experience``), and its source (NVIDIA-NeMo/RL) declares
``requires-python = ">=3.13.14,<3.14"`` (the project's venv is 3.11, and pyenv's 3.13 is
3.13.0), pins ``torch==2.11.0`` (the venv has 2.13; the only torch wheel on this machine
is 2.13 for CPython 3.11) and needs CUDA-only packages (``nvidia-nvshmem-cu13``, ``nixl``,
``cuda-bindings``, ``nccl4py``) that no CPU machine installs.

What is pinned: NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909
(2026-08-22), read, not copied. The checks below are this project's own code for what
that commit asserts and builds:

* ``nemo_rl/environments/nemo_gym.py`` ``_postprocess_nemo_gym_to_nemo_rl_result``: each
  generated turn's ``prompt_token_ids`` must start with every token seen so far
  ("Non-contiguous messages found!"); the new prompt tokens become a ``user`` message
  and the generation an ``assistant`` message with ``token_ids`` and
  ``generation_logprobs`` tensors (:func:`nemo_gym_log`).
* ``nemo_rl/algorithms/grpo.py`` ``add_grpo_token_loss_masks_and_generation_logprobs``: an
  assistant message with ``generation_logprobs`` is trained (``token_loss_mask`` 1),
  every other message is not, and gets zero ``generation_logprobs``; then
  ``nemo_rl/data/llm_message_utils.py`` ``batched_message_log_to_flat_message``
  concatenates each key over a sample's messages, refuses mixed dtypes, right-pads, and
  returns the unpadded lengths (:func:`flatten`).
* ``nemo_rl/experience/rollouts.py`` ``run_multi_turn_rollout`` and ``DatumSpec`` in
  ``nemo_rl/data/interfaces.py``: the batch columns ``message_log``, ``length``,
  ``loss_multiplier``, ``idx``, ``extra_env_info``, ``total_reward``, ``truncated``, and
  GDPO's ``reward/<name>`` components (``nemo_rl/algorithms/utils.py``).

Everything else is real: episodes run by the rollout pool with token-in/token-out over the
tiny model's tokenizer (tests/support/tiny_model.py), tools on the local pool. The sampler is
scripted (it answers each prompt with the ids its task's script says): the fault matrix.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support.policy_server import leftover_workspaces, local_dispatcher
from support.tiny_model import build_tiny_model

from agent_backend.errors import PolicyError
from agent_backend.integrations.nemo_rl import (
    to_message_log,
    to_nemo_rl_batch,
    to_nemo_rl_sample,
)
from agent_backend.rollout import (
    ChatTemplate,
    EpisodeConfig,
    RolloutPool,
    SampledTokens,
    TokenPolicy,
    Trajectory,
)
from agent_backend.rollout.episode import RewardInput

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

EPISODE = EpisodeConfig(max_turns=3, timeout=6.0, tool_timeout=1.0, max_tool_failures=2)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate.from_pretrained(str(build_tiny_model(tmp_path_factory.mktemp("hermes"))))


def call(name: str, arguments: Mapping[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call><|im_end|>"


WRITE = call("write_file", {"path": "a.txt", "content": "42"})
DONE = "Done.<|im_end|>"

#: The completion of each task at each turn: (text, finish reason, logprob of token 1), an
#: exception to raise, or None (never answers).
Step = tuple[str, str, float] | PolicyError | None
SCRIPTS: dict[str, Callable[[int, int], Step]] = {
    "write": lambda turn, seen: ((WRITE, "stop", -0.5), (DONE, "stop", -0.5))[min(turn, 1)],
    "fail_once": lambda turn, seen: (
        PolicyError("server restarting")
        if seen == 0
        else ((WRITE, "stop", -0.5), (DONE, "stop", -0.5))[min(turn, 1)]
    ),
    "tool_error": lambda turn, seen: (call("exec", {"command": "exit 3"}), "stop", -0.5),
    "tool_timeout": lambda turn, seen: (
        (call("exec", {"command": "sleep 30"}), "stop", -0.5),
        ("gave up<|im_end|>", "stop", -0.5),
    )[min(turn, 1)],
    "episode_timeout": lambda turn, seen: (WRITE, "stop", -0.5) if turn == 0 else None,
    "max_turns": lambda turn, seen: (call("add", {"a": 1, "b": 2}), "stop", -0.5),
    "nan": lambda turn, seen: (
        (WRITE, "stop", math.nan),  # masked in the middle of the episode
        (DONE, "stop", -0.5),
    )[min(turn, 1)],
    "length": lambda turn, seen: ("and so on and so", "length", -0.5),
}


class ScriptedSampler:
    """A TokenSampler answering from :data:`SCRIPTS`; logs every turn it sampled."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.seen: dict[str, int] = {}
        self.turns: list[tuple[list[int], list[int], list[float]]] = []

    async def sample(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> SampledTokens:
        text = self.template.tokenizer.decode(list(prompt_ids))
        task = re.search(r"task:(\w+)", text).group(1)  # type: ignore[union-attr]
        turn = text.count("<|im_start|>assistant") - 1
        step = SCRIPTS[task](turn, self.seen.get(task, 0))
        self.seen[task] = self.seen.get(task, 0) + 1
        if step is None:
            await anyio.sleep_forever()
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, tuple)
        completion, finish, first = step
        ids = self.template.encode(completion)
        logprobs = [first] + [-0.25] * (len(ids) - 1)
        self.turns.append(
            (list(prompt_ids), ids, [lp if math.isfinite(lp) else 0.0 for lp in logprobs])
        )
        return SampledTokens(ids, list(logprobs), finish)


def reward(episode: RewardInput) -> dict[str, float]:
    return {"format": 0.25, "done": 1.0 if episode.stop_reason == "stop" else 0.0}


async def sample(
    template: ChatTemplate, tmp_path: Path, tasks: Sequence[str], n: int
) -> tuple[list[Trajectory], ScriptedSampler]:
    sampler = ScriptedSampler(template)
    prompts = [{"prompt": f"Put 42 in a.txt. task:{task}"} for task in tasks]
    records: list[Trajectory] = []
    async with local_dispatcher(tmp_path / "ws") as dispatcher:
        pool = RolloutPool(
            TokenPolicy(sampler, template, non_finite="mask"),
            dispatcher,
            reward=reward,
            n=n,
            episode=EPISODE,
            max_failed_groups=None,
        )
        with anyio.fail_after(60):
            async with pool.stream(prompts, groups_per_batch=len(prompts)) as batches:
                async for batch in batches:
                    records.extend(batch)
    assert leftover_workspaces(tmp_path / "ws") == []
    return records, sampler


# -- the pinned checks (NVIDIA-NeMo/RL @ 7ea279ab, re-implemented) ---------------------------------


def nemo_gym_log(
    turns: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
) -> list[dict[str, Any]]:
    """The message log NeMo Gym's conversion builds from an episode's generated turns."""
    seen: list[int] = []
    log: list[dict[str, Any]] = []
    for prompt, generated, logprobs in turns:
        assert list(prompt[: len(seen)]) == seen, "Non-contiguous messages found!"
        log.append(
            {"role": "user", "content": "", "token_ids": torch.tensor(list(prompt[len(seen) :]))}
        )
        log.append(
            {
                "role": "assistant",
                "content": "",
                "token_ids": torch.tensor(list(generated)),
                "generation_logprobs": torch.tensor(list(logprobs)),
            }
        )
        seen += [*prompt[len(seen) :], *generated]
    return log


def flatten(
    logs: Sequence[Sequence[Mapping[str, Any]]], pad: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GRPO's loss masks and logprob backfill, then the flat, right-padded batch."""
    flat: list[dict[str, torch.Tensor]] = []
    for log in logs:
        columns: dict[str, list[torch.Tensor]] = {
            "token_ids": [],
            "token_loss_mask": [],
            "generation_logprobs": [],
        }
        for message in log:
            ids = message["token_ids"]
            trained = message["role"] == "assistant" and "generation_logprobs" in message
            columns["token_ids"].append(ids)
            columns["token_loss_mask"].append(
                torch.ones_like(ids) if trained else torch.zeros_like(ids)
            )
            columns["generation_logprobs"].append(
                message["generation_logprobs"]
                if trained
                else torch.zeros_like(ids, dtype=torch.float32)
            )
        flat.append({key: torch.cat(values) for key, values in columns.items()})
    lengths = torch.tensor([len(f["token_ids"]) for f in flat], dtype=torch.int32)
    width = int(lengths.max())
    batch: dict[str, torch.Tensor] = {}
    for key in ("token_ids", "token_loss_mask", "generation_logprobs"):
        tensors = [f[key] for f in flat]
        assert len({t.dtype for t in tensors}) == 1, f"expected consistent types for {key}"
        fill = pad if key == "token_ids" else 0
        batch[key] = torch.stack(
            [torch.cat([t, torch.full((width - len(t),), fill, dtype=t.dtype)]) for t in tensors]
        )
    return batch, lengths


def check_log(log: Sequence[Mapping[str, Any]], record: Trajectory) -> None:
    """The fields NeMo RL reads of a message log, and the contiguity of its tokens."""
    assert log, "a message log has at least one message"
    for message in log:
        assert isinstance(message["role"], str)
        assert isinstance(message["content"], str)
        ids = message["token_ids"]
        assert isinstance(ids, torch.Tensor)
        assert ids.dtype == torch.int64
        assert ids.dim() == 1
        assert len(ids) > 0
        if "generation_logprobs" in message:
            assert message["role"] == "assistant"
            lp = message["generation_logprobs"]
            assert lp.dtype == torch.float32
            assert lp.shape == ids.shape
            assert bool(torch.isfinite(lp).all())
    stream = torch.cat([m["token_ids"] for m in log]).tolist()
    assert stream == record.prompt_ids + record.completion_ids
    assert len(log[0]["token_ids"]) == len(record.prompt_ids), "the prompt is its own message"


def turns_of(
    record: Trajectory, sampler: ScriptedSampler
) -> list[tuple[list[int], list[int], list[float]]]:
    """The sampler's turns that built this record's token stream, in order."""
    stream = record.prompt_ids + record.completion_ids
    mine = {
        len(p): (p, ids, lps)
        for p, ids, lps in sampler.turns
        if stream[: len(p) + len(ids)] == p + ids
    }
    return [mine[k] for k in sorted(mine)]


# -- the tests -----------------------------------------------------------------------------------


async def test_message_logs_are_what_nemo_gym_builds_and_flatten_to_the_record(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    records, sampler = await sample(hermes, tmp_path, ["write", "tool_timeout", "max_turns"], 2)
    pad = hermes.tokenizer.pad_token_id
    assert records
    for record in records:
        log = to_message_log(record)
        check_log(log, record)
        # The same messages as NeMo Gym's conversion of the turns as they were sampled.
        expected = nemo_gym_log(turns_of(record, sampler))
        assert [m["role"] for m in log] == [m["role"] for m in expected]
        for ours, theirs in zip(log, expected, strict=True):
            assert ours["token_ids"].tolist() == theirs["token_ids"].tolist()
            if "generation_logprobs" in theirs:
                assert (
                    ours["generation_logprobs"].tolist() == theirs["generation_logprobs"].tolist()
                )
    logs = [to_message_log(r) for r in records]
    flat, lengths = flatten(logs, pad)
    for row, record in enumerate(records):
        p, c = len(record.prompt_ids), len(record.completion_ids)
        assert int(lengths[row]) == p + c
        assert flat["token_ids"][row, : p + c].tolist() == record.prompt_ids + record.completion_ids
        assert flat["token_loss_mask"][row, : p + c].tolist() == [0] * p + record.completion_mask
        got = flat["generation_logprobs"][row, : p + c].tolist()
        assert got == pytest.approx([0.0] * p + record.logprobs)
        assert set(flat["token_ids"][row, p + c :].tolist()) <= {pad}
    # With a tokenizer, each message's content is its text.
    texts = to_message_log(records[0], tokenizer=hermes.tokenizer)
    assert "task:" in texts[0]["content"]
    assert texts[1]["content"].startswith("<tool_call>")


async def test_the_fault_matrix_gives_one_valid_row_per_expected_episode(
    hermes: ChatTemplate, tmp_path: Path
) -> None:
    tasks = list(SCRIPTS)
    n = 2
    records, _ = await sample(hermes, tmp_path, tasks, n)
    pad = hermes.tokenizer.pad_token_id
    # One more prompt than was sampled: its group is missing (as a stale group dropped).
    expect = [(p, s) for p in range(len(tasks) + 1) for s in range(n)]
    batch = to_nemo_rl_batch(records, expect=expect, placeholder_token_id=pad, task_name="agent")
    rows = len(expect)
    for key in ("message_log", "extra_env_info", "idx", "task_name"):
        assert len(batch[key]) == rows, key
    assert batch["idx"] == [p for p, _ in expect]
    assert batch["length"].dtype == torch.int64
    assert batch["truncated"].dtype == torch.bool
    for key in ("loss_multiplier", "total_reward", "reward/done", "reward/format"):
        assert batch[key].dtype == torch.float32
        assert batch[key].shape == (rows,)
        assert bool(torch.isfinite(batch[key]).all())
    flat, lengths = flatten(batch["message_log"], pad)  # NeMo RL's flattening accepts them all
    assert flat["token_ids"].shape[0] == rows
    assert bool((lengths > 0).all())

    info = batch["extra_env_info"]
    by_task: dict[str, list[int]] = {}
    for row, (prompt, _) in enumerate(expect):
        by_task.setdefault(tasks[prompt] if prompt < len(tasks) else "missing", []).append(row)
    for row, log in enumerate(batch["message_log"]):
        assert int(batch["length"][row]) == len(log[0]["token_ids"])
        for message in log:
            assert message["token_ids"].dtype == torch.int64
        mask = flat["token_loss_mask"][row]
        if info[row]["placeholder"]:
            assert float(batch["loss_multiplier"][row]) == 0.0
            assert int(mask.sum()) == 0

    def reasons(task: str) -> list[str]:
        return [info[row]["stop_reason"] for row in by_task[task]]

    def multipliers(task: str) -> list[float]:
        return [float(batch["loss_multiplier"][row]) for row in by_task[task]]

    assert reasons("write") == ["stop", "stop"]
    assert multipliers("write") == [1.0, 1.0]
    assert [float(batch["total_reward"][r]) for r in by_task["write"]] == [1.25, 1.25]
    # Failed before its first turn: a one-token placeholder, no loss, its group's mean reward.
    assert sorted(reasons("fail_once")) == ["rollout_error", "stop"]
    assert sorted(multipliers("fail_once")) == [0.0, 1.0]
    assert [float(batch["total_reward"][r]) for r in by_task["fail_once"]] == [1.25, 1.25]
    assert [float(batch["reward/done"][r]) for r in by_task["fail_once"]] == [1.0, 1.0]
    assert reasons("tool_error") == ["tool_error"] * 2
    assert multipliers("tool_error") == [1.0, 1.0], "the policy's failure is trained on"
    assert reasons("tool_timeout") == ["stop"] * 2
    assert reasons("episode_timeout") == ["timeout"] * 2
    assert reasons("max_turns") == ["max_turns"] * 2
    assert reasons("length") == ["length"] * 2
    assert [bool(batch["truncated"][r]) for r in by_task["length"]] == [True, True]
    assert not any(bool(batch["truncated"][r]) for r in by_task["write"])
    # The missing group: two placeholders with the failure reward.
    assert all(info[r]["placeholder"] for r in by_task["missing"])
    assert [float(batch["total_reward"][r]) for r in by_task["missing"]] == [0.0, 0.0]
    # A NaN logprob in the first turn: that token is its own untrained message.
    for row in by_task["nan"]:
        log = batch["message_log"][row]
        roles = [m["role"] for m in log]
        assert roles[:3] == ["user", "user", "assistant"], roles
        assert len(log[1]["token_ids"]) == 1
        assert "generation_logprobs" not in log[1]
        assert float(batch["loss_multiplier"][row]) == 1.0


def test_shapes_without_tensors_and_what_is_refused() -> None:
    record = Trajectory(
        rollout_id="r",
        group_id="g",
        sample_idx=0,
        prompt_index=3,
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5, 6],
        completion_mask=[1, 1, 0, 1],
        logprobs=[-0.5, -0.25, 0.0, -1.0],
        reward=0.5,
        policy_version_start=0,
        policy_version_end=0,
        stop_reason="env_error",
        num_turns=2,
    )
    log = to_message_log(record, as_tensors=False)
    assert log == [
        {"role": "user", "content": "", "token_ids": [1, 2]},
        {
            "role": "assistant",
            "content": "",
            "token_ids": [3, 4],
            "generation_logprobs": [-0.5, -0.25],
        },
        {"role": "user", "content": "", "token_ids": [5]},
        {"role": "assistant", "content": "", "token_ids": [6], "generation_logprobs": [-1.0]},
    ]
    sample = to_nemo_rl_sample(record, as_tensors=False)
    assert sample["loss_multiplier"] == 0.0, "an environment failure is not the policy's"
    assert sample["idx"] == 3
    assert sample["length"] == 2
    kept = to_nemo_rl_sample(record, untrained_stop_reasons=(), as_tensors=False)
    assert kept["loss_multiplier"] == 1.0
    empty = record.model_copy(
        update={"prompt_ids": [], "completion_ids": [], "completion_mask": [], "logprobs": []}
    )
    with pytest.raises(ValueError, match="no tokens"):
        to_message_log(empty)
    batch = to_nemo_rl_batch([empty], placeholder_token_id=0, as_tensors=False)
    assert batch["loss_multiplier"] == [0.0]
    assert batch["message_log"][0][0]["token_ids"] == [0]
    assert batch["extra_env_info"][0]["placeholder"] is True
