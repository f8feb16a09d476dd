"""Tests of sampled tokens: whether two sets of draws come from one distribution."""

from __future__ import annotations

import numpy as np
import scipy.stats


def same_distribution_p(a: np.ndarray, b: np.ndarray) -> float:
    """The chi-square test's p-value that the tokens `a` [N] and `b` [M] come from one distribution
    (tokens seen fewer than 10 times in both together pooled as one)."""
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = tokens[counts >= 10]
    table = np.array([[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))] for x in (a, b)])
    table = table[:, table.sum(axis=0) > 0]
    return scipy.stats.chi2_contingency(table).pvalue
