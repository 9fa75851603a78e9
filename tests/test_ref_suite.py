"""The official JSON-Schema-Test-Suite: resolving local refs never changes a verdict."""

from __future__ import annotations

import pytest
from support import jsts_suite


@pytest.fixture(scope="module")
def report() -> jsts_suite.Report:
    reason = jsts_suite.missing_suite_reason()
    if reason is not None:
        if jsts_suite.must_fail_when_missing():
            pytest.fail(f"{reason}; CI=true requires it")
        pytest.skip(reason)
    return jsts_suite.run_equivalence()


def test_suite_has_substantial_local_coverage(report: jsts_suite.Report) -> None:
    print(report.summary())
    assert report.local_cases >= 200
    assert report.instances >= 600
    ref_cases = [case for case in jsts_suite.load_cases() if case.file == "ref.json"]
    assert len(ref_cases) >= 60
    # Only the cases pointing at a meta-schema (a document we must not fetch) are non-local.
    assert all("remote" in name or "metaschema" in name for name in report.non_local)


def test_resolved_schemas_keep_every_verdict(report: jsts_suite.Report) -> None:
    assert report.mismatches == []
    assert report.same_verdicts == report.instances


def test_resolved_schemas_match_the_suite(report: jsts_suite.Report) -> None:
    assert report.expected_verdicts == report.instances
