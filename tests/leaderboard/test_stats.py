"""Leaderboard statistics against scipy.stats on known samples and random ones."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.stats import (
    combined_se,
    mean,
    paired_comparison,
    paired_t,
    pop_se,
    sample_se,
    sign_test,
    wilcoxon,
)

X = [71.0, 80.5, 64.0, 90.0, 55.5, 77.0, 68.0, 83.0, 59.0, 74.5]
Y = [65.0, 79.0, 66.5, 81.0, 50.0, 70.0, 69.0, 75.0, 51.75, 70.0]


def test_means_and_standard_errors_float64_reference():
    a = np.array(X)
    assert mean(X) == pytest.approx(a.mean(), rel=1e-15)
    assert pop_se(X) == pytest.approx(a.std(ddof=0) / math.sqrt(len(a)), rel=1e-13)
    assert sample_se(X) == pytest.approx(stats.sem(a), rel=1e-13)
    assert combined_se([3.0, 4.0]) == pytest.approx(2.5)
    assert math.isnan(mean([])) and math.isnan(sample_se([1.0]))


def test_paired_t_matches_scipy():
    d = [a - b for a, b in zip(X, Y)]
    t, p, (lo, hi) = paired_t(d)
    ref = stats.ttest_rel(X, Y)
    assert t == pytest.approx(ref.statistic, rel=1e-12)
    assert p == pytest.approx(ref.pvalue, rel=1e-10)
    ci = ref.confidence_interval(0.95)
    assert (lo, hi) == (pytest.approx(ci.low, rel=1e-10), pytest.approx(ci.high, rel=1e-10))


def test_wilcoxon_exact_matches_scipy():
    d = [a - b for a, b in zip(X, Y)]  # no ties, no zeros: exact
    w, p, method = wilcoxon(d)
    ref = stats.wilcoxon(X, Y, method="exact")
    assert method == "exact" and w == ref.statistic and p == pytest.approx(ref.pvalue, rel=1e-12)


def test_wilcoxon_normal_with_ties_and_zeros_matches_scipy():
    # BabyAI-like: 0/100 progressions, many ties and zero differences
    x = [100, 0, 100, 100, 0, 100, 100, 0, 100, 100, 0, 100, 100, 100, 0, 100]
    y = [100, 100, 0, 100, 0, 0, 100, 100, 0, 0, 0, 0, 100, 0, 0, 0]
    w, p, method = wilcoxon([a - b for a, b in zip(x, y)])
    ref = stats.wilcoxon(x, y, method="asymptotic", zero_method="wilcox", correction=False)
    assert method == "normal" and w == ref.statistic and p == pytest.approx(ref.pvalue, rel=1e-12)


def test_sign_test_matches_binomtest():
    d = [1, 2, -1, 3, 4, 5, -2, 1, 0, 2, 3]
    pos, n = sum(v > 0 for v in d), sum(v != 0 for v in d)
    assert sign_test(d) == pytest.approx(stats.binomtest(pos, n, 0.5).pvalue, rel=1e-12)
    assert sign_test([0, 0]) == 1.0


@pytest.mark.parametrize(("pos", "n"), [(1400, 3072), (1530, 3072), (40, 5000)])
def test_sign_test_large_n_matches_binomtest(pos, n):
    """Thousands of pairs (per-token comparisons of the lm suites): no float overflow."""
    d = [1.0] * pos + [-1.0] * (n - pos)
    assert sign_test(d) == pytest.approx(stats.binomtest(pos, n, 0.5).pvalue, rel=1e-9, abs=1e-300)


def test_paired_comparison_bundle_and_degenerate_cases():
    c = paired_comparison(X, Y)
    assert (
        c.n == 10
        and c.wins + c.losses + c.ties == 10
        and c.mean_diff == pytest.approx(np.mean(X) - np.mean(Y))
    )
    same = paired_comparison([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert (
        same.t_pvalue == 1.0
        and same.wilcoxon_pvalue == 1.0
        and same.sign_pvalue == 1.0
        and same.ci95 == (0, 0)
    )
    shifted = paired_comparison([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert shifted.t_pvalue == 0.0 and shifted.mean_diff == 1.0
    with pytest.raises(InvalidArgumentError, match="equal lengths"):
        paired_comparison([1.0], [1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match=">= 2 pairs"):
        paired_comparison([1.0], [2.0])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-50, 50, allow_nan=False), st.floats(-50, 50, allow_nan=False)),
        min_size=3,
        max_size=30,
    )
)
def test_random_samples_agree_with_scipy(pairs):
    x = [round(a, 3) for a, _ in pairs]
    y = [round(b, 3) for _, b in pairs]
    d = np.subtract(x, y)
    if np.std(d) < 1e-6 or np.count_nonzero(d) < 2:
        return
    c = paired_comparison(x, y)
    ref = stats.ttest_rel(x, y)
    assert c.t_pvalue == pytest.approx(ref.pvalue, rel=1e-8, abs=1e-12)
    method = "exact" if c.wilcoxon_method == "exact" else "asymptotic"
    w = stats.wilcoxon(x, y, method=method, zero_method="wilcox", correction=False)
    assert c.wilcoxon_stat == pytest.approx(w.statistic) and c.wilcoxon_pvalue == pytest.approx(
        w.pvalue, rel=1e-8
    )
    pos, n = int(np.sum(d > 0)), int(np.count_nonzero(d))
    assert c.sign_pvalue == pytest.approx(stats.binomtest(pos, n, 0.5).pvalue, rel=1e-10)
