"""Acceptance estimates per draft depth, for the adaptive budget (pure Python)."""

from __future__ import annotations


class ConditionalAcceptance:
    """P(accepted drafts >= d+1) per depth d, kept as conditionals: depth d+1
    given d, an EWMA over the trees that reached depth d (its data part, and the
    weight the data has in it; the rest is a prior). See
    ``AdaptiveBudget.accepted_at`` for why conditionals."""

    def __init__(self, depth: int):
        self.data = [0.0] * depth
        self.seen = [0.0] * depth

    def estimates(self, rate: float, prior_trees: float) -> list[float]:
        out: list[float] = []
        for d in range(len(self.data)):
            if d == 0:
                prior = 0.5
            elif d == 1:
                prior = out[0]
            else:
                prior = out[d - 1] / out[d - 2] if out[d - 2] > 0 else 0.0
            # seen / rate is about the number of trees seen (up to 1 / rate); the
            # prior's weight fades as the EWMA fills, so a long-observed rate is
            # the data's.
            w = prior_trees * (1.0 - self.seen[d])
            conditional = (self.data[d] / rate + w * prior) / (self.seen[d] / rate + w)
            out.append(conditional * (out[d - 1] if d else 1.0))
        return out

    def set(self, values: list[float]) -> None:  # as if observed for long
        above = [1.0] + [float(v) for v in values[:-1]]
        self.data = [float(v) / a if a > 0 else 0.0 for v, a in zip(values, above)]
        self.seen = [1.0] * len(values)

    def observe(self, accepted: list[int], depth_used: int, rate: float,
                censored: list[bool] | None = None) -> None:
        """One verified tree (or chain) per entry. A censored one was accepted
        to its end: it tells nothing about the depth below (for a chain verified
        whole, counting it as a rejection there would price the chain by how
        often tree-mode selections cut it short)."""
        censored = censored or [False] * len(accepted)
        for d in range(min(depth_used, len(self.data))):
            reached = [a for a, c in zip(accepted, censored) if a > d or (a == d and not c)]
            if not reached:
                break
            keep = (1.0 - rate) ** len(reached)
            conditional = sum(1 for a in reached if a > d) / len(reached)
            self.data[d] = keep * self.data[d] + (1.0 - keep) * conditional
            self.seen[d] = keep * self.seen[d] + (1.0 - keep)
