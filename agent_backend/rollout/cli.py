"""``agent-backend rollout``: sample GRPO groups for a prompt file into a JSONL file, resumably.

::

    agent-backend rollout --prompts prompts.jsonl --policy http://127.0.0.1:8000/v1 \\
        --pool pools/local.toml --out rollouts.jsonl --n 8 [--resume]

Each line of ``--prompts`` is a prompt: ``{"messages": [...]}``, ``{"prompt":
"text"}`` or a list of messages; other keys are kept for the reward. Each
line of ``--out`` is a :class:`~agent_backend.rollout.trajectory.Trajectory`.
The resume ledger is ``<out>.ledger.json``, beside it: after Ctrl-C, SIGTERM
or a crash, the same command with ``--resume`` continues where the durable
output ends (records written after the last checkpoint are cut and redone:
nothing skipped, nothing written twice).

Exit status: 0 when every prompt is trained or dropped, 1 when some are left
(groups that failed entirely: run ``--resume`` again), 2 for usage errors,
3 for a bad file or a failure of the policy server or the pool, 130 when
interrupted. The progress bar and logs go to stderr; the summary to stdout.

This module must never write the output without the ledger beside it, nor
start over an existing output unless told to resume it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn, cast, get_args

import anyio
import orjson
import typer

from agent_backend.config import import_object
from agent_backend.data import BUILTIN_TOOLS_DIR
from agent_backend.errors import AgentBackendError
from agent_backend.rollout import defaults

__all__ = ["ledger_path", "load_prompts", "rollout_command"]

EXIT_LEFT = 1
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130


class NonFinite(enum.StrEnum):
    mask = "mask"
    drop = "drop"
    fail = "fail"


_NON_FINITE_DEFAULT = NonFinite(defaults.NON_FINITE)


def ledger_path(out: Path) -> Path:
    """Where the resume ledger of ``out`` lives: ``<out>.ledger.json``, beside it."""
    return out.with_name(out.name + ".ledger.json")


def load_prompts(path: Path) -> list[Any]:
    """The prompts of a JSONL file, one per non-empty line; ``ValueError`` naming the bad line."""
    from agent_backend.rollout.episode import prompt_messages

    prompts: list[Any] = []
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
                prompt_messages(row)
            except (orjson.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            prompts.append(row)
    return prompts


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(code)


def _import_reward(spec: str) -> Any:
    # From the working directory too, as `python -m` would: `--reward myreward:score`.
    sys.path.insert(0, str(Path.cwd()))
    try:
        function = import_object(spec)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"--reward takes module:function: {exc}") from None
    finally:
        sys.path.pop(0)
    if not callable(function):
        raise ValueError(f"--reward {spec}: not a function")
    return function


def rollout_command(
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help="Prompts, one JSON per line: {'messages': [...]}, {'prompt': 'text'} or a "
            "list of messages (other keys go to the reward).",
            exists=True,
            dir_okay=False,
        ),
    ],
    policy: Annotated[
        str,
        typer.Option(
            "--policy",
            help="The policy server (vLLM or SGLang, OpenAI-compatible), e.g. "
            "http://127.0.0.1:8000/v1.",
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Output JSONL of trajectories; the ledger is <out>.ledger.json.",
            dir_okay=False,
        ),
    ],
    pool: Annotated[
        Path | None,
        typer.Option(
            "--pool",
            help="Pool file (TOML) the tools run on, e.g. pools/local.toml, or a set of pools "
            "(pools/mixed.example.toml). Default: this machine.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    isolation: Annotated[
        str | None,
        typer.Option(
            "--isolation",
            help="The walls around the tools' commands on local pools, over the pool file: "
            "namespaces (the default pool's) or none. docs/sandboxes.md.",
        ),
    ] = None,
    n: Annotated[
        int, typer.Option("--n", help="Samples per prompt (GRPO group size).", min=1)
    ] = defaults.N,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run whose ledger is beside --out.")
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="Served model name (default: the server's first).")
    ] = None,
    max_turns: Annotated[
        int, typer.Option(help="Policy turns per episode.", min=1)
    ] = defaults.MAX_TURNS,
    concurrency: Annotated[
        int, typer.Option(help="Episodes running at once.", min=1)
    ] = defaults.CONCURRENCY,
    max_tokens: Annotated[
        int | None, typer.Option(help="Tokens one turn may sample.", min=1)
    ] = None,
    max_total_tokens: Annotated[
        int | None, typer.Option(help="Token budget of an episode (prompt + completion).", min=1)
    ] = None,
    episode_timeout: Annotated[
        float, typer.Option(help="Seconds one episode may take.", min=0.001)
    ] = defaults.EPISODE_TIMEOUT,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature.", min=0.0)
    ] = defaults.TEMPERATURE,
    top_logprobs: Annotated[
        int, typer.Option(help="Alternatives per token asked for (>= 1).", min=1)
    ] = defaults.TOP_LOGPROBS,
    non_finite: Annotated[
        NonFinite,
        typer.Option(help="NaN/inf logprobs: mask the token, drop the rollout, or fail the run."),
    ] = _NON_FINITE_DEFAULT,
    reward_command: Annotated[
        str | None,
        typer.Option(
            help="Shell command run in the episode's workspace at its end: exit 0 is reward 1.0."
        ),
    ] = None,
    reward: Annotated[
        str | None,
        typer.Option(help="Reward function as module:function (gets a RewardInput)."),
    ] = None,
    tools_dir: Annotated[
        Path,
        typer.Option(help="Folder of tool schema files.", exists=True, file_okay=False),
    ] = BUILTIN_TOOLS_DIR,
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="Bearer token of the server.")
    ] = None,
    request_timeout: Annotated[
        float, typer.Option(help="Seconds one request to the policy may take.", min=0.001)
    ] = defaults.REQUEST_TIMEOUT,
    max_retries: Annotated[
        int, typer.Option(help="Retries of a request on 5xx, timeouts, connection errors.", min=0)
    ] = defaults.MAX_RETRIES,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Token in, token out: the model's tokenizer (a local folder or an installed "
            "model name). The server gets token ids on /v1/completions and history is never "
            "re-rendered; without it, chat completions."
        ),
    ] = None,
    call_format: Annotated[
        str | None,
        typer.Option(
            help="The text format the model writes tool calls in (hermes, llama3, mistral, "
            "deepseek, glm45, kimi_k2, qwen3_coder or harmony), read where the server returns "
            "no structured calls. Default: with --tokenizer, the one its chat template "
            "writes; else hermes."
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.")] = True,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
) -> None:
    """Sample --n episodes per prompt with tools, write trainer-ready trajectories (resumable).

    Tool calls run on --pool, one session (workspace) per episode. After
    Ctrl-C or a crash, run the same command with --resume: nothing is skipped
    and nothing is written twice. Exit status 0: every prompt done; 1: some
    left (run --resume again); 3: a bad file or a failed server/pool; 130:
    interrupted.
    """
    from agent_backend.dispatch import Dispatcher
    from agent_backend.pool_file import (
        PoolSetConfig,
        load_pools,
        load_pools_config,
        with_isolation,
    )
    from agent_backend.rollout.episode import EpisodeConfig, RewardFunction, ToolReward
    from agent_backend.rollout.ledger import ResumeLedger
    from agent_backend.rollout.pool import WRITER_POSITION, RolloutPool
    from agent_backend.rollout.tokens import open_policy
    from agent_backend.rollout.writers import JsonlWriter
    from agent_backend.sandbox import Isolation
    from agent_backend.tools import TextFormat, ToolRegistry

    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if reward and reward_command:
        _fail("give --reward or --reward-command, not both", 2)
    if isolation is not None and isolation not in get_args(Isolation):
        _fail(f"--isolation {isolation!r}: one of {', '.join(get_args(Isolation))}", 2)
    if call_format is not None and call_format not in get_args(TextFormat):
        _fail(f"--call-format {call_format!r}: one of {', '.join(get_args(TextFormat))}", 2)
    try:
        rows = load_prompts(prompts)
        registry = ToolRegistry.from_dir(tools_dir)
        pools_config = load_pools_config(pool) if pool is not None else PoolSetConfig.single()
        if isolation is not None:
            tier = cast("Isolation", isolation)
            pools_config = PoolSetConfig(
                {name: with_isolation(c, tier) for name, c in pools_config.pools.items()},
                pools_config.default,
            )
        pool_config = pools_config.pools[pools_config.default]
        # One Ray pool scales out: rollout workers as Ray actors, tools on their nodes.
        on_ray = len(pools_config.pools) == 1 and pool_config.type == "ray"
        backend = None if on_ray else load_pools(pools_config)
        reward_function: RewardFunction | None = None
        if reward_command:
            reward_function = ToolReward(("exec", {"command": reward_command}))
        elif reward:
            reward_function = _import_reward(reward)
    except (AgentBackendError, ValueError, ImportError, AttributeError, OSError) as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    if not rows:
        _fail(f"{prompts}: no prompts", EXIT_FAILED)
    ledger_file = ledger_path(out)
    if not resume and (out.exists() or ledger_file.exists()):
        _fail(
            f"{out} (or its ledger {ledger_file}) already exists: pass --resume to continue "
            "that run, or remove them to start over",
            2,
        )
    if resume and out.exists() and out.stat().st_size and not ledger_file.exists():
        _fail(f"{out} exists but its ledger {ledger_file} does not: cannot resume safely", 3)
    try:
        ledger = ResumeLedger.open(ledger_file, num_prompts=len(rows))
        writer = JsonlWriter.open(out, truncate_to=int(ledger.extra.get(WRITER_POSITION, 0)))
        try:
            ledger.reconcile(writer.prompt_indexes())
        except BaseException:
            writer.close()
            raise
    except AgentBackendError as exc:
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    config = EpisodeConfig(
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens,
        max_total_tokens=max_total_tokens,
        timeout=episode_timeout,
    )
    done_before = ledger.trained_count + ledger.dropped_count
    outcome: dict[str, Any] = {}

    policy_options: dict[str, Any] = {
        "url": policy,
        "model": model,
        "api_key": api_key,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "top_logprobs": top_logprobs,
        "non_finite": non_finite.value,
        "timeout": request_timeout,
        "max_retries": max_retries,
    }
    if tokenizer is not None:
        policy_options["tokenizer"] = tokenizer
    if call_format is not None:
        policy_options["call_format"] = call_format

    async def drive(rollouts: RolloutPool) -> None:
        outcome["pool"] = rollouts
        failure: list[Exception] = []  # raised after the task group, which would wrap it
        with _Progress(progress, len(rows), done_before) as bar:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_on_signals, tasks.cancel_scope, outcome)
                tasks.start_soon(bar.refresh_forever, rollouts, ledger)
                try:
                    await rollouts.run(rows, ledger=ledger, writer=writer)
                except Exception as exc:
                    failure.append(exc)
                finally:
                    tasks.cancel_scope.cancel()
            bar.update(rollouts, ledger)
        if failure:
            raise failure[0]

    async def main() -> None:
        if backend is None:
            from agent_backend.rollout.pool import RayRolloutWorkers

            async with RayRolloutWorkers(
                pool_config,
                policy=policy_options,
                tools_dir=tools_dir,
                episode=config,
                reward=reward_function,
            ) as workers:
                try:
                    await drive(
                        RolloutPool(None, None, workers=workers, n=n, concurrency=concurrency)
                    )
                finally:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                        outcome["non_finite"] = await workers.non_finite()
            return
        async with (
            backend,
            Dispatcher(registry, **backend.dispatcher_options()) as dispatcher,
            open_policy(policy_options) as client,
        ):
            await drive(
                RolloutPool(
                    client,
                    dispatcher,
                    reward=reward_function,
                    n=n,
                    concurrency=concurrency,
                    episode=config,
                )
            )

    started = time.perf_counter()
    code = 0
    error: str | None = None
    try:
        anyio.run(main)
    except KeyboardInterrupt:
        outcome["signal"] = "SIGINT"
    except (AgentBackendError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        code = EXIT_FAILED
    finally:
        writer.close()
    if "signal" in outcome:
        code = EXIT_INTERRUPTED
    elif code == 0 and not ledger.is_finished():
        code = EXIT_LEFT
    _summary(
        outcome.get("pool"),
        ledger,
        out,
        time.perf_counter() - started,
        code,
        error,
        outcome.get("non_finite"),
    )
    raise typer.Exit(code)


async def _on_signals(scope: anyio.CancelScope, outcome: dict[str, Any]) -> None:
    """Ctrl-C or SIGTERM: stop the run cleanly (sessions closed, ledger checkpointed)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for received in signals:
            outcome["signal"] = signal.Signals(received).name
            scope.cancel()
            return


class _Progress:
    """A rich progress bar on stderr (episodes done, tool calls/s, failures), or nothing."""

    def __init__(self, enabled: bool, total: int, done_before: int) -> None:
        self.enabled = enabled
        self.total = total
        self.done_before = done_before
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("prompts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                refresh_per_second=4,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "rollout", total=self.total, completed=self.done_before, detail=""
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, pool: Any, ledger: Any) -> None:
        if self._progress is None:
            return
        s = pool.statistics()
        detail = (
            f"episodes {s.episodes_done} done, {s.episodes_running} running, "
            f"{s.episodes_failed} failed | {s.tool_calls_per_second:.1f} tool calls/s"
        )
        self._progress.update(
            self._task, completed=ledger.trained_count + ledger.dropped_count, detail=detail
        )

    async def refresh_forever(self, pool: Any, ledger: Any) -> None:
        while True:
            self.update(pool, ledger)
            await anyio.sleep(0.25)


def _summary(
    pool: Any,
    ledger: Any,
    out: Path,
    elapsed: float,
    code: int,
    error: str | None,
    non_finite: Any = None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollout summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    total = ledger.num_prompts or 0
    left = total - ledger.trained_count - ledger.dropped_count
    table.add_row("prompts trained", str(ledger.trained_count))
    table.add_row("prompts dropped", str(ledger.dropped_count))
    table.add_row("prompts left", f"{left} of {total}")
    if pool is not None:
        s = pool.statistics()
        table.add_row("episodes done", str(s.episodes_done))
        table.add_row("episodes failed", str(s.episodes_failed))
        table.add_row("groups failed entirely", str(s.groups_failed))
        table.add_row(
            "stop reasons",
            ", ".join(f"{k} {v}" for k, v in sorted(s.stop_reasons.items())) or "-",
        )
        table.add_row("turns", str(s.turns))
        table.add_row("tool calls", f"{s.tool_calls} ({s.tool_failures} failed)")
        table.add_row("tool calls/s", f"{s.tool_calls_per_second:.1f}")
        table.add_row(
            "history drift",
            f"{s.history_rewrites} re-rendered prompts differed from the sampled tokens "
            f"({s.episodes_split} episodes split into segments)"
            if s.history_rewrites
            else "none",
        )
        nf = non_finite if non_finite is not None else s.non_finite  # Ray: the workers' counts
        table.add_row(
            "non-finite logprobs",
            f"{nf.non_finite_tokens} tokens ({nf.masked_tokens} masked, "
            f"{nf.dropped_rollouts} rollouts dropped)",
        )
    table.add_row("elapsed", f"{elapsed:.1f} s")
    table.add_row("output", str(out))
    table.add_row("ledger", str(ledger_path(out)))
    console = Console(file=sys.stdout, width=max(100, len(str(out)) + 40))
    console.print(table)
    if error is not None:
        typer.echo(f"rollout failed: {error}", err=True)
    if code == EXIT_INTERRUPTED:
        typer.echo(
            f"interrupted: run the same command with --resume to continue ({left} left)", err=True
        )
    elif code == EXIT_LEFT:
        typer.echo(
            f"{left} prompts failed in every episode and were left: run again with --resume",
            err=True,
        )


def main() -> None:
    """``python -m agent_backend.rollout.cli``: the command alone (``agent-backend rollout``)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    app.command()(rollout_command)
    with contextlib.suppress(KeyboardInterrupt):
        app()


if __name__ == "__main__":
    main()
