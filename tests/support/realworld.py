"""Real tool schemas and calls from BFCL (../shared/realworld/bfcl), and model-style corruption.

Shared by tests/test_bfcl_roundtrip.py and bench/schema_bench.py. The data is
read from shared/ and never copied into the repository.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REALWORLD = Path(__file__).resolve().parents[2].parent / "shared" / "realworld"
BFCL = REALWORLD / "bfcl"


def realworld_missing_reason() -> str | None:
    """Why the shared data cannot be used, or None. Under CI=true its absence is a failure."""
    if BFCL.is_dir():
        return None
    reason = f"shared real-world data not found at {BFCL}"
    if os.environ.get("CI") == "true":
        raise RuntimeError(reason + " (required under CI=true)")
    return reason


@dataclasses.dataclass(frozen=True)
class Case:
    """One ground-truth call: the tool's (legacy-normalized) schema and well-typed arguments."""

    case_id: str
    tool: str
    schema: dict[str, Any]
    arguments: dict[str, Any]


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def _ground_truth_arguments(options: dict[str, list[Any]]) -> dict[str, Any]:
    """The first acceptable value of each parameter; "" alone means the parameter is omitted."""
    arguments: dict[str, Any] = {}
    for name, values in options.items():
        chosen = [v for v in values if v != ""]
        if chosen:
            arguments[name] = chosen[0]
    return arguments


def bfcl_cases() -> Iterator[Case]:
    """Every ground-truth call in BFCL whose function schema is known, in file order."""
    from agent_backend.tools.legacy import normalize_legacy_types

    for answers_path in sorted(BFCL.glob("*.possible_answer.json")):
        functions_path = answers_path.with_name(answers_path.name.replace(".possible_answer", ""))
        functions = {row["id"]: row["function"] for row in _read_jsonl(functions_path)}
        for row in _read_jsonl(answers_path):
            by_name = {f["name"]: f for f in functions.get(row["id"], [])}
            for index, call in enumerate(row["ground_truth"]):
                for name, options in call.items():
                    if name not in by_name:
                        continue
                    schema, _ = normalize_legacy_types(by_name[name]["parameters"])
                    yield Case(
                        f"{row['id']}#{index}", name, schema, _ground_truth_arguments(options)
                    )


# -- corruption the way models do it -------------------------------------------------------


def _stringify(value: Any) -> Any:
    """A scalar as the string a model would send instead."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return value


def _types(schema: Any) -> set[str]:
    declared = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(declared, str):
        return {declared}
    return set(declared) if isinstance(declared, list) else set()


def _child_schema(schema: Any, key: str | int) -> Any:
    if not isinstance(schema, dict):
        return None
    if isinstance(key, str):
        properties = schema.get("properties") or {}
        if key in properties:
            return properties[key]
        additional = schema.get("additionalProperties")
        return additional if isinstance(additional, dict) else None
    items = schema.get("items")
    return items if isinstance(items, dict) else None


def corrupt(value: Any, schema: Any, rng: random.Random, rate: float = 0.7) -> Any:
    """Return a copy of ``value`` with model-style mistakes where the schema pins a type.

    Numbers, booleans and null sent as strings; objects and arrays sent as
    JSON-encoded strings; a one-element array of a scalar sent as the lone
    scalar. Only where the schema says which type it wants and a string is
    not one of them: elsewhere a string is a legitimate value, not a mistake.
    """
    types = _types(schema)
    mistakable = bool(types) and "string" not in types
    if isinstance(value, dict):
        inner = {k: corrupt(v, _child_schema(schema, k), rng, rate) for k, v in value.items()}
        return json.dumps(inner) if mistakable and rng.random() < rate / 3 else inner
    if isinstance(value, list):
        item_schema = _child_schema(schema, 0)
        if (
            mistakable
            and len(value) == 1
            and not isinstance(value[0], (dict, list))
            and "array" not in _types(item_schema)
            and rng.random() < rate / 2
        ):
            return corrupt(value[0], item_schema, rng, rate)
        inner_list = [corrupt(v, item_schema, rng, rate) for v in value]
        return json.dumps(inner_list) if mistakable and rng.random() < rate / 3 else inner_list
    return _stringify(value) if mistakable and rng.random() < rate else value


def strict_equal(a: Any, b: Any) -> bool:
    """Equal values of equal JSON types all the way down (1 != 1.0 != True)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclasses.dataclass
class RoundTrip:
    cases: int = 0
    well_typed: int = 0
    corrupted: int = 0
    recovered: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)


def bfcl_round_trip(*, variants: int = 3, seed: int = 0) -> RoundTrip:
    """Corrupt every well-typed BFCL ground-truth call and count exact recoveries.

    A corruption counts only when it makes the arguments invalid for the
    schema: a corrupted form that is still valid is what the model meant as
    far as the schema can tell, and is (correctly) kept.
    """
    from agent_backend.errors import AgentBackendError
    from agent_backend.schema import compile_schema

    report = RoundTrip()
    rng = random.Random(seed)
    for case in bfcl_cases():
        report.cases += 1
        try:
            compiled = compile_schema(case.schema, source=case.case_id)
        except AgentBackendError:
            continue
        if not compiled.is_valid(case.arguments):
            continue
        report.well_typed += 1
        # The top level stays an object: a non-object top level fails closed by design.
        properties = case.schema.get("properties") or {}
        forms = [
            {k: corrupt(v, properties.get(k), rng, rate) for k, v in case.arguments.items()}
            for rate in (1.0, *([0.7] * variants))
        ]
        for form in forms:
            if compiled.is_valid(form):
                continue
            report.corrupted += 1
            try:
                repaired = compiled.prepare(json.dumps(form))
            except AgentBackendError as exc:
                report.failures.append(f"{case.case_id}: {form!r} -> {exc}")
                continue
            if strict_equal(repaired, case.arguments):
                report.recovered += 1
            else:
                report.failures.append(f"{case.case_id}: {form!r} -> {repaired!r}")
    return report
