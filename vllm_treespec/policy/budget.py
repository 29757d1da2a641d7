"""Adaptive speculation budget: speculate only as much as pays off, per step.

Speculation trades extra compute per step (drafting, and verifying 1 + n
tokens per request instead of 1) for more tokens per step. On a busy batch the
extra verify tokens cost real time, so the same tree that doubles batch-1
speed can slow a batch of 32 down. This policy keeps a small live cost model
and decides every step:

* **how deep to draft** (0 = no tree levels this step): for each depth d, the
  predicted throughput ratio vs plain decoding,

      R(d) = [B * (1 + A(d))] / [t(B * (1 + n(d))) + t_draft(d)]  /  [B / t(B)],

  where t(N) is the step time for N verified tokens (a piecewise-linear table
  from a timing sweep at startup, refined online; each side's sampling priced
  apart and added: vLLM's sampler on a plain step, the tree sampler with its
  acceptance on a verify step, both fitted live), t_draft(d) the measured drafting
  time (the drafter's first pass over the verified tokens, the step's fixed
  drafting work around it, and d - 1 levels of ``level_width(d)`` nodes per
  request), A(d) the accepted drafts per request
  seen so far at depth <= d (per drafted request: one the selection left
  without drafts accepted none), and
  n(d) the nodes per request that trees drafted to depth d kept after the node
  selection below (a chain, n(d) = d, until observed: on a CPU, where every
  verified token costs, the selection often trims trees to short chains). The
  best d wins if R(d) beats 1 by a margin; otherwise speculation is off for the
  step and costs what a plain step costs: the drafter does not run at all (the
  proposer defers its inputs and catches its KV up when drafting resumes, so
  t_draft(d) of the first step after off steps includes that catch-up).
  Now and then a step probes one level deeper than planned (``probes``:
  when; while off, never more than ``PROBE_SHARE``, 1 %, of the time at the
  batch size at hand). t(.) also carries the branching extra
  below, in proportion to how often trees drafted to depth d branched.

  Each depth is priced twice: as above (tree mode), and as the greedy chain of
  d nodes verified whole (chain mode: n(d) = d, one-wide levels, no branching
  extra, and the chain's own acceptance: its first node from every verified
  tree, its deeper nodes only from chains verified whole, in chain mode and
  probes, since a tree-mode selection lets a chain reach a depth only where it
  looks sure there).

* **when to stop drafting** (tree mode): a level runs only if the frontier it
  would forward is likely enough to be accepted to pay for it. Before each
  level, the expected acceptance of its forwarded nodes (sum of q, below)
  must reach what the level costs (its drafting time plus one more verified
  token per request) at the rate the planned step yields, tokens per second
  (``level_pays``). The planned depth is then a cap: a step whose chain turns
  unsure stops early and verifies what it has, one whose chain stays sure
  reaches the cap. Replayed over batch-1 traces of a one-wide chain on the
  CPU, this rule beat the best fixed chain length of the same drafts
  (benchmarks/history/RESULTS-history.md, "Drafting that stops where the chain
  turns unsure (2026-11-28, later): 11 % in a replay, within the noise
  served"); the planned depth is priced with the levels such steps really ran
  (``levels_at``), and tree mode counts a chain stopped early as not accepted
  beyond its end, as it counts a selection that cut it.

* **how wide to draft**: a level forwards only frontier nodes whose children
  can still be verified. In chain mode, or where the selection below keeps chains (branch_at(d)
  below one half: a device whose causal kernel makes branching dear), levels
  forward one node per request, the chain's tip, and cost what a stock chain
  draft step costs; otherwise the full frontier of ``width`` nodes.

* **which nodes to verify**, across the whole batch: every candidate node has
  an acceptance probability estimate q = kappa * exp(cumulative draft log-prob)
  (kappa calibrates the drafter online); the best prefix of the candidates by
  q maximises (B + sum q) / t(B + k) (``selection``). The same cut restricted to each
  request's greedy chain competes with it: chains verify with a device's
  causal kernel, while a step with branching trees pays a learned extra cost
  for tree attention (large on the CPU, about zero with a fused tree kernel).

What it has learned lives in ``estimates`` (``BudgetEstimates``, this class's base);
the runner and the proposer feed it timings and acceptance counts. Pure Python/torch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_treespec.policy.estimates import BudgetEstimates
from vllm_treespec.policy.probes import ProbeSchedule
from vllm_treespec.policy.selection import best_extension, best_prefix


class AdaptiveBudget(BudgetEstimates):
    # While off, probes may cost at most this share of the time (their extra over
    # plain steps). At batch 1 a probe costs a tenth of a plain step and the gaps
    # above decide; at 16 requests it verifies 16 chains (a step that costs a few
    # plain ones, plus the drafter's catch-up), so gaps alone overspend under load
    # (benchmarks/history/RESULTS-history.md, "Latest (2026-11-26, night): per-step
    # overheads trimmed, probes sized to the batch; `eagle3_tree` 1.07x stock k=2
    # served; the fixed M=8 tree ahead of stock; 0.98x plain at 16 requests").
    PROBE_SHARE = 0.01

    def __init__(self, num_nodes: int, depth: int, width: int, margin: float = 0.03,
                 probe_every: int = 32, chains: bool = True,
                 parallel: bool = False):
        super().__init__(num_nodes, depth, width)
        self.chains = chains  # price the greedy chain too (no: a static topology)
        # Parallel drafting: all depths below the first come from one forward of
        # depth - 1 slots per request (level_cost vs B * (depth - 1)), whatever the width.
        self.parallel = parallel
        self.margin = margin
        self.probes = ProbeSchedule(probe_every)
        self._steps = 0
        self.last_depth = depth
        # Tokens per second the planned step is expected to yield (level_pays);
        # None while the plan is not priced (no cost model yet, or off).
        self._plan_rate: float | None = None

    # ---------------------------------------------------------------- decide
    def level_width(self, d: int) -> int:
        """Frontier nodes per request that this step, drafted to depth ``d``,
        forwards at each level: the chain's tip alone in chain mode, or while
        tree-mode selections at that depth keep chains; else the full frontier."""
        return 1 if self.chain_mode else self._tree_level_width(d)

    def _tree_level_width(self, d: int) -> int:
        if d < 1 or not self.chains:  # a static topology forwards its levels whole
            return self.width
        return 1 if self.branch_at[min(d, self.max_depth) - 1] < 0.5 else self.width

    def predicted_ratio(self, batch: int, d: int, chain: bool = False) -> float | None:
        """Predicted throughput vs plain decoding of drafting to depth ``d``: in
        tree mode, at the size, width and branching tree-mode selections at that
        depth had; with ``chain``, the greedy chain of ``d`` nodes verified whole,
        as stock EAGLE's chain is."""
        if d == 0:
            return None if self.step_cost(batch) is None else 1.0
        ratios = self.predicted_ratios(batch)
        return None if ratios is None else float(ratios[d - 1, int(chain)])

    def predicted_ratios(self, batch: int) -> np.ndarray | None:
        """[depth, 2] predicted ratios of every depth as a tree (column 0) and
        as a chain (column 1); one pass, since ``plan_depth`` runs every step."""
        D = self.max_depth
        depths = np.arange(1, D + 1, dtype=np.float64)
        nodes = np.stack([np.minimum(float(self.max_nodes), np.asarray(self.nodes_at)), depths], 1)
        t = self.step_cost.costs(np.concatenate([[batch], (batch * (1 + nodes)).ravel()]))
        if t is None:
            return None
        # Sampling apart: a verify step's tree sampler against a plain step's.
        plain_sampling, tree_sampling = self.sampling_costs(batch, (batch * (1 + nodes)).ravel())
        plain, verify = t[0] + plain_sampling, (t[1:] + tree_sampling).reshape(D, 2)
        # Trees pay the branching extra as often as trees drafted there branched.
        verify[:, 0] += max(self.branch_cost, 0.0) * np.asarray(self.branch_at)
        # An off step skips the drafter entirely, so a drafting step pays its
        # first pass and its fixed work as well as its levels: with the fixed
        # work left out, a depth-1 tree (no level ran to carry it) was priced
        # under its served cycle (benchmarks/history/RESULTS-history.md, "Latest
        # (2026-11-26, small hours): the drafting step's fixed work priced, and
        # the must-show met").
        first = self.first_pass_cost.values(batch * (1 + nodes))
        first = 0.0 if first is None else first
        wide, one = self.level_cost(batch * self.width), self.chain_level_cost(batch)
        if wide is None:  # no wide level seen yet: K tips' worth of chain levels
            wide = self.chain_level_cost(batch * self.width)
        if one is None:
            one = self.level_cost(batch)
        levels = {self.width: wide or 0.0, 1: one or 0.0}
        if self.parallel:
            slots = self.level_cost.values(batch * (depths - 1))
            slots = np.zeros(D) if slots is None else np.where(depths > 1, slots, 0.0)
            all_levels = np.stack([slots, slots], 1)
        else:
            per_level = np.array([[levels[self._tree_level_width(d)], levels[1]]
                                  for d in range(1, D + 1)])
            all_levels = per_level * np.stack([np.asarray(self.levels_at), depths - 1], 1)
        # After off steps the drafter first catches up on what they deferred, a
        # cost this step pays and a plain one would not: served under load, tree
        # steps after an off stretch drafted for about as long as a plain step
        # took (benchmarks/RESULTS.md, "Copies from other requests"). Zero while
        # speculating (each step's first pass leaves nothing pending).
        draft = first + (self.draft_overhead(batch) or 0.0) + self.pending_catch_up_cost() \
            + all_levels
        gain = 1.0 + np.cumsum(np.array([self.accepted_at, self.chain_accepted_at]).T, 0)
        return gain / (verify + draft) * plain

    def plan_depth(self, batch: int) -> int:
        """Drafting depth for this step (0 = no tree levels), and ``chain_mode``.

        Each depth is priced twice: as the tree that tree-mode selections keep
        there, and as the greedy chain verified whole. Traced on the CPU, where
        a branching verify costs more than a chain of its size, pricing trees
        only planned mostly depth 1 or 3 or off, and never the chain of 2 that
        beat it in one process (benchmarks/history/RESULTS-history.md, "Latest
        (2026-11-25, late evening): an Intel Xeon, Intel OpenMP, and what a
        branching tree costs"). Ties go to the tree, which sees more.
        """
        self._steps += 1
        ratios = self.predicted_ratios(batch)
        if ratios is None:  # no cost model yet: speculate fully
            self.last_depth, self.chain_mode = self.max_depth, False
            return self.max_depth
        best_d, best, chain_mode = 0, 1.0 + self.margin, False
        for d in range(1, self.max_depth + 1):
            for chain in (False, True) if self.chains else (False,):
                r = float(ratios[d - 1, int(chain)])
                if r > best:
                    best_d, best, chain_mode = d, r, chain
        self.probing = self.probes.due(self._steps, best_d > 0,
                                       lambda: self.probe_cost_gap(batch))
        self._probing_while_off = self.probing and best_d == 0
        if self.probing:
            # Explore one level deeper than the plan, to keep the statistics of
            # the next depth current (a full-depth probe of a wide batch would
            # cost more than the decision it informs); from off, with a chain.
            best_d = min(self.max_depth, best_d + 1)
            chain_mode = self.chains and (chain_mode or best_d == 1)
        self.last_depth, self.chain_mode = best_d, chain_mode
        plain = self.plain_cost(batch)
        self._plan_rate = (best * batch / plain if best_d > 0 and not self.probing and plain
                           else None)
        return best_d

    def level_pays(self, frontier_scores: torch.Tensor, levels_done: int) -> bool:
        """Whether a tree-mode step should run its next drafting level, which
        would forward the frontier nodes scored ``frontier_scores`` [B, F]
        (cumulative draft log-probs) after ``levels_done`` levels.

        Yes if their summed acceptance estimates (q, kappa-calibrated) reach
        what the level costs in tokens: its drafting time plus one more verified
        token per request, times the planned step's rate. A node's children are
        at most as likely as the node, so this is the level's best case; it
        stops only levels that cannot pay. Chain mode (verified whole, priced
        whole) and probes (which must reach their depth) never stop; without
        estimates of the costs neither does anything else."""
        rate = self._plan_rate
        if self.chain_mode or self.probing or rate is None:
            return True
        B, F = frontier_scores.shape
        level = self.chain_level_cost(B) if F == 1 else self.level_cost(B * F)
        # Verified tokens a request so far: the root and a draft per depth drafted
        # (the first pass's and one per level); the next level adds one.
        now_n = B * (2 + levels_done)
        costs = self.verify_costs(B, np.array([now_n + B, now_n], dtype=np.float64))
        if level is None or costs is None:
            return True
        more, now = float(costs[0]), float(costs[1])
        # A few numbers: plain Python costs less than torch ops on them.
        gain = sum(min(self.kappa * math.exp(s), 1.0) for s in frontier_scores.flatten().tolist())
        return gain >= (level + max(more - now, 0.0)) * rate

    def probe_cost_gap(self, batch: int) -> int:
        """Fewest steps between probes while off such that a probe's extra cost
        (each request's first draft verified, drafted from a first pass over
        its token, after catching the drafter up on the deferred inputs) stays
        under ``PROBE_SHARE`` of the steps' time."""
        plain, probe = self.plain_cost(batch), self.verify_costs(batch, np.array([2.0 * batch]))
        if plain is None or probe is None:
            return 0
        probe = float(probe[0])
        draft = (self.first_pass_cost(batch) or 0.0) + (self.draft_overhead(batch) or 0.0)
        gap = max(probe + draft - plain, 0.0) / (self.PROBE_SHARE * plain)
        # The probe also catches the drafter up on what the off steps until then
        # deferred: a token a request a step, up to the store's bound.
        gap += self.pending_catch_up_cost(batch * gap) / (self.PROBE_SHARE * plain)
        # Re-examined at least every few thousand steps, whatever the estimates say.
        cap = 8 * ProbeSchedule.MAX_GAP * max(self.probes.every, 1)
        return math.ceil(min(gap, cap)) if math.isfinite(gap) else cap

    def pending_catch_up_cost(self, more_tokens: float = 0.0) -> float:
        """Seconds the next drafting step spends catching the drafter up on the
        inputs off steps deferred for the batch at hand, with ``more_tokens``
        deferred on top, up to the store's bound (``deferred_drafts``); 0 until
        a catch-up has been timed or without a source of the pending count."""
        if self.catch_up_pending is None or self.catch_up_cost.coefficients() is None:
            return 0.0
        pending, bound = self.catch_up_pending()
        tokens = min(pending + more_tokens, bound)
        return float(self.catch_up_cost(tokens)) if tokens > 0 else 0.0

    def select(self, scores: torch.Tensor, max_nodes: int,
               chain: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Per-request node budgets [B] from candidate scores [B, N] (cumulative
        draft log-probs; -inf for non-candidates), maximising predicted throughput.

        ``chain`` [B, N] marks each request's greedy chain. Trees that branch pay
        ``branch_cost`` on top; chains do not. Returns the budgets and whether
        they are meant for the chain nodes only (``DynamicTreeBuilder.finish``'s
        ``chain_only``).
        """
        B = scores.shape[0]
        self._verifying_chain = self._chain_whole = self.chain_mode
        dev = scores.device
        if self.chain_mode:  # as priced: the chain, whole
            depth = min(self.last_depth, max_nodes)
            return torch.full((B,), depth, dtype=torch.long, device=dev), True
        m = min(max_nodes, scores.shape[1])
        cost = self.verify_costs(B, B + np.arange(B * m + 1))  # a step verifying k nodes
        if cost is not None:
            cost[0] = self.plain_cost(B)  # none: a plain step
        if cost is None:
            return torch.full((B,), max_nodes, dtype=torch.long, device=dev), False
        # A few dozen candidates a request: numpy, on the host, costs a fraction
        # of what the same dozen small torch ops cost every step.
        q = np.nan_to_num(np.minimum(self.kappa * np.exp(scores.float().cpu().numpy()), 1.0),
                          nan=0.0)
        tree = best_prefix(q, m, cost, max(self.branch_cost, 0.0))
        if chain is None:
            return torch.from_numpy(tree[0]).to(dev), False
        chain_pick = best_prefix(np.where(chain.cpu().numpy(), q, 0.0), m, cost, 0.0)
        if self.probing:
            # A probe verifies each request's chain down to the probed depth even
            # when the estimates say no: otherwise estimates that went wrong (say,
            # a drafter that was unlucky on its first requests) could never be
            # corrected, and speculation would stay off for good.
            depth = min(self.last_depth, max_nodes)
            self._chain_whole = True
            return torch.from_numpy(np.maximum(chain_pick[0], depth)).to(dev), True
        pick, chain_only = (chain_pick, True) if chain_pick[1] >= tree[1] else (tree, False)
        return torch.from_numpy(pick[0]).to(dev), chain_only

    def copy_threshold(self, q: np.ndarray, base_gain: float, base_nodes: int, batch: int,
                       branching: bool = False) -> tuple[float, float]:
        """The least estimate a copy node needs to be verified beside the
        drafter's selection (``base_nodes`` nodes of summed estimate
        ``base_gain - batch``), and the rate of the step that verifies them
        (tokens per second); ``branching``: copies would make chains branch,
        and pay the branching extra. Without a cost model, 0: verify them all."""
        cost = self.verify_costs(batch, batch + np.arange(base_nodes + q.size + 1))
        if cost is None:
            return 0.0, 0.0
        cost[0] = self.plain_cost(batch)  # no node at all: a plain step (as in select)
        extra = max(self.branch_cost, 0.0) if branching else 0.0
        return best_extension(q, base_gain, base_nodes, cost, extra)
