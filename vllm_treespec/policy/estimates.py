"""What the adaptive budget has learned (``BudgetEstimates``): step and drafting
costs, drafter calibration, acceptance by depth, and what its selections keep.

The runner and the proposer feed these through the ``observe_*`` methods;
``AdaptiveBudget`` (``budget``) decides from them. The flags of the step in
flight (``chain_mode``, ``probing``, ...) live here too: they say how a step's
outcome is to be read. Pure Python and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_treespec.policy.acceptance import ConditionalAcceptance
from vllm_treespec.policy.costs import LinearFit, StepCostTable
from vllm_treespec.tree.accept import Outcome


class BudgetEstimates:
    RATE_PER_TREE = 0.02  # acceptance estimates: weight of one verified tree
    RATE_OFF_PROBE = 0.15  # ... of a tree verified by a probe while speculation is off
    PRIOR_TREES = 4.0     # weight of an acceptance prior, in trees
    KAPPA_PRIOR = 2.0     # weight of kappa's prior (1), in accepted drafts
    # The branching extra: each branching step moves its estimate by at most
    # this fraction (a stalled step must not price trees out), and each chain
    # step forgets this fraction of what it says beyond the chain table (see
    # observe_step: while chains win, no branching step can correct it).
    BRANCH_STEP_CLAMP = 0.25
    BRANCH_EXTRA_DECAY = 0.01

    def __init__(self, num_nodes: int, depth: int, width: int):
        self.max_nodes, self.max_depth, self.width = num_nodes, depth, width
        # Seconds for N verified tokens: forward and the step's own work, neither
        # drafting nor sampling.
        self.step_cost = StepCostTable()
        # Sampling, apart: vLLM's sampler on a plain step (vs its tokens, one a
        # request) and the tree sampler with its acceptance (vs verified tokens).
        # Under a mix of sampled requests (top-p, penalties, n > 1) accepting
        # trees cost 13-62 % of the verify forward, a plain step's sampler far
        # less; in the table, that difference went into the shift every step
        # pays, plain or not, and was never priced (issue 83).
        self.plain_sample_cost = LinearFit()
        self.tree_sample_cost = LinearFit()
        # Catching the drafter up on the inputs off steps deferred, vs tokens: a
        # drafting step after a long off stretch pays it (served under load, up
        # to 400 ms a step), and a probe from off is such a step.
        self.catch_up_cost = LinearFit()
        # () -> (deferred drafter inputs of the batch at hand, their bound); set
        # by the proposer, read only when a probe from off is priced.
        self.catch_up_pending = None
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
        # Its sums start from a prior of KAPPA_PRIOR accepted drafts as predicted:
        # from zero, a first step that accepted none of its drafts set kappa to
        # its floor at once (served, a fresh engine's first step: 0 of 5 accepted).
        self._pred = self._obs = self.KAPPA_PRIOR
        self._draft_steps = 0
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
        # levels_at[d-1]: EWMA of the levels tree-mode steps planned at depth d
        # ran (level_pays stops some early); d - 1 until seen.
        self.levels_at = [float(d) for d in range(depth)]
        # Extra seconds of a step whose trees branch: a device whose kernel is
        # causal verifies chains with it but needs tree attention for branches
        # (large on the CPU, about 0 with a fused tree kernel). Learned online.
        self.branch_cost = 0.0
        self._branching_steps: tuple[float, float] | None = None  # EWMA (tokens, seconds)
        self.branch_at = [0.0] * depth        # EWMA: did trees drafted to depth d branch
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
        """Wall time of a decode/verify step (no prefill), drafting and sampling
        excluded (``observe_sampling``); ``branching``: some verified tree was not
        a chain."""
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
                # Traced on the CPU: two slow branching steps raised the extra,
                # chains won from then on, so no branching step came to correct
                # it, and deep chains that drafted dearly and accepted little ran
                # where shallow trees had gained more (benchmarks/history/
                # RESULTS-history.md, "Latest (2026-11-25, evening): what the
                # prompts' format does, and a branching extra that locked trees
                # out"). Forgetting the excess while chains run lets trees be
                # tried again: the next ones re-measure it.
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

    def observe_sampling(self, num_tokens: int, seconds: float, tree: bool) -> None:
        """Wall time of a decode/verify step's sampling (``observe_step``'s
        seconds exclude it): the tree sampler's, acceptance included, or vLLM's
        sampler on a step without trees."""
        if num_tokens > 0 and seconds >= 0:
            fit = self.tree_sample_cost if tree else self.plain_sample_cost
            # At most twice the prediction a sample: one stalled sampler call
            # (a busy core) must not price a side up for the next ~30 steps; a
            # real change (the batch turning to top-p sampling) still gets in
            # within a few steps.
            predicted = fit(num_tokens)
            fit.add(num_tokens, seconds if predicted is None else min(seconds, 2 * predicted))

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A drafting step forwarded ``tokens`` deferred drafter inputs."""
        if tokens > 0 and seconds >= 0:
            self.catch_up_cost.add(tokens, seconds)

    def sampling_costs(self, batch: int, n: np.ndarray) -> tuple[float, np.ndarray]:
        """Sampling seconds of a plain step of ``batch`` requests, and of verify
        steps of ``n`` tokens each; 0 for both until both have been seen (one
        without the other would price one side only)."""
        plain, tree = self.plain_sample_cost(batch), self.tree_sample_cost.values(n)
        if plain is None or tree is None:
            return 0.0, np.zeros(np.shape(n))
        return plain, tree

    def plain_cost(self, batch: int) -> float | None:
        """Seconds of a plain step: the table at ``batch`` and its sampling."""
        t = self.step_cost(batch)
        return None if t is None else t + self.sampling_costs(batch, np.zeros(0))[0]

    def verify_costs(self, batch: int, n: np.ndarray) -> np.ndarray | None:
        """Seconds of verify steps of ``n`` tokens for ``batch`` requests
        (drafting excluded): the table and the tree sampler."""
        t = self.step_cost.costs(n)
        return None if t is None else t + self.sampling_costs(batch, n)[1]

    def observe_draft(self, first_pass_tokens: int, first_pass_s: float, levels: int,
                      nodes_forwarded: int, levels_s: float, batch: int = 0,
                      overhead_s: float = 0.0, one_wide: bool = False) -> None:
        """A drafting step: its first pass, ``levels`` levels that forwarded
        ``nodes_forwarded`` nodes in all (batch x width, summed over levels), and
        the rest of the step's drafting work for ``batch`` requests (if given);
        ``one_wide``: every level forwarded one node per request (a chain).

        A fresh engine's first drafting step is not learned from: it pays
        one-time work (served, its "fixed work" is many times a later step's;
        benchmarks/history/RESULTS-history.md, "A stop rule priced by live
        engine cycles: faster in one process, slower served, withdrawn; a fresh
        engine no longer starts with speculation off (2026-11-28, morning)"),
        and a drafting cost fit from one sample is that sample: with kappa at
        its floor, it priced speculation out and spaced the probes that could
        correct it hundreds of steps apart."""
        self._draft_steps += 1
        if self._draft_steps == 1:
            return
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
        off_probe = self._probing_while_off
        rate = self.RATE_OFF_PROBE if off_probe else self.RATE_PER_TREE
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
        elif off_probe:
            # While off, probes (chains) are all that is verified, and a tree's
            # depth-1 estimate would keep whatever the last trees left: with a
            # drafter that was never right, the prior's 0.16 after one tree step,
            # for good, which kept depth-1 trees priced above plain where a
            # verified token is cheap (issue 83's adaptive test, recorded). The
            # chain's first node is the best child a tree verifies at depth 1,
            # so its outcome is a lower bound there: learned as such.
            self.tree_acceptance.observe(out.chain_accepted + zeros, 1, rate,
                                         censored=out.chain_censored + [False] * len(zeros))

    def observe_budget(self, depth: int, nodes_per_request: float,
                       branching: bool = False, unverified: int = 0,
                       levels: int | None = None) -> None:
        """Mean nodes per request that a step drafted to ``depth`` went on to verify,
        whether its trees branch, and how many of its requests the selection left
        without drafts. Those paid for drafting and will accept nothing: they
        count as zero acceptance (with the next verify step, or now if no
        request verifies anything). Otherwise ``accepted_at`` would only see the
        confident steps the selection kept, and predict a gain for drafting
        every step that most steps never get. ``levels``: drafting levels the
        step ran (see ``level_pays``)."""
        if unverified:
            if nodes_per_request == 0:
                self._unverified = 0
                self.observe_acceptance([0] * unverified, depth, 0.0)
            else:
                self._unverified = unverified
        if 1 <= depth <= self.max_depth and not self.chain_mode:  # what tree mode keeps
            self.nodes_at[depth - 1] = 0.8 * self.nodes_at[depth - 1] + 0.2 * nodes_per_request
            self.branch_at[depth - 1] = 0.8 * self.branch_at[depth - 1] + 0.2 * branching
            # Probes draft their whole depth (they explore it): what planned steps
            # at that depth would run is what they do not show.
            if levels is not None and not self.probing:
                self.levels_at[depth - 1] = 0.8 * self.levels_at[depth - 1] + 0.2 * levels
