"""Every BFCL function schema (real, with legacy type names) loads, exports and round-trips.

The Berkeley Function Calling Leaderboard data lives beside the project in
``../shared/realworld/bfcl`` (one JSON object per line; ``function`` holds
the tool definitions, ``*.possible_answer.json`` the ground-truth calls).
Outside this repository it is absent and these tests skip; under ``CI=true``
its absence is a failure.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.realworld import BFCL, realworld_missing_reason

from agent_backend.errors import ToolArgumentError
from agent_backend.tools import Tool, ToolCall, ToolRegistry, tool_from_definition
from agent_backend.tools.legacy import JSON_TYPES


def _require_bfcl() -> Path:
    reason = realworld_missing_reason()  # raises under CI=true
    if reason is not None:
        pytest.skip(reason)
    return BFCL


def _entries() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(_require_bfcl().glob("BFCL_*.json")):
        if path.name.endswith(".possible_answer.json"):
            continue
        with path.open() as lines:
            for line in lines:
                yield path, json.loads(line)


@pytest.fixture(scope="module")
def bfcl_tools() -> dict[str, Tool]:
    """Every distinct BFCL function definition, loaded once: canonical JSON -> Tool."""
    logging.getLogger("agent_backend.tools").disabled = True  # ~6000 expected warnings
    try:
        tools: dict[str, Tool] = {}
        for path, entry in _entries():
            for i, definition in enumerate(entry["function"]):
                key = json.dumps(definition, sort_keys=True)
                if key not in tools:
                    tools[key] = tool_from_definition(
                        definition, source=f"{path.name}:{entry['id']}", pointer=f"/function/{i}"
                    )
        return tools
    finally:
        logging.getLogger("agent_backend.tools").disabled = False


def test_every_bfcl_schema_loads(bfcl_tools: dict[str, Tool]) -> None:
    # 6131 definitions in the stored data, 2365 of them distinct; none legitimately fails.
    assert len(bfcl_tools) >= 2000
    normalized = [t for t in bfcl_tools.values() if t.normalizations]
    # Every BFCL root is "type": "dict".
    assert len(normalized) == len(bfcl_tools)
    for tool in bfcl_tools.values():
        assert "/type" in tool.normalizations
        for pointer in tool.normalizations:
            node: Any = tool.parameters
            for token in pointer.strip("/").split("/")[:-1]:
                node = (
                    node[int(token)]
                    if isinstance(node, list)
                    else node[token.replace("~1", "/").replace("~0", "~")]
                )
            value = node.get("type")  # absent: "any" was dropped
            assert value is None or set(value if isinstance(value, list) else [value]) <= JSON_TYPES


def test_every_bfcl_entry_builds_a_registry_and_exports_round_trip(
    bfcl_tools: dict[str, Tool],
) -> None:
    entries = 0
    for _, entry in _entries():
        tools = [bfcl_tools[json.dumps(d, sort_keys=True)] for d in entry["function"]]
        registry = ToolRegistry(tools)
        entries += 1
        openai = registry.to_openai()
        for exported, tool in zip(openai, tools, strict=True):
            assert "." not in exported["function"]["name"]
            assert registry.get(exported["function"]["name"]) is tool
            assert exported["function"]["parameters"] == tool.parameters
        assert [d["input_schema"] for d in registry.to_anthropic()] == [t.parameters for t in tools]
        assert [d["name"] for d in registry.to_mcp()] == [t.name for t in tools]
    assert entries > 2000


def test_bfcl_exports_reload_to_the_same_tools(bfcl_tools: dict[str, Tool]) -> None:
    # A deterministic tenth of the distinct definitions, through all three shapes
    # (each reload compiles the schema again).
    sample = list(bfcl_tools.values())[::10]
    registry = ToolRegistry()
    for tool in sample:
        if tool.name not in registry:
            registry.add(tool)
    for shape in (registry.to_openai(), registry.to_anthropic(), registry.to_mcp()):
        for definition, original in zip(shape, registry, strict=True):
            again = tool_from_definition(definition)
            assert again.parameters == original.parameters
            assert again.description == original.description
            assert again.normalizations == ()


_OMIT = object()


def _first_possible(options: Any) -> Any:
    """The first acceptable value of a BFCL ground-truth option list ("" means: may be omitted)."""
    if not isinstance(options, list):
        return _pick(options)
    for option in options:
        if option != "":
            return _pick(option)
    return _OMIT


def _pick(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, o in value.items() if (v := _first_possible(o)) is not _OMIT}
    if isinstance(value, list):
        return [_pick(v) for v in value]
    return value


def test_bfcl_ground_truth_calls_prepare(bfcl_tools: dict[str, Tool]) -> None:
    """Real calls through ``prepare_call`` in two formats; BFCL's own quirks are the only failures.

    A ground-truth value equal to an optional parameter's declared default is left
    out (BFCL's checker treats those as "use the default"; many are ``null``
    for a non-nullable type). What still fails is wrong in the data itself
    (a boolean for a ``string``, ``"dontcare"`` outside an ``enum``, a
    required parameter missing), so a small, bounded share may fail.
    """
    answers: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(_require_bfcl().glob("*.possible_answer.json")):
        with path.open() as lines:
            for line in lines:
                answer = json.loads(line)
                answers[answer["id"]] = answer["ground_truth"]
    total = passed = 0
    failures: list[str] = []
    for _, entry in _entries():
        registry = ToolRegistry(
            bfcl_tools[json.dumps(d, sort_keys=True)] for d in entry["function"]
        )
        for index, call in enumerate(answers.get(entry["id"], [])):
            ((name, params),) = call.items()
            schema = registry.get(name).parameters
            properties = schema.get("properties", {})
            required = schema.get("required", [])
            arguments = {
                key: value
                for key, options in params.items()
                if (value := _first_possible(options)) is not _OMIT
                and (key in required or properties.get(key, {}).get("default", _OMIT) != value)
            }
            for call_ in (
                ToolCall(
                    f"call_{index}", registry.export_name(name), json.dumps(arguments), "openai"
                ),
                ToolCall(f"call_{index}", name, arguments, "mcp"),
            ):
                total += 1
                try:
                    prepared = registry.prepare_call(call_)
                except ToolArgumentError as exc:
                    failures.append(f"{entry['id']} {name}: {exc.to_model_message(400)}")
                    continue
                passed += 1
                assert prepared.tool is registry.get(name)
    assert total > 6000
    assert passed / total >= 0.985, "\n".join(failures[:80])
