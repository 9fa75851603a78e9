"""A synthetic rollout + train loop that is SIGKILLed and resumed, for the ledger crash test.

One *life* of the loop (:func:`run_life`) opens the real :class:`ResumeLedger`
and :class:`JsonlWriter` in a directory, resumes from them, and works through
the prompts: it claims a few, handles them out of order, abandons some
(released, redone later), drops some as stale, and for the rest writes a
group of synthetic trajectories, "trains" on it (a simulated trainer whose
state is the list of prompts it trained on) and marks it trained. Every few
prompts it checkpoints the ledger with the trainer's state and the writer's
position in ``extra``, the same atomic file, because in real RL a crash rolls
the model back to its checkpoint.

:func:`crash_resume` runs lives in child processes until one finishes, each
killed with SIGKILL at a seeded random point:

* ``mode="step"``: the child kills itself just before or after its n-th
  write/fsync/rename/truncate (n drawn from the seed), which reaches every
  window (after a group's bytes but before their fsync, after the temp
  ledger but before the rename, ...) reproducibly;
* ``mode="timer"``: the parent kills the child after a random delay.

:func:`verify` then checks what survived: no prompt skipped, none trained
twice, dropped ones never counted, the output holding each trained prompt's
group exactly once. ``unsafe=True`` resumes the naive way (keep whatever the
output holds, no ``truncate_to``), to show that the test catches it.

Children are forked by a multiprocessing forkserver that has imported
agent_backend once, so a life costs milliseconds instead of an interpreter
start. As a script it runs the whole exercise::

    .venv/bin/python tests/support/ledger_crash_worker.py [--prompts 200] [--seed 0] [--mode step]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.trajectory import SegmentBuilder, Trajectory
from agent_backend.rollout.writers import JsonlWriter, read_trajectories

LEDGER = "ledger.json"
OUTPUT = "rollouts.jsonl"

#: The os calls a step-mode child counts, and may be killed at.
CRASH_POINTS = ("write", "pwrite", "fsync", "replace", "ftruncate")


def _install_crash_point(crash_at: int, after: bool) -> None:
    """Make the ``crash_at``-th counted os call SIGKILL this process (before or after it runs)."""
    calls = 0

    def wrap(name: str) -> None:
        real = getattr(os, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == crash_at and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if calls == crash_at and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        setattr(os, name, counted)

    for name in CRASH_POINTS:
        wrap(name)


def make_group(prompt_index: int, life: int, group_size: int) -> list[Trajectory]:
    """A GRPO group of synthetic two-turn trajectories for one prompt."""
    group = []
    for sample in range(group_size):
        builder = SegmentBuilder()
        prompt = [1, 100 + prompt_index % 50, 2]
        first = [10 + sample, 11]
        builder.add_turn(prompt, first, [-0.5, -0.25])
        builder.add_turn([*prompt, *first, 7, 8], [12], [-0.125])
        group.extend(
            builder.build(
                rollout_id=f"p{prompt_index}-s{sample}-life{life}",
                group_id=f"p{prompt_index}-life{life}",
                sample_idx=sample,
                prompt_index=prompt_index,
                reward=float(sample % 2),
                policy_version_start=life,
                policy_version_end=life,
                stop_reason="stop",
                num_turns=2,
                tool_calls=1,
            )
        )
    return group


def run_life(
    directory: str,
    num_prompts: int,
    group_size: int,
    seed: int,
    life: int,
    crash_at: int | None = None,
    crash_after: bool = False,
    unsafe: bool = False,
) -> None:
    """One life of the rollout + train loop; returns when every prompt is trained or dropped."""
    if crash_at is not None:
        _install_crash_point(crash_at, crash_after)
    rng = random.Random(f"{seed}:{life}")
    root = Path(directory)
    ledger = ResumeLedger.open(root / LEDGER, num_prompts=num_prompts)
    extra = ledger.extra
    trainer: dict[str, Any] = extra.get("trainer", {"step": 0, "trained": []})
    if unsafe:
        writer = JsonlWriter.open(root / OUTPUT)
    else:
        writer = JsonlWriter.open(root / OUTPUT, truncate_to=extra.get("writer_position", 0))
        ledger.reconcile(writer.prompt_indexes())
    every = rng.randint(1, 3)
    since = 0

    def checkpoint() -> None:
        ledger.checkpoint({"writer_position": writer.position, "trainer": trainer})

    with writer:
        while not ledger.is_finished():
            claimed = ledger.claim(rng.randint(1, 6))
            rng.shuffle(claimed)
            for index in claimed:
                roll = rng.random()
                if roll < 0.1:
                    ledger.release(index)  # abandoned: pending again, redone later
                    continue
                if roll < 0.25:
                    ledger.mark_dropped(index, "stale")
                else:
                    writer.write_group(make_group(index, life, group_size))
                    trainer["trained"].append(index)
                    trainer["step"] += 1
                    ledger.mark_trained([index])
                since += 1
                if since >= every:
                    checkpoint()
                    since = 0
        checkpoint()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What survived a crash-resume run."""

    num_prompts: int
    finished: bool
    trained: int
    dropped: int
    skipped: int
    """Prompts neither trained nor dropped."""
    trained_twice: int
    """Prompts the trainer trained on more than once, or whose group is in the output more than once."""
    dropped_counted: int
    """Dropped prompts that were trained on, written, or counted."""
    trained_count_mismatch: int
    """|ledger.trained_count - distinct prompts the trainer trained on|."""
    output_mismatch: int
    """Trained prompts whose group is not in the output exactly once, plus output prompts not trained."""

    @property
    def ok(self) -> bool:
        return self.finished and not (
            self.skipped
            or self.trained_twice
            or self.dropped_counted
            or self.trained_count_mismatch
            or self.output_mismatch
        )


def verify(directory: str | Path, num_prompts: int, group_size: int) -> Verdict:
    """Check the ledger, the trainer state saved in it, and the output after a run."""
    root = Path(directory)
    ledger = ResumeLedger.open(root / LEDGER, num_prompts=num_prompts)
    states = collections.Counter(ledger.state(i) for i in range(num_prompts))
    trained = {i for i in range(num_prompts) if ledger.state(i) == "trained"}
    dropped = {i for i in range(num_prompts) if ledger.state(i) == "dropped"}
    trainer_list: list[int] = ledger.extra.get("trainer", {}).get("trained", [])
    trainer_counts = collections.Counter(trainer_list)

    groups: dict[int, set[str]] = collections.defaultdict(set)
    samples: dict[tuple[int, str], list[int]] = collections.defaultdict(list)
    output = root / OUTPUT
    if output.exists():
        for record in read_trajectories(output):
            groups[record.prompt_index].add(record.group_id)
            samples[(record.prompt_index, record.group_id)].append(record.sample_idx)
    written_twice = {i for i, ids in groups.items() if len(ids) > 1}
    trained_twice = {i for i, n in trainer_counts.items() if n > 1} | written_twice
    dropped_counted = dropped & (set(trainer_counts) | set(groups))
    incomplete = {
        i
        for i in trained
        if len(groups.get(i, ())) != 1
        or sorted(samples[(i, next(iter(groups[i])))]) != list(range(group_size))
    }
    return Verdict(
        num_prompts=num_prompts,
        finished=ledger.is_finished(),
        trained=ledger.trained_count,
        dropped=ledger.dropped_count,
        skipped=states["pending"] + states["in_flight"],
        trained_twice=len(trained_twice),
        dropped_counted=len(dropped_counted),
        trained_count_mismatch=abs(ledger.trained_count - len(trainer_counts)),
        output_mismatch=len(incomplete | (set(groups) - trained)),
    )


@dataclasses.dataclass(frozen=True)
class Run:
    """One crash-resume run: how often it was killed, and what survived."""

    seed: int
    mode: str
    lives: int
    kills: int
    seconds: float
    verdict: Verdict


_context: Any = None


def _forkserver() -> Any:
    """A forkserver context that has imported this module (and agent_backend) once."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # Python 3.11's forkserver ignores the parent's sys.path while preloading, so
        # preload what is installed (agent_backend), not this file from tests/.
        _context.set_forkserver_preload(
            ["agent_backend.rollout.ledger", "agent_backend.rollout.writers"]
        )
    return _context


def _progress(root: Path, num_prompts: int) -> int:
    path = root / LEDGER
    if not path.exists():
        return -1
    ledger = ResumeLedger.open(path, num_prompts=num_prompts)
    return ledger.trained_count + ledger.dropped_count


def crash_resume(
    directory: str | Path,
    *,
    num_prompts: int = 200,
    group_size: int = 4,
    seed: int = 0,
    mode: Literal["step", "timer"] = "step",
    max_steps: int = 40,
    max_delay: float = 0.05,
    max_lives: int = 2000,
    unsafe: bool = False,
) -> Run:
    """Run lives until one finishes, each SIGKILLed at a seeded random point; then :func:`verify`."""
    ctx = _forkserver()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    kills = 0
    started = time.perf_counter()
    for life in range(max_lives):
        crash_at = rng.randint(1, max_steps) if mode == "step" else None
        crash_after = rng.random() < 0.5
        delay = rng.uniform(0.0, max_delay)
        before = _progress(root, num_prompts) if mode == "timer" else 0
        child = ctx.Process(
            target=run_life,
            args=(str(root), num_prompts, group_size, seed, life, crash_at, crash_after, unsafe),
        )
        child.start()
        if mode == "timer":
            child.join(delay)
            # kill() ignores a child that has just ended on its own (os.kill would raise
            # ProcessLookupError); its exit code below tells the two apart
            child.kill()
        child.join()
        if child.exitcode == 0:
            break
        if child.exitcode != -signal.SIGKILL:
            raise RuntimeError(
                f"life {life} of seed {seed} failed with exit code {child.exitcode} "
                "(its traceback is on stderr)"
            )
        kills += 1
        if mode == "timer" and _progress(root, num_prompts) <= before:
            max_delay *= 1.5  # killed before it could do anything: give the next life longer
    else:
        raise RuntimeError(f"seed {seed}: no life finished within {max_lives} lives")
    return Run(
        seed=seed,
        mode=mode,
        lives=life + 1,
        kills=kills,
        seconds=time.perf_counter() - started,
        verdict=verify(root, num_prompts, group_size),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("step", "timer"), default="step")
    parser.add_argument("--unsafe", action="store_true")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = crash_resume(
            tmp,
            num_prompts=options.prompts,
            group_size=options.group,
            seed=options.seed,
            mode=options.mode,
            unsafe=options.unsafe,
        )
    print(json.dumps(dataclasses.asdict(run), indent=2))
    return 0 if run.verdict.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support.*
    raise SystemExit(main())
