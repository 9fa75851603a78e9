"""Tools from typed Python functions: schemas from hints, text from docstrings, invoke sync and async."""

from __future__ import annotations

import functools
import threading
from typing import Annotated, Any, Literal

import anyio
import anyio.lowlevel
import pydantic
import pytest

from agent_backend.errors import SchemaError, ToolArgumentError
from agent_backend.tools import Tool, parse_docstring, tool_from_function


class Address(pydantic.BaseModel):
    street: str
    city: str
    zip_code: str | None = None


class Person(pydantic.BaseModel):
    name: str
    addresses: list[Address]


def create_person(
    person: Person,
    mode: Literal["fast", "safe"] = "safe",
    note: str | None = None,
    tags: list[str] | None = None,
    retries: int = 3,
) -> str:
    """Create a person record.

    Longer explanation that is not part of the tool description.

    Args:
        person: The person to create,
            with every address.
        mode (str): How to write it.
        note: A free-text note.

    Returns:
        The new record id.
    """
    assert isinstance(person, Person)
    assert all(isinstance(a, Address) for a in person.addresses)
    return f"{person.name}:{mode}:{note}:{tags}:{retries}"


def test_schema_from_hints() -> None:
    tool = tool_from_function(create_person)
    params = tool.parameters
    assert tool.name == "create_person"
    assert tool.description == "Create a person record."
    assert tool.source == f"python:{__name__}.create_person"
    assert params["type"] == "object"
    assert params["required"] == ["person"]
    assert params["additionalProperties"] is False
    assert "title" not in params
    props = params["properties"]
    assert list(props) == ["person", "mode", "note", "tags", "retries"]
    assert props["person"]["$ref"] == "#/$defs/Person"
    assert props["person"]["description"] == "The person to create, with every address."
    assert set(params["$defs"]) == {"Person", "Address"}
    assert props["mode"] == {
        "default": "safe",
        "description": "How to write it.",
        "enum": ["fast", "safe"],
        "type": "string",
    }
    assert props["note"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert props["tags"]["default"] is None
    assert props["retries"] == {"default": 3, "type": "integer"}


def test_nested_model_argument_validates_through_refs() -> None:
    tool = tool_from_function(create_person)
    good = {"person": {"name": "Ada", "addresses": [{"street": "1 Main", "city": "X"}]}}
    assert tool.prepare(good) == good
    with pytest.raises(ToolArgumentError) as info:
        tool.prepare({"person": {"name": "Ada", "addresses": [{"street": "1 Main"}]}})
    assert "city" in info.value.to_model_message()
    with pytest.raises(ToolArgumentError):
        tool.prepare({"person": good["person"], "mode": "reckless"})
    with pytest.raises(ToolArgumentError):
        tool.prepare({**good, "unexpected": 1})


def test_invoke_sync_validates_models_and_keeps_function_defaults() -> None:
    tool = tool_from_function(create_person)
    main_thread = threading.get_ident()
    seen: list[int] = []

    def spy(**kwargs: Any) -> Any:
        seen.append(threading.get_ident())
        return create_person(**kwargs)

    spying = Tool(
        name=tool.name,
        parameters=tool.parameters,
        function=spy,
        bind_arguments=tool.bind_arguments,
    )
    arguments = (
        '{"person": {"name": "Ada", "addresses": [{"street": "s", "city": "c"}]}, "note": "hi"}'
    )
    assert anyio.run(tool.invoke, arguments) == "Ada:safe:hi:None:3"
    assert anyio.run(spying.invoke, arguments) == "Ada:safe:hi:None:3"
    assert seen
    assert seen[0] != main_thread  # sync functions run in a worker thread


def test_invoke_async_function() -> None:
    async def lookup(key: str, limit: int = 2) -> list[str]:
        """Look a key up."""
        await anyio.lowlevel.checkpoint()
        return [key] * limit

    tool = tool_from_function(lookup)
    assert anyio.run(tool.invoke, {"key": "k"}) == ["k", "k"]
    assert anyio.run(tool.invoke, '{"key": "k", "limit": "3"}') == ["k", "k", "k"]


def test_invoke_refuses_bad_arguments_without_calling() -> None:
    called: list[int] = []

    def f(x: int) -> int:
        called.append(x)
        return x

    tool = tool_from_function(f)
    for bad in ("{not json", "", "{}", '{"x": "seven"}', '{"x": 1}{"x": 1}'):
        with pytest.raises(ToolArgumentError):
            anyio.run(tool.invoke, bad)
    assert called == []


def test_invoke_callable_instances_and_partials() -> None:
    class Counter:
        async def __call__(self, step: int) -> int:
            return step + 1

    async def add(a: int, b: int) -> int:
        return a + b

    assert anyio.run(tool_from_function(Counter(), name="counter").invoke, {"step": 1}) == 2
    partial_tool = tool_from_function(functools.partial(add, b=10), name="add_ten")
    assert anyio.run(partial_tool.invoke, {"a": 1}) == 11


def test_tool_without_function_cannot_be_invoked() -> None:
    tool = Tool(name="remote_only")
    with pytest.raises(TypeError, match="no Python function"):
        anyio.run(tool.invoke, {})


def test_parameters_named_like_basemodel_attributes() -> None:
    def f(json: str, schema: int, model_config: bool = False) -> str:
        return f"{json}{schema}{model_config}"

    tool = tool_from_function(f)
    assert set(tool.parameters["properties"]) == {"json", "schema", "model_config"}
    assert anyio.run(tool.invoke, {"json": "a", "schema": 1}) == "a1False"


def test_annotated_field_descriptions_and_constraints() -> None:
    def f(n: Annotated[int, pydantic.Field(ge=1, description="How many.")]) -> int:
        return n

    tool = tool_from_function(f)
    assert tool.parameters["properties"]["n"] == {
        "description": "How many.",
        "minimum": 1,
        "type": "integer",
    }
    with pytest.raises(ToolArgumentError):
        tool.prepare({"n": 0})


def test_unserializable_default_is_left_out_not_a_warning() -> None:
    sentinel = object()

    def f(x: Any = sentinel) -> bool:
        return x is sentinel

    tool = tool_from_function(f)
    assert "default" not in tool.parameters["properties"]["x"]
    assert anyio.run(tool.invoke, {}) is True


def _star_args(*items: int) -> None: ...


def _star_kwargs(**options: int) -> None: ...


def _positional_only(x: int, /) -> None: ...


def _unannotated(x, y: int) -> None:  # type: ignore[no-untyped-def]
    ...


class Opaque:
    """Not a type pydantic can describe."""


def _undescribable(thing: Opaque) -> None: ...


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_star_args, r"\*items"),
        (_star_kwargs, r"\*\*options"),
        (_positional_only, "positional-only"),
        (_unannotated, "'x' has no type annotation"),
        (_undescribable, "cannot describe"),
        (lambda x: x, "no type annotation"),
    ],
)
def test_signatures_that_cannot_be_described(fn: Any, message: str) -> None:
    with pytest.raises(SchemaError, match=message) as info:
        tool_from_function(fn)
    assert info.value.source is not None
    assert info.value.source.startswith("python:")


def test_lambda_needs_a_name() -> None:
    with pytest.raises(SchemaError, match="invalid tool name"):
        tool_from_function(lambda: None)
    assert tool_from_function(lambda: None, name="noop").name == "noop"


def test_name_and_description_overrides() -> None:
    def f() -> None:
        """Doc."""

    tool = tool_from_function(f, name="other.name", description="Custom.")
    assert (tool.name, tool.description) == ("other.name", "Custom.")
    assert tool.parameters == {"additionalProperties": False, "properties": {}, "type": "object"}


# -- docstrings -----------------------------------------------------------------------------------


def test_google_docstring() -> None:
    summary, params = parse_docstring(
        """Fetch rows
        from the table.

        Args:
            table (str): Table name.
            limit: Max rows;
                at most 100.
            *columns: Ignored.

        Raises:
            KeyError: not a parameter.
        """.replace("\n        ", "\n")
    )
    assert summary == "Fetch rows from the table."
    assert params == {
        "table": "Table name.",
        "limit": "Max rows; at most 100.",
        "columns": "Ignored.",
    }


def test_sphinx_docstring() -> None:
    summary, params = parse_docstring(
        "Fetch rows.\n\n:param table: Table name.\n:param int limit: Max rows,\n    at most 100.\n"
        ":type limit: int\n:returns: rows\n"
    )
    assert summary == "Fetch rows."
    assert params == {"table": "Table name.", "limit": "Max rows, at most 100."}


def test_numpy_docstring() -> None:
    summary, params = parse_docstring(
        "Fetch rows.\n\nParameters\n----------\ntable : str\n    Table name.\nlimit : int, optional\n"
        "    Max rows,\n    at most 100.\n\nReturns\n-------\nlist\n    rows\n"
    )
    assert summary == "Fetch rows."
    assert params == {"table": "Table name.", "limit": "Max rows, at most 100."}


def test_docstring_starting_with_a_section_has_no_summary() -> None:
    assert parse_docstring("Args:\n    x: The x.") == ("", {"x": "The x."})
    assert parse_docstring(":param x: The x.") == ("", {"x": "The x."})
    assert parse_docstring(None) == ("", {})


def test_sphinx_descriptions_reach_the_schema() -> None:
    def f(a: int, b: str = "") -> None:
        """Do it.

        :param a: The a.
        :param b: The b.
        """

    props = tool_from_function(f).parameters["properties"]
    assert props["a"]["description"] == "The a."
    assert props["b"]["description"] == "The b."


def test_values_of_their_parameters_exact_type_pass_as_they_are_others_through_the_model() -> None:
    def scalars(
        count: int, ratio: float, name: str | None = None, flag: bool = False, extra: Any = None
    ) -> None: ...

    tool = tool_from_function(scalars)
    assert tool.bind_arguments is not None
    exact = {"count": 3, "ratio": 0.5, "name": None, "flag": True, "extra": [1, {"a": 2}]}
    assert tool.bind_arguments(exact) is exact  # what the model would return, unchanged
    # An integer for a float, a float for an integer (JSON Schema's integer admits 2.0):
    # the model converts, exactly as before.
    converted = tool.bind_arguments(tool.prepare({"count": 2.0, "ratio": 1}))
    assert converted == {"count": 2, "ratio": 1.0}
    assert type(converted["count"]) is int
    assert type(converted["ratio"]) is float


class Point(pydantic.BaseModel):
    x: int


def test_any_other_annotation_is_always_validated_into_the_model() -> None:
    def shout(text: Annotated[str, pydantic.AfterValidator(str.upper)]) -> None: ...
    def place(point: Point, tags: list[str]) -> None: ...

    shout_tool = tool_from_function(shout)
    assert shout_tool.bind_arguments is not None
    assert shout_tool.bind_arguments({"text": "hi"}) == {"text": "HI"}  # its validator ran
    place_tool = tool_from_function(place)
    assert place_tool.bind_arguments is not None
    bound = place_tool.bind_arguments({"point": {"x": 1}, "tags": ["a"]})
    assert bound == {"point": Point(x=1), "tags": ["a"]}


@pytest.mark.anyio
async def test_an_async_tool_is_known_as_such_once_and_awaited_on_the_loop() -> None:
    async def hop(n: int) -> str:
        return threading.current_thread().name

    def block(n: int) -> str:
        return threading.current_thread().name

    async_tool, sync_tool = tool_from_function(hop), tool_from_function(block)
    assert async_tool.is_async
    assert not sync_tool.is_async
    assert await async_tool.invoke({"n": 1}) == threading.current_thread().name
    assert await sync_tool.invoke({"n": 1}) != threading.current_thread().name
