"""The ``agent-backend`` command line: list tools, repair arguments, call a tool on a pool.

Uses only the public API. Exit status reflects the result: 0 when the call
(or the preparation) succeeded, 1 when the model-facing answer is an error,
2 for usage errors (typer's), 3 for a configuration or infrastructure error.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from agent_backend.errors import AgentBackendError, ModelFacingError
from agent_backend.tools import ToolCall, ToolRegistry

app = typer.Typer(
    name="agent-backend",
    help="Run AI agents' tool calls: repair arguments against each tool's JSON Schema, "
    "then execute them on a pool of hosts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEFAULT_TOOLS_DIR = Path(__file__).resolve().parents[1] / "schemas" / "tools"

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


class ToolFormat(StrEnum):
    table = "table"
    openai = "openai"
    anthropic = "anthropic"
    mcp = "mcp"


def _registry(tools_dir: Path) -> ToolRegistry:
    try:
        return ToolRegistry.from_dir(tools_dir)
    except AgentBackendError as exc:
        _fail(str(exc), code=3)


def _fail(message: str, *, code: int) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(code)


@app.command("tools")
def tools_command(
    tools_dir: ToolsDir = DEFAULT_TOOLS_DIR,
    format: Annotated[
        ToolFormat, typer.Option("--format", "-f", help="table, or the JSON a provider expects.")
    ] = ToolFormat.table,
) -> None:
    """List the tools in a tool folder, as a table or in OpenAI, Anthropic or MCP shape."""
    registry = _registry(tools_dir)
    if format is ToolFormat.table:
        width = max((len(name) for name in registry.names()), default=4)
        for tool in registry:
            summary = (tool.description or "").strip().splitlines()
            typer.echo(f"{tool.name:<{width}}  {summary[0] if summary else ''}")
        return
    exported = {
        ToolFormat.openai: registry.to_openai,
        ToolFormat.anthropic: registry.to_anthropic,
        ToolFormat.mcp: registry.to_mcp,
    }[format]()
    typer.echo(json.dumps(exported, indent=2))


@app.command("prepare")
def prepare_command(
    name: Annotated[str, typer.Argument(help="Tool name.")],
    arguments: Annotated[
        str, typer.Argument(help="Arguments as the model sent them (JSON text); - reads stdin.")
    ],
    tools_dir: ToolsDir = DEFAULT_TOOLS_DIR,
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
