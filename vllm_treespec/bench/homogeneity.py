"""Chi-squared homogeneity of two samples of discrete outcomes (the T > 0 tests
and ``stock_t1_lossless.py`` judge losslessness with it)."""

from __future__ import annotations

from collections import Counter


def contingency_table(ca: Counter, cb: Counter) -> list[list[int]]:
    """2 x K counts: outcomes seen >= 10 times in both samples together, the rarer
    ones pooled into one column."""
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    common = [k for k in keys if ca[k] + cb[k] >= 10]
    rest = [k for k in keys if ca[k] + cb[k] < 10]
    table = [[ca[k] for k in common], [cb[k] for k in common]]
    if rest:
        table[0].append(sum(ca[k] for k in rest))
        table[1].append(sum(cb[k] for k in rest))
    return table


def homogeneity_pvalue(a: list, b: list) -> float:
    """Chi-squared homogeneity of the distributions of two samples' outcomes."""
    from scipy import stats

    return stats.chi2_contingency(contingency_table(Counter(a), Counter(b))).pvalue
