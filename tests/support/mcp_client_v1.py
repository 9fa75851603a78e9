"""The clients that need the MCP SDK 1.x, run inside ``.venv-mcp1`` (scripts/ensure-mcp-clients.sh).

* ``mcp1``: the SDK's ``ClientSession`` over ``stdio_client`` / ``streamable_http_client``.
* ``langchain``: langchain-mcp-adapters (whose releases require ``mcp<2``): the tools of one
  ``MultiServerMCPClient.session()`` from ``load_mcp_tools``, in a ``langchain.agents.create_agent``
  agent driven by LangChain's own ``GenericFakeChatModel``, given ``bind_tools`` as LangChain's
  tests do for their fake tool-calling model.

A worker: it reads one JSON request per line on stdin (``{"id", "client", "server",
"scenario"}``, shaped as in ``tests/support/mcp_client_cells.py``) and writes one JSON line per
request on stdout, ``{"id", "outcome"}``, or ``{"id", "crash": traceback}`` if the driver
itself broke. It imports neither
agent_backend nor pytest (neither is installed here), and writes nothing else to stdout:
servers it launches write their logs to its stderr.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from datetime import timedelta
from typing import Any


def _raised(exc: BaseException) -> str:
    """``Type: message`` of what was raised; of each leaf, for an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_raised(leaf) for leaf in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def _text(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    parts = []
    for block in blocks:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            parts.append(str(block.get("text", "")))
        elif getattr(block, "type", None) == "text":
            parts.append(block.text)
    return "".join(parts)


async def run_mcp1(server: dict[str, Any], scenario: dict[str, Any]) -> dict[str, Any]:
    import httpx
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client

    outcome: dict[str, Any] = {"tools": {}, "steps": [], "raised": None}
    timeout = scenario["client_timeout"]
    read_timeout = None if timeout is None else timedelta(seconds=timeout)

    async def session(read: Any, write: Any) -> None:
        async with ClientSession(read, write) as client:
            await client.initialize()
            listed = await client.list_tools()
            outcome["tools"] = {tool.name: tool.inputSchema for tool in listed.tools}
            for call in scenario["calls"]:
                result = await client.call_tool(
                    call["name"], call["arguments"], read_timeout_seconds=read_timeout
                )
                outcome["steps"].append(
                    {
                        "text": _text(result.content),
                        "is_error": result.isError,
                        "structured": result.structuredContent,
                    }
                )

    try:
        if server["transport"] == "stdio":
            command = server["command"]
            params = StdioServerParameters(command=command[0], args=command[1:], cwd=server["cwd"])
            async with stdio_client(params) as (read, write):
                await session(read, write)
        else:
            headers = {"Authorization": f"Bearer {server['token']}"}
            async with (
                httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(60)) as http,
                streamable_http_client(server["url"], http_client=http) as streams,
            ):
                await session(streams[0], streams[1])
    except Exception as exc:
        outcome["raised"] = _raised(exc)
    return outcome


def _scripted_chat_model(calls: list[dict[str, Any]]) -> Any:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    class ScriptedChatModel(GenericFakeChatModel):
        """GenericFakeChatModel that takes tools and records what each request showed it."""

        offered: dict[str, Any]
        requests: list[list[Any]]

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            for tool in tools:
                spec = convert_to_openai_tool(tool)["function"]
                self.offered[spec["name"]] = spec.get("parameters", {})
            return self

        def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            self.requests.append(list(messages))
            return super()._generate(messages, *args, **kwargs)

    script: list[Any] = [
        AIMessage(
            content="",
            tool_calls=[
                {
                    "name": call["name"],
                    "args": call["arguments"],
                    "id": f"call_{turn}",
                    "type": "tool_call",
                }
            ],
        )
        for turn, call in enumerate(calls)
    ]
    script.append(AIMessage(content="done"))
    return ScriptedChatModel(messages=iter(script), offered={}, requests=[])


async def run_langchain(server: dict[str, Any], scenario: dict[str, Any]) -> dict[str, Any]:
    from langchain.agents import create_agent
    from langchain_core.messages import ToolMessage
    from langchain_mcp_adapters.client import MultiServerMCPClient
    from langchain_mcp_adapters.tools import load_mcp_tools

    outcome: dict[str, Any] = {"tools": {}, "steps": [], "raised": None}
    connection: dict[str, Any]
    if server["transport"] == "stdio":
        command = server["command"]
        connection = {
            "transport": "stdio",
            "command": command[0],
            "args": command[1:],
            "cwd": server["cwd"],
        }
    else:
        connection = {
            "transport": "streamable_http",
            "url": server["url"],
            "headers": {"Authorization": f"Bearer {server['token']}"},
        }
    # The adapters' only timeout knob is the session's read timeout (``session_kwargs``), which
    # also bounds ``initialize``: on a loaded machine a 2 s budget could run out while the stdio
    # server starts, and the cell would test the server's start time. The client's own time
    # limit is put on the agent's run instead (``asyncio.timeout``), once the session is up.
    model = _scripted_chat_model(scenario["calls"])
    client = MultiServerMCPClient({"agent-backend": connection})
    try:
        async with client.session("agent-backend") as session:
            tools = await load_mcp_tools(session)
            agent = create_agent(model, tools)
            async with asyncio.timeout(scenario["client_timeout"]):
                await agent.ainvoke({"messages": [{"role": "user", "content": "Use the tools."}]})
    except Exception as exc:
        outcome["raised"] = _raised(exc)
    outcome["tools"] = dict(model.offered)
    if model.requests:
        outcome["steps"] = [
            {
                "text": _text(message.content),
                "is_error": message.status == "error",
                "structured": None,
            }
            for message in model.requests[-1]
            if isinstance(message, ToolMessage)
        ]
    return outcome


DRIVERS = {"mcp1": run_mcp1, "langchain": run_langchain}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply: dict[str, Any] = {"id": request.get("id")}
        try:
            driver = DRIVERS[request["client"]]
            reply["outcome"] = asyncio.run(driver(request["server"], request["scenario"]))
        except Exception:
            reply["crash"] = traceback.format_exc()
        sys.stdout.write(json.dumps(reply, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
