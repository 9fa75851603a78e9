"""The official JSON-Schema-Test-Suite as an oracle for ``agent_backend.schema.refs``.

For every case of the chosen files, the schema is resolved; a case whose
schema keeps an external ref (or uses ``$dynamicRef``) is "non-local" and only
counted. For every instance of the other ("local") cases, the verdict of the
original schema is compared with the verdict of the resolved one, by two
independent validators: ``jsonschema`` (the reference implementation) and
``jsonschema_rs`` (the one on our hot path). The resolved verdict must also
equal the suite's expected ``valid``.

Nothing here touches the network: ``jsonschema`` gets a registry whose
retrieve function raises, and ``jsonschema_rs`` runs with ``offline=True``.
The lead's benchmark script prints ``run_equivalence()``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema_rs
import referencing
import referencing.jsonschema

from agent_backend.errors import SchemaRefError
from agent_backend.schema.refs import resolve_schema

SUITE_DIR = (
    Path(__file__).resolve().parents[2].parent / "shared" / "realworld" / "json-schema-test-suite"
)

FILES = (
    "ref.json",
    "defs.json",
    "allOf.json",
    "anyOf.json",
    "oneOf.json",
    "additionalProperties.json",
    "items.json",
    "properties.json",
    "const.json",
    "enum.json",
    "type.json",
    "required.json",
    "default.json",
)

# The suite's draft 7 schemas name no ``$schema``; detect_dialect would read them as
# 2020-12 (the default for tool schemas), so the loader names the draft explicitly.
_META_SCHEMA = {
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
    "draft7": "http://json-schema.org/draft-07/schema#",
}

_VALIDATORS: dict[str, tuple[Any, Any]] = {
    "draft2020-12": (jsonschema.Draft202012Validator, jsonschema_rs.Draft202012Validator),
    "draft7": (jsonschema.Draft7Validator, jsonschema_rs.Draft7Validator),
}

Verdict = bool | str  # True/False, or "error: ..." when the validator refuses the schema


@dataclass(frozen=True)
class SuiteCase:
    draft: str
    file: str
    description: str
    schema: Any
    tests: tuple[dict[str, Any], ...]

    @property
    def name(self) -> str:
        return f"{self.draft}/{self.file}: {self.description}"


@dataclass(frozen=True)
class Mismatch:
    case: str
    test: str
    expected: bool
    original: tuple[Verdict, Verdict]  # (jsonschema, jsonschema_rs)
    resolved: tuple[Verdict, Verdict]


@dataclass
class Report:
    total_cases: int = 0
    local_cases: int = 0
    instances: int = 0
    same_verdicts: int = 0  # both validators give the resolved schema the original's verdict
    expected_verdicts: int = 0  # the resolved schema gets the suite's expected verdict
    mismatches: list[Mismatch] = field(default_factory=list)
    non_local: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.total_cases} cases, {self.local_cases} local, {self.instances} instances, "
            f"{self.same_verdicts} same verdicts, {self.expected_verdicts} as expected, "
            f"{len(self.mismatches)} mismatches, {len(self.non_local)} non-local"
        )


def missing_suite_reason(root: Path = SUITE_DIR) -> str | None:
    """Why the suite cannot be used, or None when it is there."""
    if not all((root / draft).is_dir() for draft in _VALIDATORS):
        return f"JSON-Schema-Test-Suite not found at {root} (expected {', '.join(_VALIDATORS)})"
    return None


def must_fail_when_missing() -> bool:
    """On CI a missing suite is a failure, not a skip."""
    return os.environ.get("CI", "").lower() == "true"


def load_cases(root: Path = SUITE_DIR) -> Iterator[SuiteCase]:
    for draft in _VALIDATORS:
        for file in FILES:
            path = root / draft / file
            if not path.is_file():
                continue
            for case in json.loads(path.read_text(encoding="utf-8")):
                schema = case["schema"]
                if isinstance(schema, dict):
                    schema = {"$schema": _META_SCHEMA[draft], **schema}
                yield SuiteCase(draft, file, case["description"], schema, tuple(case["tests"]))


def _refuse(uri: str) -> referencing.Resource[Any]:
    raise referencing.exceptions.NoSuchResource(ref=uri)


_NO_NETWORK: referencing.Registry[Any] = referencing.Registry(retrieve=_refuse)


def _checker(draft: str, schema: Any) -> tuple[Callable[[Any], Verdict], Callable[[Any], Verdict]]:
    """(jsonschema, jsonschema_rs) verdict functions for ``schema`` read as ``draft``."""
    reference_cls, rs_cls = _VALIDATORS[draft]
    reference = reference_cls(schema, registry=_NO_NETWORK)

    def by_reference(instance: Any) -> Verdict:
        try:
            return bool(reference.is_valid(instance))
        except Exception as exc:  # an unresolvable ref surfaces only when reached
            return f"error: {type(exc).__name__}"

    try:
        compiled = rs_cls(schema, offline=True)
    except Exception as exc:
        error = f"error: {type(exc).__name__}"
        return by_reference, lambda _instance: error
    return by_reference, lambda instance: bool(compiled.is_valid(instance))


def _is_non_local(case: SuiteCase) -> bool:
    try:
        return bool(resolve_schema(case.schema).external_refs)
    except SchemaRefError as exc:
        if "is not supported" in exc.message:  # $dynamicRef / $recursiveRef
            return True
        raise


def run_equivalence(root: Path = SUITE_DIR) -> Report:
    report = Report()
    for case in load_cases(root):
        report.total_cases += 1
        if _is_non_local(case):
            report.non_local.append(case.name)
            continue
        report.local_cases += 1
        resolved = resolve_schema(case.schema).schema
        original_checks = _checker(case.draft, case.schema)
        resolved_checks = _checker(case.draft, resolved)
        for test in case.tests:
            report.instances += 1
            data = test["data"]
            before = (original_checks[0](data), original_checks[1](data))
            after = (resolved_checks[0](data), resolved_checks[1](data))
            report.same_verdicts += before == after
            report.expected_verdicts += after == (test["valid"], test["valid"])
            if before != after or after != (test["valid"], test["valid"]):
                report.mismatches.append(
                    Mismatch(case.name, test["description"], test["valid"], before, after)
                )
    return report


if __name__ == "__main__":
    result = run_equivalence()
    print(result.summary())
    for mismatch in result.mismatches:
        print(mismatch)
