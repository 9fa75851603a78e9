"""Fuzzing the tool-call layer: generated schemas and arguments, counted by how they fail.

    .venv/bin/python bench/schema_fuzz.py [--cases N] [--per-schema K] [--seed S]

Runs N (default 100,000) generated (schema, arguments) cases through
``compile_schema`` and ``CompiledSchema.prepare``, with the strategies of
``tests/support/schema_strategies.py`` (``tests/test_schema_fuzz.py`` runs a few hundred
of them under pytest): random keyword trees with bad keyword values and refs that
resolve, cycle, dangle or leave the document; schemas up to 2,000 levels deep of each
nesting keyword, and $ref chains; 1,000 properties wide; arguments of any kind, deep
ones (to 5,000 levels), their JSON text, broken text and non-JSON Python values.

Hypothesis draws N / K schemas and as many argument recipes; each schema is then
compiled once and prepared with K arguments picked from the drawn ones (seeded), so a
case is one schema with one argument. Loading may raise only ``SchemaError``,
preparing only ``ToolArgumentError``; a result must validate and the caller's arguments
must be left as they were. Anything else counts as a crash. Prints the counts and
PASS/FAIL against the target of none.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from support.schema_strategies import (  # noqa: E402
    fuzz_arguments,
    fuzz_problems,
    fuzz_schemas,
    make_arguments,
    make_schema,
)


def draw_recipes(count: int, first_seed: int) -> tuple[list[Any], list[Any]]:
    """``count`` schema recipes and ``count`` argument recipes, drawn by hypothesis."""
    schemas: list[Any] = []
    arguments: list[Any] = []

    def keep(schema: Any, argument: Any) -> None:
        schemas.append(schema)
        arguments.append(argument)

    batch = 0
    while len(schemas) < count:
        run = seed(first_seed + batch)(
            settings(
                max_examples=min(2_000, count - len(schemas)),
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )(given(schema=fuzz_schemas(), argument=fuzz_arguments())(keep))
        )
        run()
        batch += 1
    return schemas[:count], arguments[:count]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=100_000, help="(schema, arguments) cases")
    parser.add_argument("--per-schema", type=int, default=20, help="arguments per schema")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()

    started = time.perf_counter()
    count = -(-options.cases // options.per_schema)
    schemas, arguments = draw_recipes(count, options.seed)
    drawn = time.perf_counter() - started
    print(f"  drew {len(schemas):,} schema and argument recipes in {drawn:.0f}s", file=sys.stderr)

    rng = random.Random(options.seed)
    counts: collections.Counter[str] = collections.Counter()
    crashes: collections.Counter[str] = collections.Counter()
    examples: dict[str, str] = {}
    slowest: list[tuple[float, str]] = []
    for recipe in schemas:
        wanted = min(options.per_schema, options.cases - counts["cases"])
        picked = [rng.choice(arguments) for _ in range(wanted)]
        began = time.perf_counter()
        try:
            loaded, problems = fuzz_problems(
                make_schema(recipe),
                [make_arguments(r) for r in picked],
                inject_defaults=rng.random() < 0.25,
            )
        except Exception as exc:  # the harness itself: count it, never stop the run
            loaded, problems = False, [f"the fuzz harness raised {type(exc).__name__}: {exc}"]
        elapsed = time.perf_counter() - began
        counts["schemas loaded" if loaded else "schemas refused"] += 1
        counts["schemas"] += 1
        counts["cases"] += wanted
        counts["crashes"] += len(problems)
        for problem in problems:
            kind = problem[:80]
            crashes[kind] += 1
            examples.setdefault(kind, f"{problem}\n      schema recipe {str(recipe)[:300]}")
        slowest.append((elapsed, str(recipe)[:110]))
        slowest.sort(reverse=True)
        del slowest[3:]
        if counts["schemas"] % 100 == 0:
            print(
                f"\r  {counts['cases']:,} cases, {counts['crashes']} crashes,"
                f" {time.perf_counter() - started:.0f}s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    print(file=sys.stderr)
    seconds = time.perf_counter() - started
    print(
        f"== schema fuzz: {counts['cases']:,} cases ({counts['schemas']:,} schemas,"
        f" {options.per_schema} arguments each) in {seconds:.0f}s ({drawn:.0f}s drawing) =="
    )
    print(
        f"  schemas loaded {counts['schemas loaded']:,},"
        f" refused with SchemaError {counts['schemas refused']:,}"
    )
    for elapsed, text in slowest:
        print(f"  slowest schema {elapsed:.2f}s: {text}")
    for kind, number in crashes.most_common(10):
        print(f"  crash x{number}: {examples[kind]}")
    ok = counts["crashes"] == 0 and counts["cases"] >= options.cases
    print("\n== Figures ==")
    print(
        f"  [{'PASS' if ok else 'FAIL'}] {counts['cases']:,} cases ran,"
        f" {counts['crashes']} crashed with anything but SchemaError/ToolArgumentError,"
        " returned arguments the schema refuses or mutated them (target 0)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
