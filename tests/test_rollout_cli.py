"""``agent-backend rollout`` as a real process: against the scripted server, with real tools on
the local pool; interrupted by Ctrl-C and killed with SIGKILL at random points, then resumed:
every prompt ends up in the output exactly n times (none skipped by a cursor run ahead of training,
none trained again because a dropped one pinned it)."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.policy_server import (
    PolicyServer,
    Reply,
    Turn,
    leftover_workspaces,
    policy_server_fixture,
)
from support.ray_fixtures import TESTS_DIR, ray_cluster
from typer.testing import CliRunner

from agent_backend.rollout.cli import ledger_path
from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.writers import read_trajectories

pytestmark = pytest.mark.timeout(180)
policy_server = policy_server_fixture
__all__ = ["ray_cluster"]  # the fixture, imported for this module


def tool_then_answer(turn: Turn) -> Reply:
    if turn.index == 0:
        task = turn.messages[0]["content"]
        return Reply(
            "", tool_calls=[("exec", {"command": f"echo '{task}' > task.txt"})], delay=0.05
        )
    return Reply("done", delay=0.05)


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"task {i}"}) + "\n" for i in range(count)))
    return path


def write_pool(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "workspaces"
    pool = tmp_path / "pool.toml"
    pool.write_text(f'type = "local"\nworkspace_root = "{root}"\nkill_grace = 0.5\n')
    return pool, root


def command(server: PolicyServer, model: str, tmp_path: Path, *extra: str) -> list[str]:
    pool, _ = write_pool(tmp_path)
    return [
        sys.executable,
        "-m",
        "agent_backend.rollout.cli",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--policy",
        server.url,
        "--model",
        model,
        "--pool",
        str(pool),
        "--out",
        str(tmp_path / "out.jsonl"),
        "--no-progress",
        *extra,
    ]


def run(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def counts(out: Path) -> dict[int, int]:
    return dict(collections.Counter(t.prompt_index for t in read_trajectories(out)))


def test_a_full_run(policy_server: PolicyServer, tmp_path: Path) -> None:
    model = policy_server.add("cli-full", tool_then_answer)
    write_prompts(tmp_path / "prompts.jsonl", 5)
    args = command(
        policy_server, model, tmp_path, "--n", "3", "--reward-command", "test -s task.txt"
    )
    done = run(args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "prompts trained" in done.stdout
    assert "5 of 5" not in done.stdout  # none left
    assert "0 of 5" in done.stdout
    records = list(read_trajectories(tmp_path / "out.jsonl"))
    assert counts(tmp_path / "out.jsonl") == dict.fromkeys(range(5), 3)
    assert all(t.reward == 1.0 and t.tool_calls == 1 for t in records)
    assert leftover_workspaces(tmp_path / "workspaces") == []
    again = run(args, tmp_path)
    assert again.returncode == 2
    assert "--resume" in again.stderr
    resumed = run([*args, "--resume"], tmp_path)  # nothing left to do
    assert resumed.returncode == 0, resumed.stderr
    assert counts(tmp_path / "out.jsonl") == dict.fromkeys(range(5), 3)


def test_ctrl_c_stops_cleanly_and_resume_finishes(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("cli-ctrl-c", tool_then_answer)
    write_prompts(tmp_path / "prompts.jsonl", 40)
    args = command(policy_server, model, tmp_path, "--n", "2", "--concurrency", "4")
    out = tmp_path / "out.jsonl"
    process = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and out.stat().st_size > 0):  # some groups are done
            assert time.monotonic() < deadline, "no output within 30 s"
            assert process.poll() is None, process.communicate()
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert "prompts trained" in stdout
    # Stopped cleanly: every session closed and its workspace removed.
    assert leftover_workspaces(tmp_path / "workspaces") == []
    ledger = ResumeLedger.open(ledger_path(out), num_prompts=40)
    assert 0 < ledger.trained_count < 40
    assert set(counts(out)) == {i for i in range(40) if ledger.state(i) == "trained"}
    resumed = run([*args, "--resume"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert counts(out) == dict.fromkeys(range(40), 2)


def lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for(condition: Any, process: subprocess.Popen[bytes], what: str) -> None:
    """Wait until ``condition()`` holds while ``process`` runs (bounded: a stuck run fails)."""
    deadline = time.monotonic() + 90
    while not condition():
        assert process.poll() is None, f"the run ended (rc {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"the run made no progress towards {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_at_random_points_then_resume(
    policy_server: PolicyServer, tmp_path: Path, seed: int
) -> None:
    """Four SIGKILLs at kill points chosen by states, not by time, then a resume that finishes.

    A kill point is the run's start-up (its ledger appears: prompts claimed, nothing written
    yet, or a few lines) or the output reaching a seeded size; each lies well before the run's
    end (at most three quarters of the records), so every kill lands on a running process on a
    fast or a slow machine alike.
    """
    model = policy_server.add(f"cli-kill-{seed}", tool_then_answer)
    total, n = 40, 2
    records_wanted = total * n
    write_prompts(tmp_path / "prompts.jsonl", total)
    args = command(policy_server, model, tmp_path, "--n", str(n), "--concurrency", "4")
    out = tmp_path / "out.jsonl"
    ledger_file = ledger_path(out)
    chance = random.Random(seed)
    kills = 0
    target = 0
    for attempt in range(4):
        resume = ["--resume"] if attempt else []
        with (tmp_path / f"stderr-{attempt}.txt").open("wb") as log:
            process = subprocess.Popen(
                [*args, *resume], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log
            )
            try:
                if attempt == 0 and chance.random() < 0.5:
                    wait_for(ledger_file.exists, process, "its ledger appeared")  # start-up
                else:
                    target = min(target + chance.randint(1, 12), records_wanted * 3 // 4)
                    wait_for(lambda at=target: lines(out) >= at, process, f"{target} records")
                os.kill(process.pid, signal.SIGKILL)
                kills += 1
            finally:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=30)
        assert process.returncode == -signal.SIGKILL, (
            tmp_path / f"stderr-{attempt}.txt"
        ).read_text()
    final = run([*args, "--resume"], tmp_path)  # finishes what is left
    assert final.returncode == 0, final.stderr
    assert kills == 4
    ledger = ResumeLedger.open(ledger_file, num_prompts=total)
    assert (ledger.trained_count, ledger.cursor) == (total, total)
    assert counts(out) == dict.fromkeys(range(total), n)  # none skipped, none twice
    records = list(read_trajectories(out))
    assert len({t.rollout_id for t in records}) == len(records)


def test_bad_prompts_file(policy_server: PolicyServer, tmp_path: Path) -> None:
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "ok"}\n{"question": "no"}\n')
    done = run(command(policy_server, "x", tmp_path), tmp_path)
    assert done.returncode == 3
    assert "prompts.jsonl:2" in done.stderr


def test_a_server_without_logprobs_fails_the_run(
    policy_server: PolicyServer, tmp_path: Path
) -> None:
    model = policy_server.add("cli-no-logprobs", [Reply("x", omit=frozenset({"logprobs"}))])
    write_prompts(tmp_path / "prompts.jsonl", 30)
    done = run(command(policy_server, model, tmp_path, "--n", "2"), tmp_path)
    assert done.returncode == 3
    assert "without logprobs" in done.stderr
    ledger = ResumeLedger.open(ledger_path(tmp_path / "out.jsonl"), num_prompts=30)
    assert ledger.trained_count == 0


def test_a_dead_server_fails_the_run(tmp_path: Path) -> None:
    from support.ports import unused_port

    write_prompts(tmp_path / "prompts.jsonl", 30)

    class Dead:
        url = f"http://127.0.0.1:{unused_port()}/v1"

    args = command(Dead(), "m", tmp_path, "--n", "1", "--max-retries", "0")  # type: ignore[arg-type]
    done = run(args, tmp_path)
    assert done.returncode == 3
    assert "ClientConnectorError" in done.stderr
    assert leftover_workspaces(tmp_path / "workspaces") == []


def test_call_format_names_a_text_format(tmp_path: Path) -> None:
    from typing import get_args

    from agent_backend.cli import app
    from agent_backend.tools import TextFormat

    help_text = " ".join(CliRunner().invoke(app, ["rollout", "--help"]).output.split())
    for name in get_args(TextFormat):  # the help lists every format the tool layer reads
        assert name in help_text
    write_prompts(tmp_path / "prompts.jsonl", 1)

    class Nowhere:
        url = "http://127.0.0.1:9/v1"

    done = run(command(Nowhere(), "m", tmp_path, "--call-format", "llama4"), tmp_path)  # type: ignore[arg-type]
    assert done.returncode == 2
    assert "--call-format 'llama4': one of hermes, llama3" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_registered_in_the_main_command_line() -> None:
    from agent_backend.cli import app

    result = CliRunner().invoke(app, ["rollout", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--prompts", "--policy", "--pool", "--out", "--n", "--resume"):
        assert option in result.output


@pytest.mark.timeout(240)
def test_a_ray_pool_file_scales_out_to_ray_workers(
    policy_server: PolicyServer, ray_cluster: Any, tmp_path: Path
) -> None:
    model = policy_server.add("cli-ray", tool_then_answer)
    write_prompts(tmp_path / "prompts.jsonl", 6)
    pool = tmp_path / "ray.toml"
    pool.write_text(
        "\n".join(
            [
                'type = "ray"',
                'name = "cli"',
                f'address = "{ray_cluster.address}"',
                "num_cpus = 0.1",
                "replicas = 2",
                "max_concurrency = 4",
                "start_timeout = 120",
                "log_to_driver = false",
                'tools = ["support.ray_tools:echo"]',
                f'runtime_env = {{ env_vars = {{ PYTHONPATH = "{TESTS_DIR}" }} }}',
            ]
        )
        + "\n"
    )
    args = command(
        policy_server, model, tmp_path, "--n", "2", "--reward-command", "test -s task.txt"
    )
    args[args.index("--pool") + 1] = str(pool)
    done = run(args, tmp_path, timeout=200)
    assert done.returncode == 0, done.stderr
    records = list(read_trajectories(tmp_path / "out.jsonl"))
    assert counts(tmp_path / "out.jsonl") == dict.fromkeys(range(6), 2)
    assert all(t.reward == 1.0 for t in records), [t.error for t in records]
    assert {t.extras["worker"] for t in records} <= {"cli-rollout-0", "cli-rollout-1"}
    assert "prompts trained" in done.stdout
