"""The ``agent-backend`` command line: serve the daemon or MCP, call a tool, check a pool.

Uses only the public API. Exit status reflects the result: 0 when the call
(or the preparation, or the check) succeeded, 1 when the answer is an error
(a failed tool result, an unhealthy host), 2 for usage errors (typer's), 3
for a configuration or infrastructure error. Logs go to stderr; stdout
carries only results (and, for ``mcp``, the protocol).
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import anyio
import typer
from typer.core import TyperCommand, TyperOption

from agent_backend.data import BUILTIN_TOOLS_DIR, DEFAULT_POOL_FILE
from agent_backend.errors import AgentBackendError, ModelFacingError
from agent_backend.tools import ToolCall, ToolRegistry

if TYPE_CHECKING:
    from agent_backend.daemon import DaemonSettings
    from agent_backend.sandbox import Isolation

app = typer.Typer(
    name="agent-backend",
    help="Run AI agents' tool calls: repair arguments against each tool's JSON Schema, "
    "then execute them on a pool of hosts (this machine, SSH hosts or Ray actors).\n\n"
    "Start here: `agent-backend tools` lists the tools; `agent-backend call exec "
    '\'{"command": "echo hi"}\'` runs one; `agent-backend serve` starts the HTTP daemon '
    "(docs/daemon.md); `agent-backend mcp` serves the tools to an MCP client (docs/mcp.md).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
pool_app = typer.Typer(
    help="Pools: the hosts tool calls run on, described by a TOML file (see pools/).",
    no_args_is_help=True,
)
app.add_typer(pool_app, name="pool")

ToolsDir = Annotated[
    Path,
    typer.Option(
        "--tools-dir",
        help="Folder of tool schema files (*.json) to load.",
        exists=True,
        file_okay=False,
        dir_okay=True,
    ),
]

PoolToolsDir = Annotated[
    Path | None,
    typer.Option(
        "--tools-dir",
        help="Folder of tool schema files (*.json) to load. Default: the built-in tools "
        "(exec, read_file, ...), or none on a Ray pool, which runs the tools its file names.",
        exists=True,
        file_okay=False,
        dir_okay=True,
    ),
]


class ToolFormat(StrEnum):
    table = "table"
    openai = "openai"
    anthropic = "anthropic"
    mcp = "mcp"


PoolFile = Annotated[
    Path | None,
    typer.Option(
        "--pool",
        help="Pool file (TOML) to run tools on, e.g. pools/local.toml, or a set of pools "
        "(pools/mixed.example.toml). Default: the built-in local pool (this machine).",
        exists=True,
        file_okay=True,
        dir_okay=False,
    ),
]


class IsolationTier(StrEnum):
    namespaces = "namespaces"
    none = "none"


IsolationOption = Annotated[
    IsolationTier | None,
    typer.Option(
        "--isolation",
        help="The walls around every command of the local and SSH pools, over what the pool "
        "file says: namespaces (each session, or each SSH call, in its own namespaces; the "
        "default) or none (no walls: only for a model you trust). docs/sandboxes.md.",
        case_sensitive=False,
    ),
]


def _tier(isolation: IsolationTier | None) -> Isolation | None:
    return None if isolation is None else isolation.value


def _registry(tools_dir: Path) -> ToolRegistry:
    try:
        return ToolRegistry.from_dir(tools_dir)
    except AgentBackendError as exc:
        _fail(str(exc), code=3)


def _pool_registry(tools_dir: Path | None, pools: Any) -> ToolRegistry:
    """``--tools-dir``'s tools; by default the built-in ones, or none on pools without hosts."""
    if tools_dir is None:
        if not pools.has_hosts():  # Ray pools: their own tools join the registry in the Dispatcher
            return ToolRegistry()
        tools_dir = BUILTIN_TOOLS_DIR
    return _registry(tools_dir)


def _fail(message: str, *, code: int) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(code)


@app.command("tools")
def tools_command(
    tools_dir: ToolsDir = BUILTIN_TOOLS_DIR,
    format: Annotated[
        ToolFormat, typer.Option("--format", "-f", help="table, or the JSON a provider expects.")
    ] = ToolFormat.table,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="With --format openai: the strict-mode variant of each tool that has one.",
        ),
    ] = False,
) -> None:
    """List the tools in a tool folder, as a table or in OpenAI, Anthropic or MCP shape."""
    if strict and format is not ToolFormat.openai:
        raise typer.BadParameter("--strict goes with --format openai", param_hint="--strict")
    registry = _registry(tools_dir)
    if format is ToolFormat.table:
        width = max((len(name) for name in registry.names()), default=4)
        for tool in registry:
            summary = (tool.description or "").strip().splitlines()
            typer.echo(f"{tool.name:<{width}}  {summary[0] if summary else ''}")
        return
    exported = (
        registry.to_openai(strict=strict)
        if format is ToolFormat.openai
        else registry.to_anthropic()
        if format is ToolFormat.anthropic
        else registry.to_mcp()
    )
    typer.echo(json.dumps(exported, indent=2))


@app.command("prepare")
def prepare_command(
    name: Annotated[str, typer.Argument(help="Tool name.")],
    arguments: Annotated[
        str, typer.Argument(help="Arguments as the model sent them (JSON text); - reads stdin.")
    ],
    tools_dir: ToolsDir = BUILTIN_TOOLS_DIR,
) -> None:
    """Repair and validate arguments for a tool, without running it.

    Prints the arguments the tool would run with, or the message the model
    would get (exit status 1).
    """
    registry = _registry(tools_dir)
    text = sys.stdin.read() if arguments == "-" else arguments
    try:
        prepared = registry.prepare_call(ToolCall("cli", name, text, "openai"))
    except ModelFacingError as exc:
        _fail(exc.to_model_message(), code=1)
    typer.echo(json.dumps(prepared.arguments, indent=2, ensure_ascii=False))


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _banner(
    url: str, token: Any, registry: ToolRegistry, pool_kind: str, grace: float, walls: str
) -> str:
    from agent_backend.tokens import TOKEN_ENV

    if token.path is None:
        where = f"token: from ${TOKEN_ENV}"
        header = f'-H "Authorization: Bearer ${TOKEN_ENV}"'
        setup = ""
    else:
        made = " (generated now, readable only by you)" if token.origin == "generated" else ""
        where = f"token: in {token.path}{made}"
        header = '-H "Authorization: Bearer $TOKEN"'
        setup = f"  TOKEN=$(cat {shlex.quote(str(token.path))})\n"
    body = shlex.quote(json.dumps({"name": "exec", "arguments": {"command": "echo hello"}}))
    return (
        f"agent-backend daemon on {url} (pool: {pool_kind}, {len(registry)} tools; MCP at {url}/mcp)\n"
        f"{where}\n"
        f"{walls}\n"
        "call it:\n"
        f"{setup}"
        f"  curl -s {header} '{url}/v1/tools?format=openai'\n"
        f"  curl -s {header} -H 'Content-Type: application/json' -d {body} {url}/v1/call\n"
        f"from Python: agent_backend.Client({url!r}) (docs/daemon.md)\n"
        f"stop: Ctrl-C or SIGTERM; calls in flight get {grace:g} s to finish"
    )


class _SettingsCommand(TyperCommand):
    """A command whose options named like a :class:`DaemonSettings` field default to unset,
    so that the settings fill them (from ``$AGENT_BACKEND_<NAME>``, the ``--env-file``, or
    their own defaults); its help shows what that gives. The defaults are read from the
    settings when the help is printed, so that the other commands never import the daemon."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from agent_backend.daemon import DaemonSettings

        prefix = DaemonSettings.model_config.get("env_prefix", "")
        for param in self.params:
            field = DaemonSettings.model_fields.get(param.name or "")
            if field is not None and isinstance(param, TyperOption) and param.name:
                param.show_default = f"${prefix}{param.name.upper()}, else {field.default}"
        super().format_help(ctx, formatter)


def _daemon_settings(
    ctx: typer.Context, token: str, env_file: Path | None, **options: Any
) -> DaemonSettings:
    """The daemon's settings: the options given, over the environment, over ``env_file``."""
    import pydantic

    from agent_backend.daemon import DaemonSettings

    given = {name: value for name, value in options.items() if value is not None}
    try:
        return DaemonSettings.load(env_file=env_file, tokens=(token,), **given)
    except pydantic.ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        name = str(error["loc"][0]) if error["loc"] else ""
        if not name:  # between settings (max_timeout under default_timeout)
            _fail(f"daemon settings: {error['msg']}", code=3)
        option = next((p for p in ctx.command.params if p.name == name), None)
        if name in given and option is not None:
            raise typer.BadParameter(error["msg"], ctx=ctx, param_hint=option.opts[0]) from None
        prefix = DaemonSettings.model_config.get("env_prefix", "")
        if error["type"] == "extra_forbidden":
            fields = [field for field in DaemonSettings.model_fields if field != "tokens"]
            known = ", ".join(f"{prefix}{field.upper()}" for field in fields)
            _fail(
                f"{env_file}: {name.upper()} is not a daemon setting (they are {known}); "
                f"the token goes in ${prefix}TOKEN or --token-file",
                code=3,
            )
        where = f"${prefix}{name.upper()}" + (f" (or {env_file})" if env_file else "")
        _fail(f"{where}: {error['msg']} (got {error.get('input')!r})", code=3)


@app.command("serve", cls=_SettingsCommand)
def serve_command(
    ctx: typer.Context,
    pool: PoolFile = None,
    isolation: IsolationOption = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="Address to listen on. Anything but loopback needs $AGENT_BACKEND_TOKEN "
            "or --token-file."
        ),
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (0: any free port).")] = None,
    tools_dir: PoolToolsDir = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="File with the bearer token (mode 0600). Default: $AGENT_BACKEND_TOKEN, else "
            "~/.config/agent-backend/token, generated on first start.",
            dir_okay=False,
        ),
    ] = None,
    grace: Annotated[
        float | None,
        typer.Option(help="Seconds calls in flight get to finish on SIGTERM/SIGINT."),
    ] = None,
    max_concurrent_per_token: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent",
            help="Tool calls one token may have in flight, a batch's each counted (more: 429).",
        ),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(help="Most calls in one batch, on /v1/batch and /mcp (more: 422)."),
    ] = None,
    max_sessions_per_token: Annotated[
        int | None,
        typer.Option("--max-sessions", help="Sessions one token may have open (more: 429)."),
    ] = None,
    session_ttl: Annotated[
        float | None,
        typer.Option(help="Seconds a session may sit idle before it is closed and removed."),
    ] = None,
    default_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a call may run unless its tool or the request says."),
    ] = None,
    max_timeout: Annotated[
        float | None,
        typer.Option(help="The most seconds a model may ask for with exec's timeout."),
    ] = None,
    output_limit: Annotated[
        int | None,
        typer.Option(help="Bytes of a call's output kept for the model (head and tail)."),
    ] = None,
    keep_alive_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds an idle keep-alive connection stays open."),
    ] = None,
    max_head_bytes: Annotated[
        int | None,
        typer.Option(help="Largest request line plus headers, before the token (more: 431)."),
    ] = None,
    head_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a request's line and headers have to arrive (later: 408)."),
    ] = None,
    body_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a request body may go without a byte (longer: 408)."),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(help="Most open connections (more: 503); None: 3/4 of the open-files limit."),
    ] = None,
    env_file: Annotated[
        Path | None,
        typer.Option(
            help="File of AGENT_BACKEND_<SETTING>=value lines, any DaemonSettings field "
            "(docs/daemon.md). The environment wins over it, and options over both.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
) -> None:
    """Run the HTTP daemon: the tools of --tools-dir (and a Ray pool's own), run on --pool, behind a token.

    Routes are under /v1 (OpenAPI at /openapi.json, Prometheus at /metrics, MCP at /mcp).
    Stops gracefully on SIGTERM or Ctrl-C, exit status 0.
    """
    from agent_backend.daemon import DaemonServer
    from agent_backend.dispatch import Dispatcher
    from agent_backend.pool_file import load_pools
    from agent_backend.tokens import is_loopback, load_token

    _logging(log_level)
    try:
        token = load_token(token_file)
        settings = _daemon_settings(
            ctx,
            token.token,
            env_file,
            host=host,
            port=port,
            grace=grace,
            max_concurrent_per_token=max_concurrent_per_token,
            max_batch=max_batch,
            max_sessions_per_token=max_sessions_per_token,
            session_ttl=session_ttl,
            default_timeout=default_timeout,
            max_timeout=max_timeout,
            output_limit=output_limit,
            keep_alive_timeout=keep_alive_timeout,
            max_head_bytes=max_head_bytes,
            head_timeout=head_timeout,
            body_timeout=body_timeout,
            max_connections=max_connections,
        )
        pools = load_pools(pool, isolation=_tier(isolation))
    except AgentBackendError as exc:
        _fail(str(exc), code=3)
    registry = _pool_registry(tools_dir, pools)
    explicit = token.origin == "env" or token_file is not None
    if not is_loopback(settings.host) and not explicit:
        _fail(
            f"refusing to listen on {settings.host} (not loopback) without a token you chose: "
            "set AGENT_BACKEND_TOKEN or pass --token-file",
            code=3,
        )

    async def main() -> None:
        options = {**pools.dispatcher_options(), **settings.dispatcher_options()}
        async with pools, Dispatcher(registry, **options) as dispatcher:
            server = DaemonServer(
                dispatcher, settings, token_explicit=explicit, log_level=log_level
            )
            async with anyio.create_task_group() as group:
                url = await group.start(server.serve)
                walls = pools.describe_walls()
                typer.echo(_banner(url, token, registry, pools.describe(), settings.grace, walls))

    try:
        anyio.run(main)
    except AgentBackendError as exc:
        _fail(f"{type(exc).__name__}: {exc}", code=3)


@app.command("mcp")
def mcp_command(
    pool: PoolFile = None,
    isolation: IsolationOption = None,
    tools_dir: PoolToolsDir = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "warning",
) -> None:
    """Serve the tools over MCP on stdin/stdout (for an MCP client to launch; see docs/mcp.md)."""
    from agent_backend.dispatch import Dispatcher
    from agent_backend.mcp import serve_stdio
    from agent_backend.pool_file import load_pools

    _logging(log_level)
    try:
        pools = load_pools(pool, isolation=_tier(isolation))
    except AgentBackendError as exc:
        _fail(str(exc), code=3)
    registry = _pool_registry(tools_dir, pools)

    async def main() -> None:
        # The stdio connection's session lives as long as the process: never reaped.
        options = pools.dispatcher_options()
        async with pools, Dispatcher(registry, **options, session_ttl=None) as dispatcher:
            await serve_stdio(dispatcher)

    try:
        anyio.run(main)
    except AgentBackendError as exc:
        _fail(f"{type(exc).__name__}: {exc}", code=3)


@app.command("call")
def call_command(
    name: Annotated[str, typer.Argument(help="Tool name, e.g. exec.")],
    arguments: Annotated[
        str,
        typer.Argument(help='Arguments as JSON text, e.g. \'{"command": "ls"}\'; - reads stdin.'),
    ] = "{}",
    pool: PoolFile = None,
    isolation: IsolationOption = None,
    tools_dir: PoolToolsDir = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Send the call to a running daemon instead (token: $AGENT_BACKEND_TOKEN "
            "or the daemon's token file)."
        ),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Seconds the tool may run.", min=0.001)
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the whole result as JSON.")
    ] = False,
) -> None:
    """Run one tool call and print its result; exit status 0 if it succeeded, 1 if not.

    The arguments are repaired and checked against the tool's schema first, as
    for a model's call; a call that cannot run prints the message the model
    would get.
    """
    from agent_backend.dispatch import Dispatcher, ToolResult
    from agent_backend.pool_file import load_pools

    text = sys.stdin.read() if arguments == "-" else arguments
    call = ToolCall("cli", name, text, "openai")

    async def local() -> ToolResult:
        pools = load_pools(pool, isolation=_tier(isolation))
        registry = _pool_registry(tools_dir, pools)
        async with pools, Dispatcher(registry, **pools.dispatcher_options()) as d:
            return await d.call(call, timeout=timeout)

    async def remote() -> ToolResult:
        from agent_backend.client import Client

        async with Client(url) as client:
            return await client.call(call, timeout=timeout)

    try:
        result = anyio.run(remote if url else local)
    except AgentBackendError as exc:
        _fail(f"{type(exc).__name__}: {exc}", code=3)
    if as_json:
        typer.echo(result.model_dump_json(indent=2))
    else:
        typer.echo(result.to_model_message())
        where = f" on {result.host}" if result.host else ""
        status = f", exit status {result.exit_status}" if result.exit_status is not None else ""
        state = "ok" if result.ok else (result.error_type or "error")
        typer.echo(f"[{result.tool}: {state}{status}, {result.duration:.3f} s{where}]", err=True)
    raise typer.Exit(0 if result.ok else 1)


@pool_app.command("check")
def pool_check_command(
    file: Annotated[
        Path | None,
        typer.Argument(
            help="Pool file (TOML), e.g. pools/ssh.example.toml. Default: the built-in local "
            "pool (pools/local.toml, shipped in the package).",
            exists=True,
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds each host gets to answer.", min=0.1)
    ] = 10.0,
    isolation: IsolationOption = None,
) -> None:
    """Connect to every host (or actor) of a pool file, run `true` there, and report health
    and the guarantees in force (isolation, limits).

    Exit status 0 when every host answered, 1 when one did not, 3 for a bad file.
    """
    from agent_backend.dispatch import Command
    from agent_backend.pool_file import load_pool, load_pool_config, with_isolation

    if file is None:
        file = DEFAULT_POOL_FILE
    try:
        config = load_pool_config(file)
        tier = _tier(isolation)
        backend = load_pool(config if tier is None else with_isolation(config, tier))
    except AgentBackendError as exc:
        _fail(str(exc), code=3)
    rows: list[tuple[str, str, str, str]] = []

    async def probe(host: Any) -> None:
        started = time.perf_counter()
        try:
            with anyio.fail_after(timeout + 1):
                outcome = await host.run(Command(argv=("true",), timeout=timeout))
        except TimeoutError:
            rows.append((host.name, "DOWN", "-", f"no answer within {timeout:g} s"))
            return
        except AgentBackendError as exc:
            rows.append((host.name, "DOWN", "-", f"{type(exc).__name__}: {exc}"))
            return
        took = f"{(time.perf_counter() - started) * 1000:.1f} ms"
        if outcome.exit_status == 0:
            rows.append((host.name, "ok", took, ""))
        else:
            detail = f"`true` exited {outcome.exit_status}" + (
                f" ({outcome.signal})" if outcome.signal else ""
            )
            rows.append((host.name, "FAILED", took, detail))

    walls: list[str] = []

    async def main() -> str:
        async with backend:
            async with anyio.create_task_group() as group:
                for host in backend.hosts:
                    group.start_soon(probe, host)
            walls.extend(backend.guarantees())
            return repr(backend)

    try:
        summary = anyio.run(main)
    except AgentBackendError as exc:
        _fail(f"{file}: the pool did not start: {type(exc).__name__}: {exc}", code=1)
    rows.sort()
    header = ("HOST", "STATUS", "LATENCY", "DETAIL")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        typer.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[3]
        )
    if walls:
        typer.echo("guarantees:")
        for line in walls:
            typer.echo(f"  {line}")
    healthy = sum(1 for row in rows if row[1] == "ok")
    typer.echo(f"{healthy}/{len(rows)} hosts healthy; {summary}")
    raise typer.Exit(0 if rows and healthy == len(rows) else 1)


# `agent-backend rollout` (docs/rollouts.md): its module imports only light things at the
# top, the rollout layer itself when the command runs, so `--help` stays fast.
from agent_backend.rollout.cli import rollout_command  # noqa: E402

app.command("rollout")(rollout_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
