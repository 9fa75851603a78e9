"""Which compiled validator to put on the hot path: measured, not guessed (docs/validator.md).

    .venv/bin/python bench/validator_bench.py [--cases N]

For each candidate, on BFCL schemas with well-typed ground-truth arguments and
on a pydantic schema with $defs: compile time, ``is_valid`` time (best of
interleaved repeats), and conformance on the official JSON Schema test suite
(draft 2020-12 and draft 7 files in shared/realworld). Candidates:
jsonschema (the reference implementation, compiled once), jsonschema-rs, and
fastjsonschema (generates Python code; optional: skipped if not installed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import jsonschema  # noqa: E402
import jsonschema_rs  # noqa: E402
from support.jsts_suite import SUITE_DIR  # noqa: E402
from support.realworld import bfcl_cases, realworld_missing_reason  # noqa: E402

Compile = Callable[[dict[str, Any]], Callable[[Any], bool]]


def _jsonschema(schema: dict[str, Any]) -> Callable[[Any], bool]:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema).is_valid  # type: ignore[no-any-return]


def _jsonschema_rs(schema: dict[str, Any]) -> Callable[[Any], bool]:
    return jsonschema_rs.validator_for(schema).is_valid  # type: ignore[no-any-return]


def _fastjsonschema(schema: dict[str, Any]) -> Callable[[Any], bool]:
    import fastjsonschema

    check = fastjsonschema.compile(schema)

    def is_valid(instance: Any) -> bool:
        try:
            check(instance)
        except fastjsonschema.JsonSchemaException:
            return False
        return True

    return is_valid


CANDIDATES: dict[str, Compile] = {"jsonschema": _jsonschema, "jsonschema-rs": _jsonschema_rs}
try:
    import fastjsonschema  # noqa: F401

    CANDIDATES["fastjsonschema"] = _fastjsonschema
except ImportError:
    pass


def conformance(compile_: Compile) -> tuple[int, int, int]:
    """(instances, right verdicts, schemas that failed to compile) over the local suite files."""
    right = total = broken = 0
    for draft in ("draft2020-12", "draft7"):
        for path in sorted((SUITE_DIR / draft).glob("*.json")):
            if path.name.startswith("refRemote"):
                continue
            for case in json.loads(path.read_text()):
                schema = case["schema"]
                if draft == "draft7" and isinstance(schema, dict):
                    schema = {"$schema": "http://json-schema.org/draft-07/schema#", **schema}
                try:
                    is_valid = compile_(schema) if isinstance(schema, dict) else None
                except Exception:
                    broken += 1
                    total += len(case["tests"])
                    continue
                for test in case["tests"]:
                    total += 1
                    try:
                        verdict = is_valid(test["data"]) if is_valid else None
                    except Exception:
                        verdict = None
                    if verdict is None and not isinstance(schema, dict):
                        right += 1  # boolean schemas: not compared
                    elif verdict == test["valid"]:
                        right += 1
    return total, right, broken


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=60)
    options = parser.parse_args()
    missing = realworld_missing_reason()
    if missing:
        print(f"needs the shared real-world data: {missing}")
        return 1
    pairs = []
    for case in bfcl_cases():
        try:
            if _jsonschema_rs(case.schema)(case.arguments) and case.arguments:
                pairs.append((case.schema, case.arguments))
        except Exception:
            continue
    pairs = pairs[:: max(1, len(pairs) // options.cases)][: options.cases]
    print(f"{len(pairs)} BFCL schema/argument pairs; candidates: {', '.join(CANDIDATES)}")
    compile_times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    check_times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for schema, args in pairs:
        validators = {}
        for name, compile_ in CANDIDATES.items():
            started = time.perf_counter()
            validators[name] = compile_(schema)
            compile_times[name].append(time.perf_counter() - started)
            assert validators[name](args), name
        best = dict.fromkeys(CANDIDATES, float("inf"))
        for _ in range(5):
            for name, is_valid in validators.items():
                best[name] = min(
                    best[name], timeit.timeit(lambda v=is_valid, a=args: v(a), number=500) / 500
                )
        for name, seconds in best.items():
            check_times[name].append(seconds)
    base = statistics.median(check_times["jsonschema"])
    print(
        f"\n{'validator':16} {'compile (median)':>18} {'is_valid (median)':>18} {'vs jsonschema':>14} {'suite verdicts':>22}"
    )
    for name, compile_ in CANDIDATES.items():
        total, right, broken = conformance(compile_)
        check = statistics.median(check_times[name])
        print(
            f"{name:16} {statistics.median(compile_times[name]) * 1e3:15.2f} ms {check * 1e6:15.2f} us"
            f" {base / check:13.1f}x {right:>8}/{total} ({broken} uncompilable)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
