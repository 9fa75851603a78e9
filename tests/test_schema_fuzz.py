"""Any schema and any arguments: loading raises only SchemaError, preparing only
ToolArgumentError, and what is returned validates (issue 16, item 2).

Generated schemas are random keyword trees (bad keyword values, refs that resolve, cycle,
dangle or leave the document, invalid and ECMA-only patterns), very deep ones (up to 2,000
levels of each nesting keyword, and $ref chains) and very wide ones; arguments are JSON
values of any kind, deep ones, their JSON text, broken text and non-JSON Python values.
``bench/schema_fuzz.py`` runs the same cases 100,000 at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.schema_strategies import (
    fuzz_arguments,
    fuzz_problems,
    fuzz_schemas,
    make_arguments,
    make_schema,
)

pytestmark = pytest.mark.timeout(300)


@settings(
    max_examples=900,  # 30-40 s of CPU
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    schema=fuzz_schemas(),
    arguments=st.lists(fuzz_arguments(), min_size=1, max_size=4),
    inject_defaults=st.booleans(),
)
def test_any_schema_and_arguments_fail_only_as_documented(
    schema: tuple[Any, ...], arguments: list[tuple[Any, ...]], inject_defaults: bool
) -> None:
    _, problems = fuzz_problems(
        make_schema(schema), [make_arguments(a) for a in arguments], inject_defaults=inject_defaults
    )
    assert problems == []


def test_a_top_level_that_wants_no_object_refuses_rather_than_wrapping_the_arguments() -> None:
    """Found by the fuzz: repair wrapped the object in an array, which the schema accepted,
    and an assertion fired; tool arguments are an object, so this is a ToolArgumentError."""
    from agent_backend.errors import ToolArgumentError
    from agent_backend.schema import compile_schema

    compiled = compile_schema(
        {"type": "array", "$schema": "http://json-schema.org/draft-07/schema#"}
    )
    for arguments in ({"p0": {}}, '{"p0": {}}'):
        with pytest.raises(ToolArgumentError, match="could only be made valid as array") as caught:
            compiled.prepare(arguments)
        assert caught.value.issues[0].expected == "object"
