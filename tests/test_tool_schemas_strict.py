"""The built-in tools' schemas as strict clients and schema-driven clients take them.

* The canonical schemas: valid, ``exec`` says exactly one of ``command``/``argv``
  without a top-level combinator (the OpenAI and Anthropic APIs refuse those),
  every export valid JSON Schema.
* The strict variant (``to_openai(strict=True)``): taken unchanged by the OpenAI
  Agents SDK (``ensure_strict_json_schema``, ``FunctionTool(strict_json_schema=True)``)
  and by pydantic-ai's OpenAI strict transformer.
* Calls written against the variant (nulls for what is left out, maps as pairs)
  mean the canonical call: prepared the same, and run the same through a real
  ``Dispatcher`` and through the Agents SDK's ``FunctionTool``.
* pydantic-ai's ``TestModel``, generating arguments from each canonical schema,
  makes calls that pass validation and run.
* ``strict_schema`` on other schemas: pydantic-generated ones, and the shapes
  that have no strict form.

All with the real packages (openai-agents, pydantic-ai, jsonschema); the tests that need a
framework skip without it, except under CI=true, where they fail.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import anyio
import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_backend import SchemaError, ToolArgumentError
from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.dispatch import BUILTIN_DEFINITIONS, Dispatcher, Session, builtin_tools
from agent_backend.schema import strict_schema
from agent_backend.tools import Tool, ToolCall, ToolRegistry, to_openai, tool_from_function

pytestmark = pytest.mark.timeout(60)

BUILTINS = {tool.name: tool for tool in builtin_tools()}
NAMES = sorted(BUILTINS)
Draft = jsonschema.Draft202012Validator


def _framework(module: str, extra: str) -> None:
    """Skip without ``module`` (fail under CI=true: ``make test`` installs the extras)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {module} is not installed: {exc}")
        pytest.skip(f"{module} is not installed: pip install -e '.[{extra}]'")


def agents_sdk() -> SimpleNamespace:
    """The OpenAI Agents SDK's strict-schema and function-tool parts."""
    _framework("agents", "openai-agents")
    from agents import FunctionTool
    from agents.exceptions import UserError
    from agents.strict_schema import ensure_strict_json_schema
    from agents.tool import invoke_function_tool
    from agents.tool_context import ToolContext

    return SimpleNamespace(
        FunctionTool=FunctionTool,
        UserError=UserError,
        ensure_strict_json_schema=ensure_strict_json_schema,
        invoke_function_tool=invoke_function_tool,
        ToolContext=ToolContext,
    )


def pydantic_ai() -> SimpleNamespace:
    """pydantic-ai's agent, TestModel, schema tools and OpenAI strict transformer."""
    _framework("pydantic_ai", "pydantic-ai")
    from pydantic_ai import Agent, Tool
    from pydantic_ai.models.test import TestModel
    from pydantic_ai.profiles.openai import OpenAIJsonSchemaTransformer

    return SimpleNamespace(
        Agent=Agent,
        Tool=Tool,
        TestModel=TestModel,
        OpenAIJsonSchemaTransformer=OpenAIJsonSchemaTransformer,
    )


def strict_parameters(name: str) -> dict[str, Any]:
    return to_openai(BUILTINS[name], strict=True)["function"]["parameters"]


def strict_form(schema: dict[str, Any], value: Any) -> Any:
    """``value`` (a canonical call's arguments) as a strict client writes it: every property
    present, null for the ones left out, maps as ``{"name", "value"}`` pairs. Written here
    from the rules, independently of the code under test."""
    inner = schema.get("additionalProperties")
    if schema.get("type") == "object" and isinstance(inner, dict) and not schema.get("properties"):
        return [{"name": k, "value": strict_form(inner, v)} for k, v in value.items()]
    if isinstance(schema.get("properties"), dict):
        return {
            key: strict_form(sub, value[key]) if key in value else None
            for key, sub in schema["properties"].items()
        }
    if schema.get("type") == "array" and isinstance(value, list):
        return [strict_form(schema["items"], item) for item in value]
    return value


# -- the canonical schemas -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_every_export_is_a_valid_schema_without_top_level_combinators(name: str) -> None:
    tool = BUILTINS[name]
    registry = ToolRegistry([tool])
    exported = [
        registry.to_openai()[0]["function"]["parameters"],
        registry.to_openai(strict=True)[0]["function"]["parameters"],
        registry.to_anthropic()[0]["input_schema"],
        registry.to_mcp()[0]["inputSchema"],
    ]
    for schema in exported:
        Draft.check_schema(schema)
        assert schema["type"] == "object"
        # OpenAI: "schema must have type 'object' and not have 'oneOf'/'anyOf'/'allOf'/'enum'/
        # 'const'/'not' at the top level"; Anthropic: "input_schema does not support oneOf,
        # allOf, or anyOf at the top level".
        assert not {"oneOf", "anyOf", "allOf", "enum", "const", "not"} & schema.keys()
    assert exported[0] == exported[2] == exported[3] == BUILTIN_DEFINITIONS[name]["parameters"]


@pytest.mark.parametrize(
    ("arguments", "valid"),
    [
        ({"command": "ls"}, True),
        ({"argv": ["ls", "-l"]}, True),
        ({"command": "ls", "timeout": 5, "env": {"A": "1"}}, True),
        ({}, False),
        ({"timeout": 5}, False),
        ({"command": "ls", "argv": ["ls"]}, False),
    ],
)
def test_exec_schema_says_exactly_one_of_command_and_argv(
    arguments: dict[str, Any], valid: bool
) -> None:
    schema = BUILTIN_DEFINITIONS["exec"]["parameters"]
    assert Draft(schema).is_valid(arguments) is valid  # the reference validator agrees
    if valid:
        assert BUILTINS["exec"].prepare(arguments) == arguments
    else:
        with pytest.raises(ToolArgumentError):
            BUILTINS["exec"].prepare(arguments)


def test_exec_messages_say_which_to_give_or_leave_out() -> None:
    with pytest.raises(ToolArgumentError) as neither:
        BUILTINS["exec"].prepare({})
    assert "missing required property 'command'" in neither.value.to_model_message()
    with pytest.raises(ToolArgumentError) as both:
        BUILTINS["exec"].prepare({"command": "ls", "argv": ["ls"]})
    assert '"command" must be left out here' in both.value.to_model_message()


def test_exec_examples_are_valid_calls() -> None:
    schema = BUILTIN_DEFINITIONS["exec"]["parameters"]
    for example in schema["examples"]:
        Draft(schema).validate(example)


def test_agents_sdk_does_not_strictify_canonical_exec_on_its_own() -> None:
    """Over MCP with ``convert_schemas_to_strict``, the SDK would make every property required
    (both command and argv): it refuses the map instead, and serves exec non-strict."""
    sdk = agents_sdk()
    with pytest.raises(sdk.UserError, match="additionalProperties"):
        sdk.ensure_strict_json_schema(copy.deepcopy(BUILTIN_DEFINITIONS["exec"]["parameters"]))


# -- the strict variant, as the real SDKs take it ------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_strict_variant_is_what_the_agents_sdk_would_make_of_it(name: str) -> None:
    sdk = agents_sdk()
    params = strict_parameters(name)
    assert sdk.ensure_strict_json_schema(copy.deepcopy(params)) == params

    async def never(ctx: Any, arguments: str) -> str:
        raise AssertionError("not called")

    tool = sdk.FunctionTool(
        name=name,
        description=BUILTINS[name].description,
        params_json_schema=copy.deepcopy(params),
        on_invoke_tool=never,
        strict_json_schema=True,
    )
    assert tool.strict_json_schema is True
    assert tool.params_json_schema == params


@pytest.mark.parametrize("name", NAMES)
def test_strict_variant_passes_pydantic_ai_openai_strict_checks(name: str) -> None:
    transformer = pydantic_ai().OpenAIJsonSchemaTransformer
    params = strict_parameters(name)
    compatible = transformer(copy.deepcopy(params), strict=None)
    assert compatible.walk() == params
    assert compatible.is_strict_compatible
    assert transformer(copy.deepcopy(params), strict=True).walk() == params


def test_strict_exec_writes_env_as_pairs_and_every_property_nullable() -> None:
    params = strict_parameters("exec")
    assert params["required"] == ["command", "argv", "timeout", "stdin", "env"]
    assert all("null" in prop["type"] for prop in params["properties"].values())
    pair = params["properties"]["env"]["items"]
    assert pair["required"] == ["name", "value"]
    assert pair["properties"]["name"]["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"
    assert to_openai(BUILTINS["exec"], strict=True)["function"]["strict"] is True
    assert "strict" not in to_openai(BUILTINS["exec"])["function"]


# -- strict calls mean the canonical call --------------------------------------------------------

_ENV_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True)
_EXEC_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "timeout": st.floats(min_value=0.001, max_value=1e6),
        "stdin": st.text(max_size=20),
        "env": st.dictionaries(_ENV_NAMES, st.text(max_size=10), max_size=3),
    },
)
_CANONICAL_CALLS = {
    "exec": _EXEC_OPTIONS.flatmap(
        lambda options: st.one_of(
            st.text(min_size=1, max_size=20).map(lambda line: {"command": line, **options}),
            st.lists(st.text(max_size=8), min_size=1, max_size=3).map(
                lambda argv: {"argv": argv, **options}
            ),
        )
    ),
    "read_file": st.fixed_dictionaries(
        {"path": st.text(min_size=1, max_size=20)},
        optional={"offset": st.integers(min_value=0), "limit": st.integers(min_value=1)},
    ),
    "write_file": st.fixed_dictionaries(
        {"path": st.text(min_size=1, max_size=20), "content": st.text(max_size=40)}
    ),
    "list_dir": st.fixed_dictionaries({}, optional={"path": st.text(min_size=1, max_size=20)}),
}


@pytest.mark.parametrize("name", NAMES)
def test_a_strict_call_prepares_to_the_canonical_call(name: str) -> None:
    tool = BUILTINS[name]
    canonical_schema = BUILTIN_DEFINITIONS[name]["parameters"]
    strict_validator = Draft(strict_parameters(name))

    @settings(max_examples=150, deadline=None)
    @given(_CANONICAL_CALLS[name])
    def check(canonical: dict[str, Any]) -> None:
        assert Draft(canonical_schema).is_valid(canonical)
        strict = strict_form(canonical_schema, canonical)
        strict_validator.validate(strict)
        assert tool.prepare(strict) == tool.prepare(canonical) == canonical
        assert tool.prepare(json.dumps(strict)) == canonical  # as JSON text, as models send it

    check()


def test_strict_exec_with_both_command_and_argv_is_refused() -> None:
    strict = {"command": "ls", "argv": ["ls"], "timeout": None, "stdin": None, "env": None}
    Draft(strict_parameters("exec")).validate(strict)  # the subset cannot say it...
    with pytest.raises(ToolArgumentError) as refused:
        BUILTINS["exec"].prepare(strict)  # ...the canonical schema still does
    assert '"command" must be left out' in refused.value.to_model_message()


def test_repair_keeps_what_the_canonical_schema_accepts() -> None:
    schema = {
        "type": "object",
        "properties": {
            "maybe": {"type": ["string", "null"]},
            "needed": {"type": "integer"},
            "either": {"type": ["object", "array"], "additionalProperties": {"type": "string"}},
        },
        "required": ["needed"],
    }
    tool = Tool("t", parameters=schema)
    pairs = [{"name": "a", "value": "1"}]
    assert tool.prepare({"needed": 1, "maybe": None}) == {"needed": 1, "maybe": None}
    assert tool.prepare({"needed": 1, "either": pairs}) == {"needed": 1, "either": pairs}
    with pytest.raises(ToolArgumentError) as refused:
        tool.prepare({"needed": None})  # required: null is not "left out"
    assert "/needed: expected integer, got null" in refused.value.to_model_message()


@pytest.mark.parametrize(
    "pairs",
    [
        [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}],  # which one was meant?
        [{"name": "A", "value": "1", "extra": 0}],
        [{"name": 1, "value": "1"}],
        [["A", "1"]],
    ],
)
def test_pairs_that_do_not_spell_one_object_are_refused(pairs: list[Any]) -> None:
    with pytest.raises(ToolArgumentError) as refused:
        BUILTINS["exec"].prepare({"command": "env", "env": pairs})
    assert "- /env: expected object, got array" in refused.value.to_model_message()


@pytest.fixture
async def session(tmp_path: Path) -> AsyncIterator[Session]:
    config = LocalPoolConfig(workspace_root=str(tmp_path / "ws"), kill_grace=0.5)
    async with (
        LocalBackend(config) as backend,
        Dispatcher(ToolRegistry(builtin_tools()), backend) as dispatcher,
        dispatcher.session() as session,
    ):
        yield session


_RUNS = [
    (
        "exec",
        {"command": 'printf "%s" "$GREETING"; cat', "stdin": "!", "env": {"GREETING": "hi"}},
        "hi!",
    ),
    ("exec", {"argv": ["printf", "%s", "argv"], "timeout": 5}, "argv"),
    ("write_file", {"path": "notes/a.txt", "content": "abc"}, "wrote 3 bytes to notes/a.txt"),
    ("read_file", {"path": "notes/a.txt"}, "abc"),
    ("read_file", {"path": "notes/a.txt", "offset": 1}, "bc"),
    ("list_dir", {}, "notes/"),
]


@pytest.mark.anyio
async def test_strict_calls_run_as_the_canonical_ones_through_a_dispatcher(
    session: Session,
) -> None:
    for name, canonical, output in _RUNS:
        strict = strict_form(BUILTIN_DEFINITIONS[name]["parameters"], canonical)
        by_strict = await session.call(ToolCall("s", name, json.dumps(strict), "openai"))
        by_canonical = await session.call(ToolCall("c", name, json.dumps(canonical), "openai"))
        assert by_strict.ok, by_strict
        assert by_strict.output.startswith(output), (name, by_strict.output)
        assert by_strict.output == by_canonical.output


@pytest.mark.anyio
async def test_a_function_tool_built_from_the_strict_export_runs_real_calls(
    session: Session,
) -> None:
    """The Agents SDK's own FunctionTool, strict, forwarding to the session: what an
    OpenAI model in strict mode sends reaches the tool and runs."""
    sdk = agents_sdk()
    tools = {}
    for entry in ToolRegistry(builtin_tools()).to_openai(strict=True):
        function = entry["function"]

        async def forward(ctx: Any, arguments: str) -> str:
            result = await session.call(
                ToolCall(ctx.tool_call_id, ctx.tool_name, arguments, "openai")
            )
            return result.to_model_message()

        tools[function["name"]] = sdk.FunctionTool(
            name=function["name"],
            description=function["description"],
            params_json_schema=function["parameters"],
            on_invoke_tool=forward,
            strict_json_schema=function["strict"],
        )
    for index, (name, canonical, output) in enumerate(_RUNS):
        arguments = json.dumps(strict_form(BUILTIN_DEFINITIONS[name]["parameters"], canonical))
        context = sdk.ToolContext(
            context=None, tool_name=name, tool_call_id=f"call_{index}", tool_arguments=arguments
        )
        answer = await sdk.invoke_function_tool(
            function_tool=tools[name], context=context, arguments=arguments
        )
        assert str(answer).startswith(output), (name, answer)


@pytest.mark.anyio
async def test_pydantic_ai_test_model_makes_calls_that_validate_and_run(
    session: Session,
) -> None:
    """TestModel generates each tool's arguments from its canonical schema (it sent ``{}`` to
    exec before the schema said command-or-argv); every call passes validation and runs."""
    framework = pydantic_ai()
    results = {}

    def forward(name: str) -> Any:
        async def run(**arguments: Any) -> str:
            result = await session.call(ToolCall(f"call_{name}", name, arguments, "openai"))
            results[name] = result
            return result.to_model_message()

        return run

    tools = [
        framework.Tool.from_schema(
            forward(name),
            name=name,
            description=BUILTINS[name].description,
            json_schema=copy.deepcopy(BUILTIN_DEFINITIONS[name]["parameters"]),
        )
        for name in NAMES
    ]
    await framework.Agent(framework.TestModel(), tools=tools).run("use every tool")
    assert sorted(results) == NAMES
    for name, result in results.items():
        assert result.error_type != "ToolArgumentError", (name, result.error)
    assert results["exec"].ok
    assert results["list_dir"].ok
    assert results["write_file"].ok
    # TestModel reads "a"; it ran, and found (or not, as the calls raced) what write_file wrote.
    assert results["read_file"].ok or results["read_file"].error_type == "FileError"


# -- strict_schema on other schemas --------------------------------------------------------------


class Filter(pydantic.BaseModel):
    field: str
    op: Literal["eq", "lt"] = "eq"
    value: float | None = None


class Node(pydantic.BaseModel):
    name: str
    children: list[Node] = []


def search(
    query: str,
    limit: int = 10,
    filters: list[Filter] | None = None,
    labels: dict[str, int] | None = None,
    mode: Literal["fast", "deep"] = "fast",
    tree: Node | None = None,
) -> dict[str, Any]:
    """Search things.

    Args:
        query: What to look for.
    """
    return {
        "query": query,
        "limit": limit,
        "filters": filters and [f.model_dump() for f in filters],
        "labels": labels,
        "mode": mode,
        "tree": tree and tree.model_dump(),
    }


def test_a_pydantic_generated_schema_has_a_strict_variant_that_means_the_same() -> None:
    sdk, framework = agents_sdk(), pydantic_ai()
    tool = tool_from_function(search)
    params = to_openai(tool, strict=True)["function"]["parameters"]
    Draft.check_schema(params)
    assert sdk.ensure_strict_json_schema(copy.deepcopy(params)) == params
    transformer = framework.OpenAIJsonSchemaTransformer(copy.deepcopy(params), strict=None)
    assert transformer.walk() == params
    assert transformer.is_strict_compatible
    strict = {
        "query": "x",
        "limit": None,
        "filters": [{"field": "f", "op": None, "value": None}],
        "labels": [{"name": "a", "value": 2}],
        "mode": None,
        "tree": {"name": "r", "children": [{"name": "c", "children": None}]},
    }
    Draft(params).validate(strict)
    canonical = {
        "query": "x",
        "filters": [{"field": "f"}],
        "labels": {"a": 2},
        "tree": {"name": "r", "children": [{"name": "c"}]},
    }
    assert anyio.run(tool.invoke, strict) == anyio.run(tool.invoke, canonical)


def test_nullable_forms_of_enum_const_ref_and_union() -> None:
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "blue"]},
            "fixed": {"const": "x", "description": "always x"},
            "either": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        },
    }
    strict = strict_schema(schema)
    assert strict["properties"] == {
        "color": {"enum": ["red", "blue", None]},
        "fixed": {"anyOf": [{"const": "x"}, {"type": "null"}], "description": "always x"},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    }
    assert agents_sdk().ensure_strict_json_schema(copy.deepcopy(strict)) == strict
    tool = Tool("t", parameters=schema)
    assert tool.prepare({"color": None, "fixed": None, "either": None}) == {}


def test_a_tool_without_parameters_takes_an_empty_closed_object() -> None:
    assert strict_schema({"type": "object"}) == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "properties": {"x": {}}}, "without a type"),
        ({"type": "object", "properties": {"x": True}}, "boolean schema"),
        ({"type": "object", "properties": {"x": {"type": "object"}}}, "free keys"),
        ({"type": "object", "properties": {"x": {"type": "array"}}}, "without items"),
        (
            {"type": "object", "properties": {"x": {"type": "array", "prefixItems": [{}]}}},
            "tuple",
        ),
        (
            {"type": "object", "properties": {"x": {"allOf": [{"type": "string"}, {}]}}},
            "allOf",
        ),
        ({"type": ["object", "null"], "properties": {}}, "plain object"),
    ],
)
def test_schemas_without_a_strict_form_say_where(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        strict_schema(schema)


def test_nesting_deeper_than_openai_allows_has_no_strict_form() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    inner = schema
    for _ in range(10):
        child: dict[str, Any] = {"type": "object", "properties": {}}
        inner["properties"]["x"] = child
        inner = child
    with pytest.raises(SchemaError, match="nested deeper than 10"):
        strict_schema(schema)


def test_registry_exports_strict_where_it_can_and_canonical_elsewhere() -> None:
    free = Tool("free", parameters={"type": "object", "properties": {"x": {}}})
    registry = ToolRegistry([BUILTINS["list_dir"], free])
    exported = {
        entry["function"]["name"]: entry["function"] for entry in registry.to_openai(strict=True)
    }
    assert exported["list_dir"]["strict"] is True
    assert "strict" not in exported["free"]
    assert exported["free"]["parameters"] == free.parameters
    with pytest.raises(SchemaError, match="without a type"):
        to_openai(free, strict=True)
