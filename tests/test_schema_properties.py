"""Property tests of prepare_arguments: keep valid input, fail only with ToolArgumentError, idempotent."""

from __future__ import annotations

import json
import random
from typing import Any

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.realworld import corrupt, strict_equal
from support.schema_strategies import instances

from agent_backend.errors import ToolArgumentError
from agent_backend.schema import compile_schema


class Address(pydantic.BaseModel):
    street: str
    zip_code: int | None = None


class Order(pydantic.BaseModel):
    order_id: int
    amount: float
    paid: bool
    tags: list[str] = []
    address: Address
    alt: list[Address] = []
    note: str | None = None


TYPED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
        "z": {"type": "null"},
        "o": {"type": "object", "properties": {"k": {"type": "integer"}, "f": {"type": "boolean"}}},
        "a": {"type": "array", "items": {"type": "integer"}},
        "m": {"type": "object", "additionalProperties": {"type": "number"}},
        "s": {"type": "string"},
    },
    "additionalProperties": False,
}

UNIONS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "u": {"type": ["string", "integer"]},
        "nn": {"type": ["integer", "null"]},
        "any": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "string"}]},
        "e": {"enum": [1, "1", True, None]},
        "one": {"oneOf": [{"type": "integer"}, {"type": "array", "items": {"type": "string"}}]},
    },
}

SCHEMAS = {"typed": TYPED, "unions": UNIONS, "pydantic": Order.model_json_schema()}
COMPILED = {name: compile_schema(schema) for name, schema in SCHEMAS.items()}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["1", "1.5", "true", "null", "[1]", '{"k": "2"}', "007", "nan", "1e999"])
    # Lone surrogates (not Unicode text), raw and JSON-escaped, and a literal too big for a double.
    | st.sampled_from(["\ud800", "a\udfffb", '{"k": "\\ud800"}', '["\\udc00"]', "[1e400]"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["n", "x", "b", "z", "o", "a", "m", "s", "u", "k", "e", "one", "\udc00"]
            )
            | st.text(max_size=5),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)

common = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@common
@given(data=st.data())
def test_valid_input_comes_back_unchanged(name: str, data: st.DataObject) -> None:
    compiled = COMPILED[name]
    instance = data.draw(instances(compiled.resolved).filter(compiled.is_valid))
    assert strict_equal(compiled.prepare(instance), instance)
    assert strict_equal(compiled.prepare(json.dumps(instance)), instance)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@common
@given(value=json_values)
def test_arbitrary_json_gives_valid_output_or_tool_argument_error(name: str, value: Any) -> None:
    compiled = COMPILED[name]
    for arguments in (value, json.dumps(value)):
        try:
            out = compiled.prepare(arguments)
        except ToolArgumentError as exc:
            message = exc.to_model_message()
        else:
            message = ""
        assert len(message) <= 2048
        if message:
            continue
        assert isinstance(out, dict)
        assert compiled.is_valid(out)
        assert strict_equal(compiled.prepare(out), out)  # idempotent


@common
@given(text=st.text(max_size=200) | st.binary(max_size=200))
def test_arbitrary_text_gives_valid_output_or_tool_argument_error(text: str | bytes) -> None:
    compiled = COMPILED["typed"]
    try:
        out = compiled.prepare(text)
    except ToolArgumentError:
        return
    assert compiled.is_valid(out)


@pytest.mark.parametrize("name", ["typed", "pydantic"])
@common
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_corrupted_typed_arguments_are_recovered_exactly(
    name: str, data: st.DataObject, seed: int
) -> None:
    compiled = COMPILED[name]
    instance = data.draw(instances(compiled.resolved).filter(compiled.is_valid))
    resolved = compiled.resolved
    assert isinstance(resolved, dict)
    properties = resolved.get("properties", {})
    rng = random.Random(seed)
    broken = {k: corrupt(v, properties.get(k), rng) for k, v in instance.items()}
    assert strict_equal(compiled.prepare(broken), instance)
