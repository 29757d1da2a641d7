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


def next_token_homogeneity_pvalue(a: list[tuple], b: list[tuple], length: int,
                                  min_context: int = 20) -> float:
    """Chi-squared homogeneity of the next-token distributions after every output
    prefix (of draws ``length`` tokens long) both samples reach at least
    ``min_context`` times, summed over prefixes.

    A sequence's probability is the product of these conditionals, so the tests
    are asymptotically independent and their statistics and degrees of freedom
    add up. Unlike the whole-sequence test, whose outcomes spread over hundreds of
    rare sequences, this one looks where trees decide: one node's siblings.
    """
    from scipy import stats

    statistic, dof = 0.0, 0
    for k in range(length):
        after_a: dict[tuple, Counter] = {}
        after_b: dict[tuple, Counter] = {}
        for seqs, after in ((a, after_a), (b, after_b)):
            for s in seqs:
                after.setdefault(s[:k], Counter())[s[k]] += 1
        for context, ca in after_a.items():
            cb = after_b.get(context, Counter())
            if min(ca.total(), cb.total()) < min_context:
                continue
            table = contingency_table(ca, cb)
            if len(table[0]) > 1:
                result = stats.chi2_contingency(table, correction=False)
                statistic, dof = statistic + result.statistic, dof + result.dof
    return float(stats.chi2.sf(statistic, dof)) if dof else 1.0
