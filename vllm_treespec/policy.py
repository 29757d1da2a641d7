"""Adaptive speculation budget: speculate only as much as pays off, per step.

Speculation trades extra compute per step (drafting, and verifying 1 + n
tokens per request instead of 1) for more tokens per step. On a busy batch the
extra verify tokens cost real time, so the same tree that doubles batch-1
speed can slow a batch of 32 down. This policy keeps a small live cost model
and decides every step:

* **how deep to draft** (0 = no tree levels this step): for each depth d, the
  predicted throughput ratio vs plain decoding,

      R(d) = [B * (1 + A(d))] / [t(B * (1 + n(d))) + t_draft(d)]  /  [B / t(B)],

  where t(N) = a + b*N is the step time for N verified tokens (fitted online,
  seeded by a short calibration at startup), t_draft(d) the measured drafting
  time, A(d) the accepted drafts per request seen so far at depth <= d, and
  n(d) the nodes such a tree holds. The best d wins if R(d) beats 1 by a margin;
  otherwise speculation is off for the step (the drafter still reads the new
  tokens so it stays in sync). Occasionally a full tree is drafted anyway to
  keep the acceptance statistics current.

* **which nodes to verify**, across the whole batch: every candidate node has
  an acceptance probability estimate q = kappa * exp(cumulative draft log-prob)
  (kappa calibrates the drafter online). Taking candidates in decreasing q, the
  best prefix maximises (B + sum q) / t(B + k) — the EAGLE-2 rerank generalised
  to a batch under a cost model. Per request that prefix is its top-n by score,
  which is ancestor-closed, i.e. a valid tree.

Pure Python/torch; the runner feeds it timings and acceptance counts.
"""

from __future__ import annotations

import dataclasses
import random

import torch


@dataclasses.dataclass
class LinearFit:
    """Exponentially weighted least squares for y = a + b*x."""

    decay: float = 0.97
    sums: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 5)
    # Calibration points never decay: live steps often all have the same size,
    # which alone cannot separate the fixed cost from the per-token cost.
    prior: list[float] = dataclasses.field(default_factory=lambda: [0.0] * 5)

    @staticmethod
    def _terms(x: float, y: float, w: float) -> list[float]:
        return [w, w * x, w * y, w * x * x, w * x * y]

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.sums = [self.decay * s + t for s, t in zip(self.sums, self._terms(x, y, weight))]

    def add_prior(self, x: float, y: float, weight: float = 1.0) -> None:
        self.prior = [s + t for s, t in zip(self.prior, self._terms(x, y, weight))]

    def coefficients(self) -> tuple[float, float] | None:
        sw, sx, sy, sxx, sxy = (a + b for a, b in zip(self.sums, self.prior))
        if sw <= 0:
            return None
        var = sxx * sw - sx * sx
        if var <= 1e-9 * max(sw, 1.0) ** 2 * max(sxx / sw, 1.0):
            return None
        b = (sxy * sw - sx * sy) / var
        a = (sy - b * sx) / sw
        return a, max(b, 0.0)

    def __call__(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else max(c[0] + c[1] * x, 1e-6)


class AdaptiveBudget:
    def __init__(self, num_nodes: int, depth: int, width: int, margin: float = 0.03,
                 probe_every: int = 32, seed: int = 0):
        self.M, self.D, self.K = num_nodes, depth, width
        self.margin = margin
        self.probe_every = probe_every
        self.step_cost = LinearFit()          # seconds for N verified tokens (no drafting)
        self.level_cost = LinearFit()         # seconds per drafting level vs B*width
        self.first_pass_cost = LinearFit()    # seconds of the drafter's first pass vs tokens
        self.kappa = 1.0                      # calibration of draft probabilities
        self._pred, self._obs = 1e-6, 1e-6
        # accepted_at[d]: EWMA of P(accepted drafts >= d+1) for full-depth trees
        self.accepted_at = [0.5 ** (d + 1) for d in range(depth)]
        self._rng = random.Random(seed)
        self._steps = 0
        self.last_depth = depth

    # ---------------------------------------------------------------- observe
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Wall time of a decode/verify step (no prefill), drafting excluded."""
        if seconds > 0 and num_tokens > 0:
            self.step_cost.add(num_tokens, seconds)

    def observe_draft(self, batch: int, width: int, levels: int, first_pass_tokens: int,
                      first_pass_s: float, levels_s: float) -> None:
        self.first_pass_cost.add(first_pass_tokens, first_pass_s)
        if levels > 0:
            self.level_cost.add(batch * width, levels_s / levels)

    def observe_acceptance(self, accepted: list[int], depth_used: int,
                           predicted: float) -> None:
        """accepted: accepted drafts per tree of one step; predicted: the sum of
        the (uncalibrated) probabilities of the verified nodes."""
        if not accepted:
            return
        self._obs = 0.95 * self._obs + sum(accepted)
        self._pred = 0.95 * self._pred + predicted
        self.kappa = min(max(self._obs / self._pred, 0.05), 20.0)
        n = len(accepted)
        for d in range(min(depth_used, self.D)):
            rate = sum(1 for a in accepted if a >= d + 1) / n
            self.accepted_at[d] = 0.9 * self.accepted_at[d] + 0.1 * rate

    # ---------------------------------------------------------------- decide
    def _nodes_for_depth(self, d: int) -> int:
        # A typical trimmed tree: about one frontier's width per level.
        return min(self.M, d * self.K)

    def predicted_ratio(self, batch: int, d: int) -> float | None:
        plain = self.step_cost(batch)
        if plain is None:
            return None
        if d == 0:
            return 1.0
        n = self._nodes_for_depth(d)
        t = self.step_cost(batch * (1 + n))
        draft = (self.level_cost(batch * self.K) or 0.0) * (d - 1)
        if t is None:
            return None
        gain = 1.0 + sum(self.accepted_at[:d])
        return (gain / (t + draft)) / (1.0 / plain)

    def plan_depth(self, batch: int) -> int:
        """Drafting depth for this step (0 = no tree levels)."""
        self._steps += 1
        if self.probe_every and self._steps % self.probe_every == 0:
            self.last_depth = self.D  # refresh the acceptance statistics
            return self.D
        best_d, best = 0, 1.0 + self.margin
        for d in range(1, self.D + 1):
            r = self.predicted_ratio(batch, d)
            if r is None:  # no cost model yet: speculate fully
                self.last_depth = self.D
                return self.D
            if r > best:
                best_d, best = d, r
        self.last_depth = best_d
        return best_d

    def select(self, scores: torch.Tensor, max_nodes: int) -> torch.Tensor:
        """Per-request node budgets [B] from candidate scores [B, N] (cumulative
        draft log-probs; -inf for non-candidates), maximising predicted throughput."""
        B = scores.shape[0]
        q = (self.kappa * torch.exp(scores.float())).clamp(max=1.0)
        q = torch.nan_to_num(q, nan=0.0)
        top = torch.topk(q, min(max_nodes, q.shape[1]), dim=1).values      # [B, m]
        flat, _ = torch.sort(top.reshape(-1), descending=True)
        coeff = self.step_cost.coefficients()
        if coeff is None:
            return torch.full((B,), max_nodes, dtype=torch.long, device=scores.device)
        a, b = coeff
        k = torch.arange(flat.numel() + 1, device=flat.device, dtype=torch.float32)
        gain = B + torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])
        rate = gain / (a + b * (B + k))
        best_k = int(torch.argmax(rate))
        if best_k == 0:
            return torch.zeros(B, dtype=torch.long, device=scores.device)
        threshold = flat[best_k - 1]
        # Nodes at or above the threshold (ties may add a few; harmless).
        return (top >= threshold).sum(1).clamp(max=max_nodes).long()


def probability_sum(scores: torch.Tensor, num_nodes: torch.Tensor) -> float:
    """Sum of exp(score) over each tree's first num_nodes draft nodes (root excluded)."""
    T = scores.shape[1]
    idx = torch.arange(T, device=scores.device).unsqueeze(0)
    keep = (idx >= 1) & (idx <= num_nodes.unsqueeze(1))
    return float(torch.where(keep, torch.exp(scores.float()), 0.0).sum())

