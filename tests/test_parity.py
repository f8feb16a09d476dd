"""Every supported family, loaded by hfjax, matches the same checkpoint run by PyTorch (eager and jit)."""

from __future__ import annotations

import pytest

from hfjax import _check, testing


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_family_matches_pytorch(checkpoint, family):
    report = _check.check(checkpoint(family), batch=2, seq_len=8, repeats=1)
    assert {r.path for r in report.rows} == {"eager", "jit"}, report.table()
    assert report.passed, report.table()
