"""Drivers for the MCP clients that live in ``.venv`` with agent_backend: the MCP SDK 2.x
``mcp.Client``, pydantic-ai's ``MCPToolset`` and the OpenAI Agents SDK's ``MCPServerStdio`` /
``MCPServerStreamableHttp``, each used the way its documentation shows.

Each driver runs a :class:`~support.mcp_client_cells.Scenario` in one MCP session and returns an
:class:`~support.mcp_client_cells.Outcome` (see ``tests/support/mcp_client_cells.py``). Frameworks are driven
by their own test models (pydantic-ai's ``FunctionModel`` / ``TestModel``, the Agents SDK's
``agents.testing.ScriptedModel``) making scripted tool calls; what a step records is what
the framework put in the model's next request. Drivers report; they never assert.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from support.mcp_client_cells import Call, Outcome, Scenario, Server, Step


def _raised(exc: BaseException) -> str:
    """``Type: message`` of what was raised; of each leaf, for an exception group."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_raised(leaf) for leaf in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


# -- MCP SDK 2.x ---------------------------------------------------------------------------------


async def run_mcp2(server: Server, scenario: Scenario) -> Outcome:
    import httpx2
    import mcp
    from mcp.client.streamable_http import streamable_http_client

    outcome = Outcome(tools={}, steps=[])

    async def session(client: mcp.Client) -> None:
        listed = await client.list_tools()
        outcome.tools = {tool.name: tool.input_schema for tool in listed.tools}
        for call in scenario.calls:
            result = await client.call_tool(
                call.name, call.arguments, read_timeout_seconds=scenario.client_timeout
            )
            text = "".join(block.text for block in result.content if block.type == "text")
            outcome.steps.append(Step(text, result.is_error, result.structured_content))

    try:
        if server.transport == "stdio":
            params = mcp.StdioServerParameters(
                command=server.command[0], args=list(server.command[1:]), cwd=server.cwd
            )
            async with mcp.Client(params) as client:
                await session(client)
        else:
            assert server.url is not None
            async with httpx2.AsyncClient(headers=server.headers, timeout=60) as http:
                transport = streamable_http_client(server.url, http_client=http)
                async with mcp.Client(transport) as client:
                    await session(client)
    except Exception as exc:
        outcome.raised = _raised(exc)
    return outcome


# -- pydantic-ai ---------------------------------------------------------------------------------


def pydantic_ai_toolset(server: Server, *, read_timeout: float | None = None) -> Any:
    """``MCPToolset`` on our server; ``keep_alive=False`` ends the stdio server with the toolset."""
    from fastmcp.client.transports import StdioTransport
    from pydantic_ai.mcp import MCPToolset

    options: dict[str, Any] = {} if read_timeout is None else {"read_timeout": read_timeout}
    # `agent-backend mcp` answers initialize in 2-3 s on an idle machine (imports), more on a
    # busy one: past pydantic-ai's default 5 s (docs/integrations.md passes the same).
    options["init_timeout"] = 60
    if server.transport == "stdio":
        transport = StdioTransport(
            command=server.command[0],
            args=list(server.command[1:]),
            cwd=server.cwd,
            keep_alive=False,
        )
        return MCPToolset(transport, **options)
    return MCPToolset(server.url, headers=server.headers, **options)


def _pydantic_ai_steps(messages: list[Any]) -> list[Step]:
    """The tool results in a request history, as the model reads them."""
    steps = []
    for message in messages:
        if message.kind != "request":
            continue
        for part in message.parts:
            if part.part_kind == "tool-return":
                failed = getattr(part, "outcome", "success") != "success"
                steps.append(Step(part.model_response_str(), failed))
            elif part.part_kind == "retry-prompt" and part.tool_name is not None:
                steps.append(Step(part.model_response(), True))
    return steps


async def run_pydantic_ai(server: Server, scenario: Scenario) -> Outcome:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    outcome = Outcome(tools={}, steps=[])
    seen: list[Any] = []

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        outcome.tools = {tool.name: tool.parameters_json_schema for tool in info.function_tools}
        seen[:] = messages
        turn = sum(1 for message in messages if isinstance(message, ModelResponse))
        if turn < len(scenario.calls):
            call = scenario.calls[turn]
            return ModelResponse(
                parts=[ToolCallPart(call.name, call.arguments, tool_call_id=f"call_{turn}")]
            )
        return ModelResponse(parts=[TextPart("done")])

    toolset = pydantic_ai_toolset(server, read_timeout=scenario.client_timeout)
    agent = Agent(FunctionModel(model), toolsets=[toolset])
    try:
        async with agent:
            await agent.run("Use the tools.")
    except Exception as exc:
        outcome.raised = _raised(exc)
    outcome.steps = _pydantic_ai_steps(seen)
    return outcome


async def run_pydantic_ai_test_model(server: Server, *, tools: list[str]) -> Outcome:
    """pydantic-ai's ``TestModel``, which calls ``tools`` with arguments made from their schemas."""
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    outcome = Outcome(tools={}, steps=[])
    model = TestModel(call_tools=tools)
    agent = Agent(model, toolsets=[pydantic_ai_toolset(server)])
    try:
        async with agent:
            result = await agent.run("Use the tools.")
        outcome.steps = _pydantic_ai_steps(result.all_messages())
    except Exception as exc:
        outcome.raised = _raised(exc)
    if model.last_model_request_parameters is not None:
        offered = model.last_model_request_parameters.function_tools
        outcome.tools = {tool.name: tool.parameters_json_schema for tool in offered}
    return outcome


# -- OpenAI Agents SDK ---------------------------------------------------------------------------


def _function_output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, dict):
        return str(output.get("text", json.dumps(output)))
    if isinstance(output, list):
        return "".join(_function_output_text(item) for item in output)
    return str(output)


def openai_agents_model(calls: list[Call]) -> Any:
    """The Agents SDK's own ``ScriptedModel``: ``calls``, one per turn, then "done"."""
    from agents.testing import ScriptedModel, assistant_message, function_call

    steps: list[Any] = [
        [function_call(call.name, call.arguments, call_id=f"call_{turn}")]
        for turn, call in enumerate(calls)
    ]
    return ScriptedModel([*steps, [assistant_message("done")]])


def _openai_agents_outcome(model: Any, outcome: Outcome) -> None:
    """The tools and tool outputs of the last request ``model`` got."""
    from agents import FunctionTool

    last = model.last_call
    if last is None:
        return
    outcome.tools = {
        tool.name: tool.params_json_schema for tool in last.tools if isinstance(tool, FunctionTool)
    }
    items = [] if isinstance(last.input, str) else list(last.input)
    outcome.steps = [
        Step(_function_output_text(item.get("output")), None)
        for item in items
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    ]


def openai_agents_server(
    server: Server, *, use_structured_content: bool, timeout: float | None = None
) -> Any:
    from agents.mcp import MCPServerStdio, MCPServerStreamableHttp

    options: dict[str, Any] = {"use_structured_content": use_structured_content}
    if timeout is not None:
        options["client_session_timeout_seconds"] = timeout
    if server.transport == "stdio":
        params = {"command": server.command[0], "args": list(server.command[1:]), "cwd": server.cwd}
        return MCPServerStdio(params, name="agent-backend", **options)
    return MCPServerStreamableHttp(
        {"url": server.url, "headers": server.headers}, name="agent-backend", **options
    )


def run_openai_agents(*, structured: bool) -> Callable[[Server, Scenario], Awaitable[Outcome]]:
    async def run(server: Server, scenario: Scenario) -> Outcome:
        from agents import Agent, RunConfig, Runner

        outcome = Outcome(tools={}, steps=[])
        model = openai_agents_model(scenario.calls)
        mcp_server = openai_agents_server(
            server, use_structured_content=structured, timeout=scenario.client_timeout
        )
        try:
            async with mcp_server:
                agent = Agent(name="matrix", model=model, mcp_servers=[mcp_server])
                await Runner.run(
                    agent, "Use the tools.", run_config=RunConfig(tracing_disabled=True)
                )
        except Exception as exc:
            outcome.raised = _raised(exc)
        _openai_agents_outcome(model, outcome)
        return outcome

    return run
