"""Real-world check: BFCL ground-truth calls, corrupted the way models do, come back exact."""

from __future__ import annotations

import pytest
from support.realworld import bfcl_round_trip, realworld_missing_reason

missing = realworld_missing_reason()


@pytest.mark.skipif(missing is not None, reason=missing or "")
@pytest.mark.timeout(300)
def test_every_well_typed_bfcl_call_is_recovered_exactly() -> None:
    report = bfcl_round_trip(variants=3, seed=0)
    assert report.cases > 3000
    assert report.well_typed > 2500
    assert report.corrupted > 5000
    assert report.failures == []
    assert report.recovered == report.corrupted
