"""Tool: validated name, immutable, compiled exactly once, picklable by its definition;
and the one way its Python function runs (tools.invoke), sync or async, when cancelled."""

from __future__ import annotations

import dataclasses
import functools
import pickle
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agent_backend.errors import SchemaError, ToolArgumentError
from agent_backend.schema import CompiledSchema, compile_schema
from agent_backend.tools import Tool, call_function, is_async_callable, run_prepared

PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["n"],
}


def test_schema_is_compiled_once_not_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[CompiledSchema] = []
    real = compile_schema

    def counting(schema: Any, **kwargs: Any) -> CompiledSchema:
        compiled.append(real(schema, **kwargs))
        return compiled[-1]

    monkeypatch.setattr("agent_backend.tools.tool.compile_schema", counting)
    tool = Tool(name="count", parameters=PARAMS)
    for i in range(200):
        assert tool.prepare(f'{{"n": "{i}"}}') == {"n": i}
    assert len(compiled) == 1
    assert tool.compiled is compiled[0]


def test_tool_is_immutable_and_owns_its_data() -> None:
    params: dict[str, Any] = {"type": "object", "properties": {"n": {"type": "integer"}}}
    meta: dict[str, Any] = {"x-agent-backend": {"timeout": 5}}
    tool = Tool(name="t", parameters=params, meta=meta)
    params["properties"]["n"]["type"] = "string"
    meta["x-agent-backend"]["timeout"] = 99
    assert tool.parameters["properties"]["n"]["type"] == "integer"
    assert tool.meta["x-agent-backend"] == {"timeout": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        tool.name = "u"  # type: ignore[misc]
    with pytest.raises(TypeError):
        tool.meta["new"] = 1  # type: ignore[index]
    assert tool.prepare({"n": 1}) == {"n": 1}


@pytest.mark.parametrize("name", ["get_weather", "math.factorial", "a-b", "A" * 64, "x"])
def test_valid_names(name: str) -> None:
    assert Tool(name=name).name == name


@pytest.mark.parametrize("name", ["", "a b", "a/b", "é", "A" * 65, "call()", None, 3])
def test_invalid_names(name: Any) -> None:
    with pytest.raises(SchemaError) as info:
        Tool(name=name)
    assert info.value.pointer == "/name"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"type": "string"}, "describe an object"),
        ([], "must be an object"),
        (
            {"type": "object", "properties": {"n": {"type": "integer", "minimum": "0"}}},
            "valid JSON Schema",
        ),
    ],
)
def test_bad_parameters(parameters: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Tool(name="t", parameters=parameters)


def test_default_parameters_accept_an_empty_object_only() -> None:
    tool = Tool(name="noop")
    assert tool.prepare("{}") == {}
    with pytest.raises(ToolArgumentError):
        tool.prepare("")
    with pytest.raises(ToolArgumentError):
        tool.prepare("[]")


def test_prepare_names_the_tool_in_errors() -> None:
    tool = Tool(name="count", parameters=PARAMS)
    with pytest.raises(ToolArgumentError) as info:
        tool.prepare('{"n": "many"}')
    assert info.value.tool == "count"
    assert "/n" in info.value.to_model_message()


def test_pickle_round_trip_recompiles() -> None:
    tool = Tool(
        name="math.count",
        description="Count.",
        parameters=PARAMS,
        meta={"x-agent-backend": {"backend": "ssh"}},
        source="tools/count.json",
        normalizations=("/type",),
    )
    again = pickle.loads(pickle.dumps(tool))
    assert (
        again.name,
        again.description,
        again.parameters,
        again.source,
        again.normalizations,
    ) == (
        tool.name,
        tool.description,
        tool.parameters,
        tool.source,
        tool.normalizations,
    )
    assert dict(again.meta) == dict(tool.meta)
    assert again.prepare({"n": "2"}) == {"n": 2}
    assert again.compiled is not tool.compiled


# -- running the function: tools.invoke ---------------------------------------------------------


async def _add(a: int, b: int = 0) -> int:
    return a + b


class _AsyncCounter:
    async def __call__(self, step: int) -> int:
        return step + 1


def test_is_async_callable_sees_through_partials_and_instances() -> None:
    assert is_async_callable(_add)
    assert is_async_callable(functools.partial(functools.partial(_add, b=1), 2))
    assert is_async_callable(_AsyncCounter())
    assert not is_async_callable(len)
    assert not is_async_callable(lambda: _add(1))  # a sync wrapper: its result is awaited


@pytest.mark.anyio
async def test_call_function_awaits_async_runs_sync_in_a_thread() -> None:
    loop_thread = threading.get_ident()
    assert await call_function(_add, (1,), {"b": 2}) == 3
    assert await call_function(_AsyncCounter(), kwargs={"step": 1}) == 2
    assert await call_function(lambda: _add(4)) == 4  # a sync function handing back a coroutine
    assert await call_function(threading.get_ident) != loop_thread


@pytest.mark.anyio
async def test_run_prepared_binds_arguments_and_needs_a_function() -> None:
    tool = Tool(
        "add",
        parameters={"type": "object", "properties": {"a": {"type": "integer"}}},
        function=_add,
        bind_arguments=lambda prepared: {**prepared, "b": 10},
    )
    assert await run_prepared(tool, tool.prepare('{"a": "1"}')) == 11
    with pytest.raises(TypeError, match="no Python function"):
        await run_prepared(Tool("remote_only"), {})


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("abandon", [True, False])
async def test_a_cancelled_sync_function_is_abandoned_unless_the_caller_waits(
    abandon: bool,
) -> None:
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []

    def block() -> str:
        started.set()
        release.wait(20)
        return "done"

    async def run(scope: anyio.CancelScope) -> None:
        with scope:
            await call_function(block, abandon_on_cancel=abandon)
        ended.append("call")

    scope = anyio.CancelScope()
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(run, scope)
            assert await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
            for _ in range(50):  # a bounded number of loop turns, not a sleep
                if ended:
                    break
                await anyio.lowlevel.checkpoint()
            # Abandoned: the call ended while its thread still runs; else it waits for it.
            assert ended == (["call"] if abandon else [])
            release.set()
        assert ended == ["call"]
    finally:
        release.set()
