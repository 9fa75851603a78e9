"""The rollout layer's own cost: 64 and 1,024 concurrent episodes of 8 turns, tools on local and SSH.

    .venv/bin/python bench/rollout_bench.py [--quick] [--rounds N] [--target local,ssh,local-1024]

A fast scripted policy runs in this process (no GPU, no HTTP: it renders the
conversation with the test server's byte tokenizer and chat template and
answers at once, so that the policy costs little and what is left to see is
the rollout layer), and the tools are fast and real: each of the first 7
turns calls ``exec`` (``echo``, a real process on the host), the 8th answers.
A :class:`~agent_backend.rollout.pool.RolloutPool` runs 8 prompts x ``n=8``
= 64 episodes at once (``concurrency=64``), one session (workspace) each,
and streams them to an in-process consumer; ``local-1024`` runs 128 prompts
x 8 = 1,024 episodes at once on the local pool (what a large rollout step
keeps in flight).

Figures, from each episode's own ``timing`` (``total`` minus ``policy``,
``tools`` and ``env``, the session's workspace made and removed on the
host, which is tool-side work), divided by its turns:

* the rollout layer's overhead per turn (mean of the rounds' means), target
  <= 2 ms at 64 episodes, on the local pool and on SSH (a real OpenSSH sshd
  on 127.0.0.1, as in bench/ssh_bench.py), and <= 0.2 ms at 1,024 episodes
  on the local pool;
* episodes/s, beside a bare loop (policy, ``session.call``, messages; no
  token bookkeeping, no records, no pool) over the same policy, tools and
  sessions: the ratio is the whole layer's cost in throughput, for scale.

Rounds of the rollout pool and the bare loop alternate, so that machine noise
hits both alike. The ``policy`` and ``tools`` times of an episode run from the
await to the moment the episode runs again, so the wait for a busy event
loop counts there and the overhead is the layer's own work between awaits;
as a cross-check that does not depend on where the awaits are, the CPU time
of this process per turn is printed for the pool and for the bare loop (the
difference covers the pool's own tasks, records and bookkeeping too).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.policy_server import END, encode, render  # noqa: E402
from support.sshd import SSHServer, generate_keys, sshd_missing_reason  # noqa: E402

from agent_backend.backends.ssh import SSHBackend, SSHHostConfig, SSHPoolConfig  # noqa: E402
from agent_backend.dispatch import Backend, Dispatcher, builtin_tools  # noqa: E402
from agent_backend.pool_file import DEFAULT_POOL, load_pool  # noqa: E402
from agent_backend.rollout.episode import EpisodeConfig  # noqa: E402
from agent_backend.rollout.policy import AssistantTurn  # noqa: E402
from agent_backend.rollout.pool import RolloutPool  # noqa: E402
from agent_backend.rollout.trajectory import Trajectory  # noqa: E402
from agent_backend.tools import ToolCall, ToolRegistry  # noqa: E402

TURNS = 8
N = 8
#: target name -> (prompts, overhead target in ms per turn)
SHAPES: dict[str, tuple[int, float]] = {
    "local": (8, 2.0),
    "ssh": (8, 2.0),
    "local-1024": (128, 0.2),
}


class FastPolicy:
    """A scripted policy: 7 turns with one ``exec`` call each, then an answer; instant."""

    async def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
    ) -> AssistantTurn:
        await anyio.lowlevel.checkpoint()  # a real policy is I/O: let the others run
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        prompt_ids = encode(render(messages, tools))
        if turn < TURNS - 1:
            arguments = f'{{"command": "echo turn {turn}"}}'
            text = f'<tool_call>{{"name": "exec", "arguments": {arguments}}}</tool_call>'
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: tuple[ToolCall, ...] = (ToolCall(f"call_{turn}", "exec", arguments, "hermes"),)
        else:
            text = "all done"
            message = {"role": "assistant", "content": text}
            calls = ()
        completion_ids = encode(text + END)
        count = len(completion_ids)
        return AssistantTurn(
            message=message,
            text="" if calls else text,
            tool_calls=calls,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=[-0.5] * count,
            mask=[1] * count,
            finish_reason="tool_calls" if calls else "stop",
        )


def prompts(count: int) -> list[dict[str, Any]]:
    return [{"prompt": f"run the {TURNS - 1} steps of task {i}"} for i in range(count)]


async def rollout_round(
    dispatcher: Dispatcher, policy: FastPolicy, count: int
) -> tuple[float, list[Trajectory]]:
    pool = RolloutPool(
        policy, dispatcher, n=N, concurrency=count * N, episode=EpisodeConfig(max_turns=TURNS)
    )
    records: list[Trajectory] = []
    started = time.perf_counter()
    async with pool.stream(prompts(count), groups_per_batch=count) as batches:
        async for batch in batches:
            records.extend(batch)
    return time.perf_counter() - started, records


async def bare_round(dispatcher: Dispatcher, policy: FastPolicy, count: int) -> float:
    """The same episodes with nothing but the loop: the baseline of throughput."""
    tools = dispatcher.registry.to_openai()

    async def episode(prompt: dict[str, Any]) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt["prompt"]}]
        async with dispatcher.session() as session:
            for _ in range(TURNS):
                turn = await policy.generate(messages, tools)
                messages.append(turn.message)
                if not turn.tool_calls:
                    break
                for call in turn.tool_calls:
                    result = await session.call(call)
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": result.to_model_message(),
                        }
                    )

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for prompt in prompts(count):
            for _ in range(N):
                group.start_soon(episode, prompt)
    return time.perf_counter() - started


def overhead_per_turn(record: Trajectory) -> float:
    t = record.timing
    return (t["total"] - t["policy"] - t["tools"] - t["env"] - t["reward"]) / record.num_turns


async def measure(name: str, backend: Backend, rounds: int) -> dict[str, Any]:
    registry = ToolRegistry(builtin_tools())
    policy = FastPolicy()
    count, target_ms = SHAPES[name]
    episodes_at_once = count * N
    async with Dispatcher(registry, backend) as dispatcher:
        await rollout_round(dispatcher, policy, count)  # warm up: connections, caches
        await bare_round(dispatcher, policy, count)
        round_means: list[float] = []
        per_episode: list[float] = []
        rollout_rates: list[float] = []
        bare_rates: list[float] = []
        shares: list[tuple[float, float, float, float]] = []
        cpu: dict[str, float] = {"rollout": 0.0, "bare": 0.0}
        for index in range(rounds):
            order = ("rollout", "bare") if index % 2 == 0 else ("bare", "rollout")
            for which in order:
                cpu_before = time.process_time()
                if which == "bare":
                    bare_rates.append(
                        episodes_at_once / await bare_round(dispatcher, policy, count)
                    )
                    cpu["bare"] += time.process_time() - cpu_before
                    continue
                wall, records = await rollout_round(dispatcher, policy, count)
                cpu["rollout"] += time.process_time() - cpu_before
                episodes = {r.rollout_id: r for r in records}
                bad = [
                    r for r in episodes.values() if r.stop_reason != "stop" or r.num_turns != TURNS
                ]
                if bad:
                    raise RuntimeError(
                        f"{name}: {len(bad)} episodes did not run as scripted: {bad[0].error}"
                    )
                overheads = [overhead_per_turn(r) for r in episodes.values()]
                per_episode.extend(overheads)
                round_means.append(statistics.fmean(overheads))
                rollout_rates.append(len(episodes) / wall)
                shares.append(
                    tuple(  # type: ignore[arg-type]
                        statistics.fmean(r.timing[k] / r.num_turns for r in episodes.values())
                        for k in ("policy", "tools", "env", "total")
                    )
                )
        stats = dispatcher.statistics()
        if stats.sessions_open:
            raise RuntimeError(f"{name}: {stats.sessions_open} sessions left open")
    ordered = sorted(per_episode)
    policy_ms, tools_ms, env_ms, total_ms = (
        statistics.fmean(s[i] for s in shares) * 1000 for i in range(4)
    )
    return {
        "name": name,
        "episodes": episodes_at_once,
        "target_ms": target_ms,
        "overhead_ms": statistics.fmean(round_means) * 1000,
        "overhead_p50_ms": ordered[len(ordered) // 2] * 1000,
        "overhead_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        "rollout_eps": statistics.median(rollout_rates),
        "bare_eps": statistics.median(bare_rates),
        "ratio": statistics.median(r / b for r, b in zip(rollout_rates, bare_rates, strict=True)),
        "per_turn_ms": (policy_ms, tools_ms, env_ms, total_ms),
        # CPU of this process per turn, over all rounds: an estimate of the layer's cost
        # that does not depend on where the awaits are (it includes the pool's own tasks).
        "cpu_ms": {k: v / (rounds * episodes_at_once * TURNS) * 1000 for k, v in cpu.items()},
    }


@contextlib.asynccontextmanager
async def local_backend(directory: Path) -> AsyncIterator[Backend]:
    config = DEFAULT_POOL.model_copy(
        update={"workspace_root": str(directory / "local-ws"), "max_concurrent_calls": 64}
    )
    async with load_pool(config) as backend:
        yield backend


@contextlib.asynccontextmanager
async def ssh_backend(directory: Path) -> AsyncIterator[Backend]:
    keys = await anyio.to_thread.run_sync(generate_keys, directory / "keys")
    server = SSHServer(directory / "sshd", keys, max_startups="300:30:600")
    await anyio.to_thread.run_sync(server.start)
    try:
        host = SSHHostConfig(**server.client_options(workspace_root=str(directory / "ssh-ws")))
        async with SSHBackend.from_config(SSHPoolConfig(hosts=(host,))) as backend:
            yield backend
    finally:
        await anyio.to_thread.run_sync(server.kill)


async def run_bench(args: argparse.Namespace) -> int:
    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    rounds = 2 if args.quick else args.rounds
    results: list[dict[str, Any]] = []
    for target in targets:
        count = SHAPES[target][0]
        print(
            f"{target}: {count * N} concurrent episodes ({count} prompts x n={N}) of {TURNS}"
            f" turns ({TURNS - 1} exec calls each); rounds: {rounds}"
        )
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        directory = Path(tmp)
        for target in targets:
            if target == "ssh":
                reason = sshd_missing_reason()
                if reason is not None:
                    print(f"ssh: cannot run: {reason}")
                    results.append({"name": "ssh", "missing": reason})
                    continue
                opener = ssh_backend
            else:
                opener = local_backend
            async with opener(directory) as backend:
                results.append(await measure(target, backend, rounds))
    print()
    print(
        f"{'tools on':<10} {'episodes/s':>10} {'bare loop':>10} {'ratio':>6}"
        f" {'policy':>8} {'tools':>8} {'env':>8} {'total':>8} {'overhead':>9} {'p50':>7} {'p99':>7}"
    )
    print(f"{'':<10} {'':>10} {'':>10} {'':>6} {'ms/turn (means per episode)':>35}")
    for r in results:
        if "missing" in r:
            continue
        policy_ms, tools_ms, env_ms, total_ms = r["per_turn_ms"]
        print(
            f"{r['name']:<10} {r['rollout_eps']:>10.1f} {r['bare_eps']:>10.1f} {r['ratio']:>6.2f}"
            f" {policy_ms:>8.3f} {tools_ms:>8.3f} {env_ms:>8.3f} {total_ms:>8.3f}"
            f" {r['overhead_ms']:>9.3f} {r['overhead_p50_ms']:>7.3f} {r['overhead_p99_ms']:>7.3f}"
        )
    print()
    failed = 0
    for r in results:
        episodes = SHAPES[r["name"]][0] * N
        label = f"rollout-layer overhead per turn at {episodes} concurrent episodes ({r['name']})"
        if "missing" in r:
            failed += 1
            print(f"FAIL  {label:<72} (not measured: {r['missing']})")
            continue
        ok = r["overhead_ms"] <= r["target_ms"]
        failed += not ok
        print(
            f"{'PASS' if ok else 'FAIL'}  {label:<72} {r['overhead_ms']:>7.3f} ms"
            f"   target <= {r['target_ms']:g} ms"
        )
    for r in results:
        if "missing" not in r:
            print(
                f"info  episodes/s through the rollout pool / bare loop ({r['name']}):"
                f" {r['ratio']:.2f}x ({r['rollout_eps']:.1f} / {r['bare_eps']:.1f})"
            )
            cpu = r["cpu_ms"]
            print(
                f"info  CPU of this process per turn, rollout pool - bare loop ({r['name']}):"
                f" {cpu['rollout'] - cpu['bare']:.3f} ms ({cpu['rollout']:.3f} - {cpu['bare']:.3f})"
            )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds per target")
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds per target (each: pool + bare loop)"
    )
    parser.add_argument(
        "--target", default="local,ssh,local-1024", help="comma-separated: local, ssh, local-1024"
    )
    args = parser.parse_args()
    return anyio.run(run_bench, args)


if __name__ == "__main__":
    sys.exit(main())
