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
  from a timing sweep at startup, refined online), t_draft(d) the measured drafting
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
  proposer defers its inputs and catches its KV up when drafting resumes).
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

Pure Python/torch; the runner feeds it timings and acceptance counts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import torch

from vllm_treespec.policy.acceptance import ConditionalAcceptance
from vllm_treespec.policy.costs import LinearFit, StepCostTable
from vllm_treespec.policy.probes import ProbeSchedule
from vllm_treespec.policy.selection import best_prefix
from vllm_treespec.tree.accept import Outcome


class AdaptiveBudget:
    # While off, probes may cost at most this share of the time (their extra over
    # plain steps). At batch 1 a probe costs a tenth of a plain step and the gaps
    # above decide; at 16 requests it verifies 16 chains (served on the CPU: a
    # ~140 ms step against ~65 ms, plus the drafter's catch-up), and two probes in
    # a 128-step load cost the tree server ~3 % against plain decoding.
    PROBE_SHARE = 0.01
    RATE_PER_TREE = 0.02  # acceptance estimates: weight of one verified tree
    RATE_OFF_PROBE = 0.15  # ... of a tree verified by a probe while speculation is off
    PRIOR_TREES = 4.0     # weight of an acceptance prior, in trees
    # The branching extra: each branching step moves its estimate by at most
    # this fraction (a stalled step must not price trees out), and each chain
    # step forgets this fraction of what it says beyond the chain table (see
    # observe_step: while chains win, no branching step can correct it).
    BRANCH_STEP_CLAMP = 0.25
    BRANCH_EXTRA_DECAY = 0.01

    def __init__(self, num_nodes: int, depth: int, width: int, margin: float = 0.03,
                 probe_every: int = 32, seed: int = 0, chains: bool = True,
                 parallel: bool = False):
        self.M, self.D, self.K = num_nodes, depth, width
        self.chains = chains  # price the greedy chain too (no: a static topology)
        # Parallel drafting: all depths below the first come from one forward of
        # depth - 1 slots per request (level_cost vs B * (depth - 1)), whatever the width.
        self.parallel = parallel
        self.margin = margin
        self.probes = ProbeSchedule(probe_every)
        self.step_cost = StepCostTable()      # seconds for N verified tokens (no drafting)
        self.level_cost = LinearFit()         # seconds per drafting level vs B*width
        # One-wide levels apart: a device may run them on another kernel (the
        # CPU: stock EAGLE chain steps on the paged cache, see paged_drafts).
        self.chain_level_cost = LinearFit()   # seconds per one-wide level vs B
        self.first_pass_cost = LinearFit()    # seconds of the drafter's first pass vs tokens
        # Seconds of a drafting step besides its first pass and levels, vs batch:
        # planning, the roots' draft log-probs and top-k, the selection, the
        # hand-over. Fixed per step, so a depth-1 step (no level) pays it too.
        self.draft_overhead = LinearFit()
        self.kappa = 1.0                      # calibration of draft probabilities
        self._pred, self._obs = 1e-6, 1e-6
        # Acceptance of the trees drafted in tree mode, and of the greedy chain
        # (every verified tree holds a leading part of it; chain mode verifies
        # it whole): a depth is priced both ways, see plan_depth.
        self.tree_acceptance = ConditionalAcceptance(depth)
        self.chain_acceptance = ConditionalAcceptance(depth)
        self.chain_mode = False  # this step drafts and verifies the greedy chain alone
        self._verifying_chain = False  # the drafts being verified come from chain mode
        # ... and their greedy chains were verified whole to the planned depth
        # (chain mode, probes), not cut where the selection judged them unsure.
        self._chain_whole = False
        # nodes_at[d-1]: EWMA of nodes verified per request when d levels were
        # drafted, i.e. what ``select`` keeps at that depth; a chain until seen.
        self.nodes_at = [float(d + 1) for d in range(depth)]
        # Extra seconds of a step whose trees branch: a device whose kernel is
        # causal verifies chains with it but needs tree attention for branches
        # (large on the CPU, about 0 with a fused tree kernel). Learned online.
        self.branch_cost = 0.0
        self._branching_steps: tuple[float, float] | None = None  # EWMA (tokens, seconds)
        self.branch_at = [0.0] * depth        # EWMA: did trees drafted to depth d branch
        self._rng = random.Random(seed)
        self._steps = 0
        self.last_depth = depth
        self.probing = False  # this step explores (see plan_depth)
        self._probing_while_off = False  # the drafts being verified come from such a probe
        self._unverified = 0  # requests of the last drafting step with no drafts

    @property
    def accepted_at(self) -> list[float]:
        """P(accepted drafts >= d+1) per depth d, as a product of conditional
        acceptances: depth d+1 given d, from the trees that reached depth d, and
        a prior worth ``PRIOR_TREES`` trees (the conditional acceptance of the
        depth above carries on; depth 1's is itself, depth 0's 1/2).

        Conditionals, because depths beyond the usual one are verified only now
        and then (probes), while depth 1 is verified every step: served, on a
        turn whose text became predictable, depth-1 acceptance went from 0.55
        to 0.89 at once, but an absolute depth-2 estimate stayed at its average
        (0.07) for ~300 steps of probes, and depth-1 trees ran where stock
        chains of 2 accepted 2.1 tokens a step. As a conditional (what fraction
        of the trees that reach depth 1 reach depth 2), it moves with depth 1.
        A fixed prior of 2^-(d+1) with the weight of the whole EWMA (~50 trees)
        kept depth 2 at ~0.2 while the trees drafted there accepted 0.07."""
        return self.tree_acceptance.estimates(self.RATE_PER_TREE, self.PRIOR_TREES)

    @accepted_at.setter
    def accepted_at(self, values: list[float]) -> None:
        """As if observed for long, for trees and their chains alike."""
        self.tree_acceptance.set(values)
        self.chain_acceptance.set(values)

    @property
    def chain_accepted_at(self) -> list[float]:
        """``accepted_at`` of the greedy chain verified whole."""
        return self.chain_acceptance.estimates(self.RATE_PER_TREE, self.PRIOR_TREES)

    @chain_accepted_at.setter
    def chain_accepted_at(self, values: list[float]) -> None:
        self.chain_acceptance.set(values)

    # ---------------------------------------------------------------- observe
    def observe_step(self, num_tokens: int, seconds: float, branching: bool = False) -> None:
        """Wall time of a decode/verify step (no prefill), drafting excluded;
        ``branching``: some verified tree was not a chain."""
        if seconds <= 0 or num_tokens <= 0:
            return
        if branching:
            n, t = self._branching_steps or (num_tokens, seconds)
            c = self.BRANCH_STEP_CLAMP
            seconds = min(max(seconds, (1.0 - c) * t), (1.0 + c) * t)
            self._branching_steps = (0.8 * n + 0.2 * num_tokens, 0.8 * t + 0.2 * seconds)
        else:
            self.step_cost.add(num_tokens, seconds)
            if self._branching_steps is not None:
                # Served on the CPU (traced): two slow branching steps set the
                # extra to ~10 ms, chains won from then on, so no branching step
                # came to correct it, and depth-3 chains (10 ms of drafting,
                # 0.3 accepted) ran for two whole requests while a depth-1 tree
                # gained 12 % over them. Forgetting the excess while chains run
                # lets trees be tried again: the next ones re-measure it.
                n, t = self._branching_steps
                chain = self.step_cost(n)
                if chain is not None and t > chain:
                    t = chain + (1.0 - self.BRANCH_EXTRA_DECAY) * (t - chain)
                    self._branching_steps = (n, t)
        # The extra is re-derived from what branching steps cost against the
        # table as it is now, not frozen when they ran: the table starts at the
        # startup sweep (dummy forwards, without the sampler and the step's
        # bookkeeping) and reaches live scale only with chain steps. An extra
        # learned before that holds the common per-step overhead too, prices
        # every tree too high and would keep speculation off for good.
        if self._branching_steps is not None:
            chain = self.step_cost(self._branching_steps[0])
            if chain is not None:
                self.branch_cost = self._branching_steps[1] - chain

    def observe_draft(self, first_pass_tokens: int, first_pass_s: float, levels: int,
                      nodes_forwarded: int, levels_s: float, batch: int = 0,
                      overhead_s: float = 0.0, one_wide: bool = False) -> None:
        """A drafting step: its first pass, ``levels`` levels that forwarded
        ``nodes_forwarded`` nodes in all (batch x width, summed over levels), and
        the rest of the step's drafting work for ``batch`` requests (if given);
        ``one_wide``: every level forwarded one node per request (a chain)."""
        self.first_pass_cost.add(first_pass_tokens, first_pass_s)
        if batch > 0:
            self.draft_overhead.add(batch, max(overhead_s, 0.0))
        if levels > 0:
            fit = self.chain_level_cost if one_wide else self.level_cost
            fit.add(nodes_forwarded / levels, levels_s / levels)

    def observe_acceptance(self, accepted: Sequence[int] | Outcome, depth_used: int,
                           predicted: float) -> None:
        """accepted: accepted drafts per tree of one step, or the step's
        ``Outcome`` (a bare list: trees that are chains, none cut short);
        predicted: the sum of the (uncalibrated) probabilities of the verified
        nodes."""
        out = accepted if isinstance(accepted, Outcome) else Outcome.of_chains(accepted)
        if out.accepted:
            self._obs = 0.95 * self._obs + sum(out.accepted)
            self._pred = 0.95 * self._pred + predicted
            self.kappa = min(max(self._obs / self._pred, 0.05), 20.0)
        # Requests of the drafting step that verified nothing accepted nothing
        # (for their chains too: the selection judged even its first node hopeless).
        zeros = [0] * self._unverified
        self._unverified = 0
        # Weighted by trees, not steps: the estimate spans about 1 / RATE_PER_TREE
        # trees. At batch 1 one step is one Bernoulli outcome; a per-step EWMA of
        # 0.1 swings by +-0.23 (2 sigma) around an acceptance of 0.45, below the
        # break-even of a cheap verify, and turned speculation off on noise.
        # While speculation is off, probes are all there is to learn from, one tree
        # every 32-256 steps: at 0.02 each, an estimate that an unlucky start put
        # below break-even took minutes of probes to come back (seen served: off
        # for good after two turns whose depth-1 acceptance was 0.24-0.34, while
        # stock chains gained 14-18 % on the same turns).
        rate = self.RATE_OFF_PROBE if self._probing_while_off else self.RATE_PER_TREE
        self._probing_while_off = False
        # The chain verified whole learns its depths below the first only from
        # chains that were verified whole. A tree-mode selection cuts a chain
        # where its next node looks unsure, so the chains it lets reach depth
        # d+1 are the confident ones: traced on the CPU, chains priced from them
        # were predicted to accept 2.01 tokens a step and accepted 1.62 when
        # verified whole. Depth 1 is unbiased either way: every request that
        # verifies anything verifies its chain's first node, and the rest count
        # as zeros.
        chain_depth = depth_used if self._chain_whole else min(depth_used, 1)
        self.chain_acceptance.observe(out.chain_accepted + zeros, chain_depth, rate,
                                      censored=out.chain_censored + [False] * len(zeros))
        # Chain mode's chains say nothing of what trees accept beyond their chain.
        # Tree mode is priced as what its selection keeps (``nodes_at``), so a
        # tree the selection cut short of depth d did not accept there (read
        # as unknown, a depth the selection seldom reaches would be priced as
        # if every tree reached it).
        if not self._verifying_chain:
            self.tree_acceptance.observe(out.accepted + zeros, depth_used, rate)

    def observe_budget(self, depth: int, nodes_per_request: float,
                       branching: bool = False, unverified: int = 0) -> None:
        """Mean nodes per request that a step drafted to ``depth`` went on to verify,
        whether its trees branch, and how many of its requests the selection left
        without drafts. Those paid for drafting and will accept nothing: they
        count as zero acceptance (with the next verify step, or now if no
        request verifies anything). Otherwise ``accepted_at`` would only see the
        confident steps the selection kept, and predict a gain for drafting
        every step that most steps never get."""
        if unverified:
            if nodes_per_request == 0:
                self._unverified = 0
                self.observe_acceptance([0] * unverified, depth, 0.0)
            else:
                self._unverified = unverified
        if 1 <= depth <= self.D and not self.chain_mode:  # what tree mode keeps
            self.nodes_at[depth - 1] = 0.8 * self.nodes_at[depth - 1] + 0.2 * nodes_per_request
            self.branch_at[depth - 1] = 0.8 * self.branch_at[depth - 1] + 0.2 * branching

    # ---------------------------------------------------------------- decide
    def level_width(self, d: int) -> int:
        """Frontier nodes per request that this step, drafted to depth ``d``,
        forwards at each level: the chain's tip alone in chain mode, or while
        tree-mode selections at that depth keep chains; else the full frontier."""
        return 1 if self.chain_mode else self._tree_level_width(d)

    def _tree_level_width(self, d: int) -> int:
        if d < 1 or not self.chains:  # a static topology forwards its levels whole
            return self.K
        return 1 if self.branch_at[min(d, self.D) - 1] < 0.5 else self.K

    def predicted_ratio(self, batch: int, d: int, chain: bool = False) -> float | None:
        """Predicted throughput vs plain decoding of drafting to depth ``d``: in
        tree mode, at the size, width and branching tree-mode selections at that
        depth had; with ``chain``, the greedy chain of ``d`` nodes verified whole,
        as stock EAGLE's chain is."""
        if d == 0:
            return None if self.step_cost(batch) is None else 1.0
        ratios = self._ratios(batch)
        return None if ratios is None else float(ratios[d - 1, int(chain)])

    def _ratios(self, batch: int) -> np.ndarray | None:
        """[depth, 2] predicted ratios of every depth as a tree (column 0) and
        as a chain (column 1); one pass, since ``plan_depth`` runs every step."""
        D = self.D
        depths = np.arange(1, D + 1, dtype=np.float64)
        nodes = np.stack([np.minimum(float(self.M), np.asarray(self.nodes_at)), depths], 1)
        t = self.step_cost.costs(np.concatenate([[batch], (batch * (1 + nodes)).ravel()]))
        if t is None:
            return None
        plain, verify = t[0], t[1:].reshape(D, 2)
        # Trees pay the branching extra as often as trees drafted there branched.
        verify[:, 0] += max(self.branch_cost, 0.0) * np.asarray(self.branch_at)
        # An off step skips the drafter entirely, so a drafting step pays its
        # first pass and its fixed work as well as its levels. Served traces
        # priced a depth-1 tree 5 ms under its cycle while the fixed work was
        # left out (no level ran to carry it).
        first = self.first_pass_cost.values(batch * (1 + nodes))
        first = 0.0 if first is None else first
        wide, one = self.level_cost(batch * self.K), self.chain_level_cost(batch)
        if wide is None:  # no wide level seen yet: K tips' worth of chain levels
            wide = self.chain_level_cost(batch * self.K)
        if one is None:
            one = self.level_cost(batch)
        levels = {self.K: wide or 0.0, 1: one or 0.0}
        if self.parallel:
            slots = self.level_cost.values(batch * (depths - 1))
            slots = np.zeros(D) if slots is None else np.where(depths > 1, slots, 0.0)
            all_levels = np.stack([slots, slots], 1)
        else:
            per_level = np.array([[levels[self._tree_level_width(d)], levels[1]]
                                  for d in range(1, D + 1)])
            all_levels = per_level * (depths - 1)[:, None]
        draft = first + (self.draft_overhead(batch) or 0.0) + all_levels
        gain = 1.0 + np.cumsum(np.array([self.accepted_at, self.chain_accepted_at]).T, 0)
        return gain / (verify + draft) * plain

    def plan_depth(self, batch: int) -> int:
        """Drafting depth for this step (0 = no tree levels), and ``chain_mode``.

        Each depth is priced twice: as the tree that tree-mode selections keep
        there, and as the greedy chain verified whole. Traced on the CPU, where
        a branching verify costs 5-10 ms more than a chain of its size, pricing
        trees only planned depth 1 or 3 and a quarter of the steps off, and
        never the chain of 2 that beat it on every prompt (1.21x vs 1.12-1.19x
        plain decoding, in one process). Ties go to the tree, which sees more.
        """
        self._steps += 1
        ratios = self._ratios(batch)
        if ratios is None:  # no cost model yet: speculate fully
            self.last_depth, self.chain_mode = self.D, False
            return self.D
        best_d, best, chain_mode = 0, 1.0 + self.margin, False
        for d in range(1, self.D + 1):
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
            best_d = min(self.D, best_d + 1)
            chain_mode = self.chains and (chain_mode or best_d == 1)
        self.last_depth, self.chain_mode = best_d, chain_mode
        return best_d

    def probe_cost_gap(self, batch: int) -> int:
        """Fewest steps between probes while off such that a probe's extra cost
        (each request's first draft verified, drafted from a first pass over
        its token) stays under ``PROBE_SHARE`` of the steps' time."""
        plain, probe = self.step_cost(batch), self.step_cost(2 * batch)
        if plain is None or probe is None:
            return 0
        draft = (self.first_pass_cost(batch) or 0.0) + (self.draft_overhead(batch) or 0.0)
        gap = max(probe + draft - plain, 0.0) / (self.PROBE_SHARE * plain)
        # Re-examined at least every few thousand steps, whatever the estimates say.
        cap = 8 * ProbeSchedule.MAX_GAP * max(self.probes.every, 1)
        return math.ceil(min(gap, cap)) if math.isfinite(gap) else cap

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
        cost = self.step_cost.costs(B + np.arange(B * m + 1))  # a step verifying k nodes
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
