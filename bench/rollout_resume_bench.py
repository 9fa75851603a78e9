"""Crash-resume of the rollout bookkeeping: SIGKILL at random points, resume, count the damage.

    .venv/bin/python bench/rollout_resume_bench.py [--kills N] [--prompts P] [--seed S] [--quick]

Runs tests/support/ledger_crash_worker.py's synthetic rollout + train loop (the real
ResumeLedger and JsonlWriter, groups dropped as stale, a simulated trainer
whose state is checkpointed in the ledger's file) in child processes and
kills them with SIGKILL, then resumes, until the run completes; repeats over
seeds until at least ``--kills`` kill points were taken in each mode:

* ``step``: the child kills itself at its n-th write/fsync/rename/truncate
  (n random, seeded): every crash window, reproducibly;
* ``timer``: the parent kills the child after a random delay.

Then counts prompts skipped, trained twice, dropped-but-counted, and output
groups not present exactly once, against the issue's figures (0 each, over
at least 50 kill points). A control run resumes the naive way (keeping the
output past the checkpoint) and must be caught.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.ledger_crash_worker import Run, crash_resume  # noqa: E402


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def run_mode(mode: str, kills: int, prompts: int, seed: int, tmp: Path) -> list[Run]:
    runs: list[Run] = []
    while sum(r.kills for r in runs) < kills:
        run = crash_resume(tmp / f"{mode}-{seed}", num_prompts=prompts, seed=seed, mode=mode)  # type: ignore[arg-type]
        runs.append(run)
        v = run.verdict
        print(
            f"  {mode:<6}{seed:>5}{run.lives:>7}{run.kills:>7}{v.trained:>9}{v.dropped:>9}"
            f"{v.skipped:>9}{v.trained_twice:>7}{v.output_mismatch:>8}{run.seconds:>9.1f}"
        )
        seed += 1
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kills", type=int, default=60, help="kill points per mode (>= 50 to pass)"
    )
    parser.add_argument("--prompts", type=int, default=200, help="prompts per run")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--quick", action="store_true", help="10 kills per mode, 60 prompts")
    options = parser.parse_args()
    if options.quick:
        options.kills, options.prompts = 10, 60

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        print(
            f"== Crash-resume: {options.prompts} prompts per run, groups of 4, "
            f"SIGKILL at seeded random points =="
        )
        print("  mode   seed  lives  kills  trained  dropped  skipped  twice  output  seconds")
        runs = [
            *run_mode("step", options.kills, options.prompts, options.seed, Path(tmp)),
            *run_mode("timer", options.kills, options.prompts, options.seed + 1000, Path(tmp)),
        ]
        control = crash_resume(
            Path(tmp) / "naive", num_prompts=60, seed=options.seed, mode="step", unsafe=True
        )
    kills = sum(r.kills for r in runs)
    step_kills = sum(r.kills for r in runs if r.mode == "step")
    timer_kills = kills - step_kills
    skipped = sum(r.verdict.skipped for r in runs)
    twice = sum(r.verdict.trained_twice for r in runs)
    dropped_counted = sum(r.verdict.dropped_counted for r in runs)
    count_off = sum(r.verdict.trained_count_mismatch for r in runs)
    output_off = sum(r.verdict.output_mismatch for r in runs)
    unfinished = sum(not r.verdict.finished for r in runs)
    caught = control.verdict.trained_twice + control.verdict.output_mismatch
    print(
        f"\n  control (naive resume, no truncation): {control.kills} kills, "
        f"{control.verdict.trained_twice} prompts written twice, "
        f"{control.verdict.output_mismatch} output groups wrong"
    )
    print(f"  total {time.perf_counter() - started:.1f} s")

    figures = [
        (
            f"kill points  {kills} ({step_kills} step, {timer_kills} timer)  target >= 50",
            kills >= 50,
        ),
        (f"prompts skipped  {skipped}  target 0", skipped == 0),
        (f"prompts trained twice  {twice}  target 0", twice == 0),
        (f"dropped prompts counted as trained  {dropped_counted}  target 0", dropped_counted == 0),
        (f"trained_count off by  {count_off}  target 0", count_off == 0),
        (f"output groups not exactly once  {output_off}  target 0", output_off == 0),
        (f"runs not finished  {unfinished}  target 0", unfinished == 0),
        (f"naive resume caught  {caught} bad prompts  target > 0", caught > 0),
    ]
    print("\n== Figures ==")
    for text, ok in figures:
        print(f"  [{verdict(ok)}] {text}")
    return 0 if all(ok for _, ok in figures) else 1


if __name__ == "__main__":
    raise SystemExit(main())
