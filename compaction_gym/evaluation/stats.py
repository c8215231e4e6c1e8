"""Statistics of evaluation scores: mean, standard errors, and paired comparisons of two methods.

Formulas are in ``docs/leaderboard.md`` ("Statistics"); the tests check them against
``scipy.stats`` (``ttest_rel``, ``wilcoxon``, ``binomtest``) on known samples. Only scipy's
special functions (Student's t distribution) are used here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from compaction_gym.errors import InvalidArgumentError


def mean(xs: Sequence[float]) -> float:
    """Arithmetic mean (``nan`` for no values); left-to-right ``sum``, so summaries stay
    bit-identical to earlier ``eval`` runs."""
    return float(sum(xs) / len(xs)) if xs else float("nan")


def pop_se(xs: Sequence[float]) -> float:
    """BALROG's standard error: population standard deviation / √n (``nan`` for no values)."""
    if not xs:
        return float("nan")
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) / math.sqrt(len(xs))


def sample_se(xs: Sequence[float]) -> float:
    """Standard error of the mean with the sample (n − 1) standard deviation (``nan`` for n < 2)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1)) / math.sqrt(n)


def combined_se(ses: Sequence[float]) -> float:
    """SE of a mean of independent means: √(Σ SE²) / k (BALROG's overall SE)."""
    return math.sqrt(math.fsum(se * se for se in ses)) / len(ses) if ses else float("nan")


@dataclass(frozen=True)
class PairedComparison:
    """``x − y`` over paired samples (same env seeds): mean difference, 95 % CI and p-values.

    Attributes:
        n: pairs; n_nonzero: pairs whose difference is not 0.
        mean_diff: mean of the differences; ci95: its two-sided 95 % t interval.
        t_stat, t_pvalue: paired t-test (two-sided, n − 1 degrees of freedom).
        wilcoxon_stat, wilcoxon_pvalue, wilcoxon_method: Wilcoxon signed-rank (zeros dropped;
            statistic min(W+, W−); ``exact`` without ties or zeros and n ≤ 50, else ``normal``).
        sign_pvalue: exact two-sided sign test (binomial, p = 1/2) on the nonzero differences.
        wins, losses, ties: pairs with x > y, x < y, x = y.
    """

    n: int
    n_nonzero: int
    mean_diff: float
    ci95: tuple[float, float]
    t_stat: float
    t_pvalue: float
    wilcoxon_stat: float
    wilcoxon_pvalue: float
    wilcoxon_method: str
    sign_pvalue: float
    wins: int
    losses: int
    ties: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def paired_t(diffs: Sequence[float]) -> tuple[float, float, tuple[float, float]]:
    """Paired t-test on the differences: ``(t, two-sided p, 95 % CI of the mean)``.

    Constant differences: ``p = 1`` (all zero) or ``0`` (all equal and nonzero), CI the point.
    """
    from scipy.special import stdtr, stdtrit

    n = len(diffs)
    if n < 2:
        raise InvalidArgumentError(f"a paired comparison needs >= 2 pairs, got {n}")
    m = mean(diffs)
    se = sample_se(diffs)
    if se == 0.0:
        return (0.0 if m == 0 else math.copysign(math.inf, m)), (1.0 if m == 0 else 0.0), (m, m)
    t = m / se
    df = n - 1
    p = float(2.0 * stdtr(df, -abs(t)))
    half = float(stdtrit(df, 0.975)) * se
    return t, min(1.0, p), (m - half, m + half)


def sign_test(diffs: Sequence[float]) -> float:
    """Exact two-sided sign test: ``min(1, 2 · P(X ≤ min(k, n − k)))``, X ~ Bin(n, 1/2) over the
    nonzero differences (``1`` when there are none)."""
    pos = sum(1 for d in diffs if d > 0)
    n = sum(1 for d in diffs if d != 0)
    if n == 0:
        return 1.0
    k = min(pos, n - pos)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # exact integers: no overflow at large n
    return min(1.0, 2.0 * tail)


def _ranks(values: Sequence[float]) -> tuple[list[float], bool]:
    """Average ranks (1-based) and whether there were ties."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    ties = False
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        ties = ties or j > i
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks, ties


def wilcoxon(diffs: Sequence[float]) -> tuple[float, float, str]:
    """Wilcoxon signed-rank test: ``(min(W+, W−), two-sided p, method)``.

    Zero differences are dropped (Wilcoxon's convention). Without ties or zeros and with
    n ≤ 50 the p-value is exact (the null distribution of W+ counted by dynamic programming);
    otherwise it is the normal approximation with the tie-corrected variance and no continuity
    correction. No nonzero differences: ``(0, 1, "none")``.
    """
    nz = [d for d in diffs if d != 0]
    n = len(nz)
    if n == 0:
        return 0.0, 1.0, "none"
    ranks, ties = _ranks([abs(d) for d in nz])
    w_plus = math.fsum(r for r, d in zip(ranks, nz) if d > 0)
    w_minus = n * (n + 1) / 2.0 - w_plus
    stat = min(w_plus, w_minus)
    if not ties and n == len(diffs) and n <= 50:
        top = n * (n + 1) // 2
        counts = [0] * (top + 1)
        counts[0] = 1
        for r in range(1, n + 1):
            for s in range(top, r - 1, -1):
                counts[s] += counts[s - r]
        tail = math.fsum(counts[: int(stat) + 1]) / 2.0**n
        return stat, min(1.0, 2.0 * tail), "exact"
    mu = n * (n + 1) / 4.0
    tie_sizes: dict[float, int] = {}
    for d in nz:
        tie_sizes[abs(d)] = tie_sizes.get(abs(d), 0) + 1
    var = n * (n + 1) * (2 * n + 1) / 24.0 - math.fsum(t**3 - t for t in tie_sizes.values()) / 48.0
    if var <= 0:
        return stat, 1.0, "normal"
    z = (w_plus - mu) / math.sqrt(var)
    p = math.erfc(abs(z) / math.sqrt(2.0))
    return stat, min(1.0, p), "normal"


def paired_comparison(x: Sequence[float], y: Sequence[float]) -> PairedComparison:
    """Compare paired samples ``x`` and ``y`` (``x[i]`` and ``y[i]`` share an env seed).

    Raises:
        InvalidArgumentError: different lengths or fewer than 2 pairs.
    """
    if len(x) != len(y):
        raise InvalidArgumentError(f"paired samples need equal lengths, got {len(x)} and {len(y)}")
    diffs = [float(a) - float(b) for a, b in zip(x, y)]
    t, tp, ci = paired_t(diffs)
    w, wp, method = wilcoxon(diffs)
    return PairedComparison(
        n=len(diffs),
        n_nonzero=sum(1 for d in diffs if d != 0),
        mean_diff=mean(diffs),
        ci95=ci,
        t_stat=t,
        t_pvalue=tp,
        wilcoxon_stat=w,
        wilcoxon_pvalue=wp,
        wilcoxon_method=method,
        sign_pvalue=sign_test(diffs),
        wins=sum(1 for d in diffs if d > 0),
        losses=sum(1 for d in diffs if d < 0),
        ties=sum(1 for d in diffs if d == 0),
    )
