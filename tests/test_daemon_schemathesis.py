"""Schemathesis against the live daemon's /openapi.json: no 5xx on generated input, answers match it.

Examples are bounded (per operation, positive and negative), so the run is short.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance
from support.daemon_fixtures import Daemon, daemon_fixture  # noqa: F401

MAX_EXAMPLES = 20


def _operations(daemon: Daemon) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{daemon.url}/openapi.json", headers=daemon.headers())
    return [result.ok() for result in schema.get_all_operations()]


def _check(daemon: Daemon, operation: Any, mode: GenerationMode, seen: dict[str, set[int]]) -> None:
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if case.path_parameters:
            # Not a real session: exercise the 404 path rather than closing one.
            case.path_parameters = {"session_id": "s-generated"}
        response = case.call(base_url=daemon.url, headers=daemon.headers(), timeout=30)
        seen.setdefault(operation.label, set()).add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, response.text[:500])
        if response.status_code >= 400:  # every refusal is a JSON error body
            assert response.json()["error"]["type"]
        # Not negative_data_rejection: unknown query parameters are ignored, as HTTP is wont.
        case.validate_response(
            response,
            checks=[status_code_conformance, response_schema_conformance],
            headers=daemon.headers(),
        )

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_on_generated_input(daemon: Daemon, mode: GenerationMode) -> None:
    operations = _operations(daemon)
    assert len(operations) >= 8
    seen: dict[str, set[int]] = {}
    for operation in operations:
        try:
            _check(daemon, operation, mode, seen)
        except Unsatisfiable:
            # No input of this operation can be made invalid (no parameters, no body).
            assert mode is GenerationMode.NEGATIVE, operation.label
    assert {"POST /v1/call", "POST /v1/batch", "GET /v1/tools"} <= set(seen), seen
