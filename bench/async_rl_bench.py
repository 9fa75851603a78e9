"""Asynchronous RL against generate-then-train, through the real vLLM CPU server.

    .venv/bin/python bench/async_rl_bench.py [--quick] [--rounds N (3)] [--steps S (16)]
                                         [--in-flight drain|abort|continue (continue)]

One vLLM server (``.venv-vllm``, tests/support/vllm_server.py, dev mode: vLLM's RL
endpoints) serves the tiny random model of tests/support/tiny_model.py. A training step
takes a batch of ``groups_per_batch`` (4) GRPO groups of ``n`` (4) one-turn episodes (48
tokens each, no tools), then a simulated trainer step (the trainer runs elsewhere: an
``anyio.sleep``) as long as one batch of rollouts takes to generate (measured first, the
median of five batches after a warm-up one), then a real weight update: :meth:`RolloutPool.update_weights`
reloads a checkpoint into the server (two checkpoints saved with transformers, taken in
turn, so every update loads new weights) and moves the policy version. The same work runs
three ways, in alternating rounds so that machine noise hits them alike:

* **generate-then-train**: per step, ``pool.collect(prompts)`` samples the batch, then
  the trainer step, then the update: the server idles while the trainer trains;
* **async**: one ``pool.stream`` over every step's prompts with ``max_staleness=1`` and
  admission by staleness (the default): the pool samples the next batches while the
  trainer trains on the last one, and starts no group that would be too old to train;
* **async, drop at delivery**: the same stream with ``admission=False`` and room to run
  ahead (``max_buffered_groups`` of two batches): groups older than ``max_staleness``
  when the trainer takes them are dropped: sampled for nothing.

Figures:

* training throughput (prompts trained per second) of async over generate-then-train, the
  median of the rounds' ratios; target >= 1.5;
* groups generated and then dropped as stale: 0 with admission, printed beside drop at
  delivery (which must waste some for the comparison to mean anything);
* the staleness histogram of what the trainer got (policy versions between the weights that
  sampled a group and the trainer's);
* the cost of one ``update_weights`` on the tiny model (median, and the load itself).

Needs ``.venv-vllm`` (``make vllm-env``) and torch/transformers in this venv (``.[tokens]``).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.tiny_model import build_tiny_model  # noqa: E402
from support.vllm_server import VLLMServer, VLLMStartError, launched_vllm  # noqa: E402

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry, load_pool  # noqa: E402
from agent_backend.rollout import (  # noqa: E402
    ChatTemplate,
    EpisodeConfig,
    RolloutPool,
    TokenPolicy,
    VLLMTokenSampler,
)
from agent_backend.rollout.servers import PolicyServers, UpdateReport  # noqa: E402
from agent_backend.rollout.weight_sync import untie_for_vllm  # noqa: E402

N = 4
GROUPS_PER_BATCH = 4
TOKENS = 48
MAX_NUM_SEQS = 32
TARGET = 1.5


def make_checkpoints(model_dir: Path, directory: Path) -> list[Path]:
    """The start-up weights and a perturbed copy, both reloadable by vLLM on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    paths = []
    for name, noise in (("ckpt-a", 0.0), ("ckpt-b", 0.02)):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        if noise:
            torch.manual_seed(0)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * noise)
        path = directory / name
        model.save_pretrained(str(path))
        untie_for_vllm(path)
        paths.append(path)
    return paths


class Run:
    """One side's round: its wall time, what the trainer got, and the updates."""

    def __init__(self) -> None:
        self.trained = 0
        self.lags: collections.Counter[int] = collections.Counter()
        self.stale = 0
        self.updates: list[UpdateReport] = []
        self.seconds = 0.0


def make_pool(
    server: VLLMServer,
    servers: PolicyServers,
    sampler: VLLMTokenSampler,
    template: ChatTemplate,
    dispatcher: Dispatcher,
    **options: Any,
) -> RolloutPool:
    return RolloutPool(
        TokenPolicy(sampler, template),
        dispatcher,
        tools=[],
        n=N,
        concurrency=2 * N * GROUPS_PER_BATCH,
        episode=EpisodeConfig(max_turns=1, max_tokens_per_turn=TOKENS),
        **options,
    )


def prompts_for(steps: int, round_: int, side: str) -> list[list[dict[str, str]]]:
    count = steps * GROUPS_PER_BATCH
    return [
        [{"role": "user", "content": f"{side} round {round_} prompt {i}: tell a story"}]
        for i in range(count)
    ]


async def update(
    pool: RolloutPool, checkpoints: Sequence[Path], run: Run, in_flight: Any = "drain"
) -> None:
    target = checkpoints[(pool.policy_version + 1) % len(checkpoints)]
    run.updates.append(await pool.update_weights(target, in_flight=in_flight))


async def generate_then_train(
    pool: RolloutPool, prompts: list[Any], train: float, checkpoints: Sequence[Path]
) -> Run:
    run = Run()
    started = time.perf_counter()
    for step in range(0, len(prompts), GROUPS_PER_BATCH):
        records = await pool.collect(prompts[step : step + GROUPS_PER_BATCH])
        run.trained += len({r.prompt_index for r in records})
        for record in records:
            run.lags[pool.policy_version - record.policy_version_start] += 1
        await anyio.sleep(train)  # the trainer's step
        await update(pool, checkpoints, run)
    run.seconds = time.perf_counter() - started
    return run


async def asynchronous(
    pool: RolloutPool,
    prompts: list[Any],
    train: float,
    checkpoints: Sequence[Path],
    in_flight: Any,
) -> Run:
    run = Run()
    started = time.perf_counter()
    async with pool.stream(prompts, groups_per_batch=GROUPS_PER_BATCH) as batches:
        async for batch in batches:
            run.trained += len({r.prompt_index for r in batch})
            for group in {r.group_id: r for r in batch}.values():
                run.lags[pool.policy_version - group.policy_version_start] += 1
            await anyio.sleep(train)  # the trainer's step, while the pool samples on
            await update(pool, checkpoints, run, in_flight)
    run.seconds = time.perf_counter() - started
    run.stale = pool.statistics().groups_stale
    return run


async def run_bench(server: VLLMServer, model_dir: Path, directory: Path, args: Any) -> int:
    template = ChatTemplate.from_pretrained(str(model_dir))
    checkpoints = make_checkpoints(model_dir, directory)
    config = DEFAULT_POOL.model_copy(update={"workspace_root": str(directory / "ws")})
    async with (
        load_pool(config) as backend,
        Dispatcher(ToolRegistry(), backend) as dispatcher,
        PolicyServers(server.url) as servers,
        VLLMTokenSampler(servers, model=server.model, max_tokens=TOKENS) as sampler,
    ):

        def pool(**options: Any) -> RolloutPool:
            return make_pool(server, servers, sampler, template, dispatcher, **options)

        # The trainer's step takes as long as one batch of rollouts takes to generate.
        # Measured as generate-then-train generates: one batch alone, after a warm-up one.
        batch_times = []
        for i in range(6):
            started = time.perf_counter()
            await pool().collect(prompts_for(1, i, "calibrate"))
            batch_times.append(time.perf_counter() - started)
        train = statistics.median(batch_times[1:])
        print(f"one batch ({GROUPS_PER_BATCH} groups of {N}): {train * 1000:.0f} ms to generate;")
        print(
            f"the simulated trainer step takes as long ({args.steps} steps a round; async "
            f"updates: in_flight={args.in_flight})\n"
        )
        sync_runs: list[Run] = []
        async_runs: list[Run] = []
        drop_runs: list[Run] = []
        ratios: list[float] = []
        for round_ in range(args.rounds):
            first = await generate_then_train(
                pool(), prompts_for(args.steps, round_, "sync"), train, checkpoints
            )
            second = await asynchronous(
                pool(max_staleness=1),
                prompts_for(args.steps, round_, "async"),
                train,
                checkpoints,
                args.in_flight,
            )
            third = await asynchronous(
                pool(max_staleness=1, admission=False, max_buffered_groups=2 * GROUPS_PER_BATCH),
                prompts_for(args.steps, round_, "drop"),
                train,
                checkpoints,
                args.in_flight,
            )
            sync_runs.append(first)
            async_runs.append(second)
            drop_runs.append(third)
            ratio = (second.trained / second.seconds) / (first.trained / first.seconds)
            ratios.append(ratio)
            print(
                f"round {round_ + 1}: generate-then-train {first.trained / first.seconds:.2f} "
                f"prompts/s, async {second.trained / second.seconds:.2f} ({ratio:.2f}x), "
                f"drop at delivery {third.trained / third.seconds:.2f} "
                f"(dropped {third.stale})"
            )
    ratio = statistics.median(ratios)
    admitted_stale = sum(r.stale for r in async_runs)
    dropped_stale = sum(r.stale for r in drop_runs)
    updates = [u for r in (*sync_runs, *async_runs, *drop_runs) for u in r.updates]
    print()
    print(f"{'':28}{'prompts/s':>10}{'trained':>9}{'stale, dropped':>16}  staleness histogram")
    for name, runs in (
        ("generate-then-train", sync_runs),
        ("async, admission", async_runs),
        ("async, drop at delivery", drop_runs),
    ):
        rate = statistics.median(r.trained / r.seconds for r in runs)
        lags: collections.Counter[int] = collections.Counter()
        for r in runs:
            lags.update(r.lags)
        histogram = "  ".join(f"{lag}: {count}" for lag, count in sorted(lags.items()))
        print(
            f"{name:28}{rate:>10.2f}{sum(r.trained for r in runs):>9}"
            f"{sum(r.stale for r in runs):>16}  {histogram}"
        )
    cost = statistics.median(u.seconds for u in updates) * 1000
    load = statistics.median(u.load_seconds for u in updates) * 1000
    print(
        f"\nupdate_weights on the tiny model: {cost:.0f} ms median over {len(updates)} "
        f"(the server's pause, reload and resume: {load:.0f} ms)\n"
    )
    ok = True
    verdict = "PASS" if ratio >= TARGET else "FAIL"
    ok &= ratio >= TARGET
    print(
        f"{verdict}  async / generate-then-train, prompts trained per second "
        f"(trainer step = one batch's generation): {ratio:.2f} (target >= {TARGET})"
    )
    verdict = "PASS" if admitted_stale == 0 and dropped_stale > 0 else "FAIL"
    ok &= admitted_stale == 0 and dropped_stale > 0
    print(
        f"{verdict}  groups generated then dropped as stale, max_staleness=1: "
        f"{admitted_stale} with admission, {dropped_stale} with drop at delivery "
        "(target 0, where drop at delivery wastes some)"
    )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side")
    parser.add_argument("--steps", type=int, default=16, help="training steps a round")
    parser.add_argument(
        "--in-flight",
        choices=("drain", "abort", "continue"),
        default="continue",
        help="what the async sides' updates do to the turns in flight",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 4
    with tempfile.TemporaryDirectory(prefix="async-rl-bench-") as tmp:
        directory = Path(tmp)
        model_dir = build_tiny_model(directory / "model")
        started = time.monotonic()
        try:
            with launched_vllm(model_dir, max_num_seqs=MAX_NUM_SEQS) as server:
                print(f"vLLM healthy {time.monotonic() - started:.1f} s after launch")
                try:
                    return anyio.run(run_bench, server, model_dir, directory, args)
                except BaseException:
                    tail = server.log_path.read_bytes()[-6000:].decode("utf-8", "replace")
                    print(f"the bench failed; the vLLM server's log ends:\n{tail}", file=sys.stderr)
                    raise
        except VLLMStartError as exc:
            print(f"FAIL  the vLLM server cannot run: {exc}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
