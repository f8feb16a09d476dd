"""Every supported family, loaded by hfjax, matches the same checkpoint run by PyTorch: compiled,
and for one family of each kind also op by op (eager), which costs ~4x the compiled check."""

from __future__ import annotations

import pytest

import hfjax
from hfjax import testing

EAGER_FAMILIES = ("llama", "gpt2", "mixtral", "mamba", "recurrent_gemma", "bert", "t5")


@pytest.mark.parametrize("family", testing.FAMILIES)
def test_family_matches_pytorch(checkpoint, family):
    eager = family in EAGER_FAMILIES
    report = hfjax.check(checkpoint(family), batch=2, seq_len=8, repeats=1, eager=eager)
    assert {r.path for r in report.rows} == ({"eager", "jit"} if eager else {"jit"}), report.table()
    assert report.passed, report.table()
