"""Adaptive speculation budget: cost model fit, depth decisions, batch-wide node selection."""

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_treespec.policy import AdaptiveBudget, LinearFit, StepCostTable
from vllm_treespec.policy.probes import ProbeSchedule
from vllm_treespec.tree import Outcome


def test_linear_fit_recovers_cost_and_handles_one_size():
    rng = random.Random(0)
    fit = LinearFit()
    for _ in range(300):  # drafting levels of varying width, noisy
        n = rng.choice((1, 2, 4, 8, 16, 32, 64))
        fit.add(n, 0.040 + 0.001 * n + rng.gauss(0, 0.002))
    a, b = fit.coefficients()
    assert a == pytest.approx(0.040, abs=0.004)
    assert b == pytest.approx(0.001, rel=0.15)
    assert LinearFit().coefficients() is None
    one_size = LinearFit()
    for _ in range(5):
        one_size.add(8, 0.003)
    assert one_size(8) == pytest.approx(0.003) and one_size.coefficients()[1] == 0.0


def test_a_fit_from_a_narrow_range_never_prices_smaller_x_below_zero_cost():
    """Drafting seen at batches 7 and 8 only, noisily: the straight line through
    them is steep, and extrapolated to batch 3 it read zero (issue 83's adaptive
    test priced a depth-1 draft at 2 microseconds). A line that would cross
    zero above x = 0 goes through the origin instead."""
    fit = LinearFit()
    for _ in range(20):
        fit.add(8, 0.0080)
        fit.add(7, 0.0050)
    a, b = fit.coefficients()
    assert a == 0.0 and b == pytest.approx((0.008 * 8 + 0.005 * 7) / (64 + 49), rel=0.01)
    assert fit(3) > 0.001


def test_step_cost_table_interpolates_extrapolates_and_learns():
    """The CPU's shape: 1-4 tokens cost about the same, then cost grows."""
    table = StepCostTable()
    assert table(3) is None
    for n, t in ((1, 0.028), (4, 0.030), (16, 0.050), (64, 0.130)):
        table.set_knot(n, t)
    assert table(2) == pytest.approx(0.028 + 0.002 / 3)
    assert table(1) == pytest.approx(0.028) and table(0.5) == pytest.approx(0.028)
    assert table(128) == pytest.approx(0.130 + 64 * 0.080 / 48)  # last segment extended
    # Live steps take 8 ms more than the sweep's forwards (the step's own work):
    # the whole table follows, and a verified token costs what the sweep said.
    for _ in range(200):
        table.add(2, table_value(2) + 0.008)
    assert table(2) == pytest.approx(table_value(2) + 0.008, rel=0.01)
    assert table(64) == pytest.approx(0.130 + 0.008, rel=0.02)
    assert table(16) - table(4) == pytest.approx(0.050 - 0.030, rel=0.05)  # slope kept
    before = table(16)
    table.add(16, 100.0)  # one stalled step moves the table by at most 10 % (+2 % locally)
    assert table(16) < 1.13 * before
    table.add(1000, 1.0)  # outside: a new knot
    assert table(1000) == pytest.approx(1.0)


def test_a_knot_timed_in_a_stall_is_lowered_to_the_cheapest_above_it():
    table = StepCostTable()
    for n, t in ((1, 0.0154), (2, 0.0150), (4, 0.0137), (16, 0.0196), (64, 0.0492)):
        table.set_knot(n, t)
    table.finish_sweep()
    assert table.t == pytest.approx([0.0137, 0.0137, 0.0137, 0.0196, 0.0492])


def test_live_steps_at_the_plain_step_never_price_more_tokens_below_fewer():
    """Issue 83's pattern: while speculation is off, every live step lands on the
    plain step's knot (N = batch) and takes the sweep's forward plus the step's
    own work. That work is paid at every N, so the knots above follow: a second
    token per request costs at least what the sweep timed (before, after 500
    such steps, t(12) fell 0.4 ms below t(8))."""
    table = StepCostTable()
    for n, t in ((8, 0.0300), (12, 0.0305), (16, 0.0310)):
        table.set_knot(n, t)
    table.finish_sweep()
    for _ in range(500):
        table.add(8, 0.036)
    assert table(8) == pytest.approx(0.036, rel=0.01)
    assert table(12) - table(8) >= 0.0005 - 1e-12
    assert table(16) - table(12) >= 0.0005 - 1e-12
    # ... and steps cheaper than the table at 16 lower the knots below them.
    for _ in range(500):
        table.add(16, 0.020)
    assert table(16) == pytest.approx(0.020, rel=0.01)
    assert table(12) <= 0.0195 + 1e-12 and table(8) <= 0.0190 + 1e-12


@given(st.lists(st.tuples(st.sampled_from((1, 2, 4, 8, 12, 16, 32, 64)), st.floats(1e-3, 0.1)),
                min_size=2, max_size=8),
       st.lists(st.tuples(st.floats(1.0, 128.0), st.floats(1e-3, 0.2)), max_size=60))
def test_the_table_stays_nondecreasing_through_any_live_steps(sweep, live):
    """Whatever the sweep timed and whatever live steps take, the table never
    prices more tokens below fewer, and inside the sweep each segment rises at
    least as the (stall-corrected) sweep did."""
    table = StepCostTable()
    for n, t in sweep:
        table.set_knot(n, t)
    table.finish_sweep()
    swept = dict(zip(table.n, table.t))
    for n, t in live:
        table.add(n, t)
        assert all(b >= a - 1e-12 for a, b in zip(table.t, table.t[1:])), (table.n, table.t)
    knots = sorted(swept)
    for a, b in zip(knots, knots[1:]):
        if table(a) > 2e-6:  # not clamped at the floor
            assert table(b) - table(a) >= swept[b] - swept[a] - 1e-9, (a, b, table.t)


@given(st.lists(st.tuples(st.integers(1, 512), st.floats(1e-4, 1.0)), min_size=1, max_size=12),
       st.lists(st.floats(0.0, 1024.0), min_size=1, max_size=20))
def test_step_cost_of_one_n_equals_the_vectorised_costs(knots, queries):
    """The scalar lookup (plain Python, read several times a step) is the
    vectorised table's value, inside the knots, at them and beyond either end."""
    table = StepCostTable()
    for n, t in knots:
        table.set_knot(n, t)
    expected = table.costs(np.array(queries))
    assert [table(q) for q in queries] == pytest.approx(expected.tolist(), rel=1e-9, abs=1e-12)


def test_linear_fit_values_follow_every_sample():
    """The fit is kept with the sums it was made from (no stale coefficients)."""
    fit = LinearFit()
    assert fit.values(np.array([1.0])) is None
    fit.add(1, 0.010)
    fit.add(3, 0.030)
    assert fit.values(np.array([2.0, 4.0])).tolist() == pytest.approx([0.020, 0.040])
    fit.add(5, 0.090)  # a steeper point moves the line at once
    assert fit(5) > 0.050 and fit.values(np.array([5.0]))[0] == pytest.approx(fit(5))


def table_value(n):
    return float(np.interp(n, (1, 4, 16, 64), (0.028, 0.030, 0.050, 0.130)))


def policy(base=0.040, per_token=0.001, accept=(0.8, 0.6, 0.45, 0.3, 0.2, 0.1)):
    p = AdaptiveBudget(num_nodes=32, depth=6, width=8, probe_every=0)
    for n in (1, 4, 16, 64, 256):
        p.step_cost.set_knot(n, base + per_token * n)
    p.accepted_at = list(accept)
    return p


def test_deep_trees_when_verification_is_cheap_and_none_when_it_is_not():
    cheap = policy(per_token=0.0001)
    assert cheap.plan_depth(1) >= 4
    costly = policy(per_token=0.01)
    assert costly.plan_depth(32) == 0
    # Same costs, growing batch: speculation shrinks monotonically, then stops.
    p = policy(per_token=0.001)
    depths = [p.plan_depth(b) for b in (1, 4, 16, 64, 256)]
    assert depths == sorted(depths, reverse=True) and depths[0] > 0 and depths[-1] == 0


def test_a_verify_steps_sampling_is_priced_against_a_plain_steps():
    """Issue 83: sampled trees (top-p, penalties) cost far more to accept than a
    plain step costs to sample. Live, the step's sampling is timed apart; at 16
    requests, a batch that gains from verifying when sampling costs the same both
    ways stops speculating when the tree sampler costs 4 ms a verified token
    and a plain step's sampler 1 ms a request, and a selection made then keeps
    fewer nodes."""
    def with_sampling(tree_per_token):
        p = policy(base=0.030, per_token=0.0002, accept=(0.6, 0.3, 0.15, 0.05, 0.02, 0.0))
        for n in (16, 32, 48, 64):
            p.observe_sampling(n, 0.001 * 16 if n == 16 else tree_per_token * n, tree=n > 16)
        p.observe_sampling(16, 0.016, tree=False)
        return p

    def kept(p):
        scores = torch.log(torch.tensor([[0.6, 0.3, 0.15, 0.05]] * 16))
        return int(p.select(scores, 4)[0].sum())

    free, dear = with_sampling(0.001), with_sampling(0.004)
    assert free.plan_depth(16) > 0
    assert dear.plan_depth(16) == 0
    assert dear.plain_cost(16) == pytest.approx(0.030 + 0.0002 * 16 + 0.016)
    assert kept(dear) < kept(free)
    # Seen on one side only, sampling is priced on neither.
    one_side = policy()
    one_side.observe_sampling(32, 1.0, tree=True)
    assert one_side.plain_cost(16) == pytest.approx(0.040 + 0.001 * 16)
    assert one_side.verify_costs(16, np.array([32.0]))[0] == pytest.approx(0.040 + 0.001 * 32)


@pytest.mark.parametrize("chains", [True, False])  # False: trees priced alone (control)
def test_depth_is_costed_by_the_trees_selection_keeps(chains):
    """Trees trimmed to chains are cheap to verify; wide ones at the same depth are not.
    The CPU case: a 28 ms step, ~1.6 ms per extra token, a weak drafter. Once
    tree-mode selections keep wide trees, the greedy chain, priced apart, still pays."""
    p = policy(base=0.028, per_token=0.0016, accept=(0.36, 0.13, 0.05, 0.02, 0.01, 0.0))
    p.chains = chains
    assert p.plan_depth(1) in (1, 2) and not p.chain_mode  # a tree trimmed to a chain
    for d in range(1, 7):
        for _ in range(30):
            p.observe_budget(d, 8.0 * d)  # the selection kept wide trees
    assert p.nodes_at[0] == pytest.approx(8.0, rel=0.01)
    if chains:
        assert p.plan_depth(1) in (1, 2) and p.chain_mode and p.level_width(2) == 1
    else:
        assert p.plan_depth(1) == 0


def test_useless_drafter_turns_speculation_off():
    p = policy(accept=(0.0,) * 6)
    assert p.plan_depth(1) == 0


def test_probes_explore_one_level_deeper_even_when_off():
    p = policy(accept=(0.0,) * 6)
    p.probes.every = 5
    planned = [p.plan_depth(1) for _ in range(200)]
    # While off, each probe doubles the gap to the next, up to 8 x probe_every.
    assert [i + 1 for i, d in enumerate(planned) if d] == [5, 15, 35, 75, 115, 155, 195]
    assert set(planned) == {0, 1}
    cheap = policy(per_token=0.0001, accept=(0.8, 0.6, 0.0, 0.0, 0.0, 0.0))
    cheap.probes.every = 3
    planned = [cheap.plan_depth(1) for _ in range(3)]
    assert planned[2] == planned[0] + 1 and planned[0] == planned[1] > 0


def test_probes_come_every_probe_every_steps_again_once_speculation_pays():
    p = policy(accept=(0.0,) * 6)
    p.probes.every = 4
    for _ in range(60):  # off: the gap has grown to 32
        p.plan_depth(1)
    assert p.probes.gap == 32
    p.accepted_at = [0.8, 0.6, 0.0, 0.0, 0.0, 0.0]  # the drafter got good (to depth 2)
    depths = [p.plan_depth(1) for _ in range(12)]
    assert min(depths) > 0
    probes = [i for i in range(1, 12) if depths[i] > depths[i - 1]]
    assert len(probes) >= 2 and p.probes.gap == 4


def probe_steps(p, batch, steps):
    return [n for n in range(1, steps + 1) if p.plan_depth(batch) > 0]


def test_probes_while_off_cost_at_most_their_share_of_the_time():
    """At 16 requests a probe verifies 16 chains: here 1.5 plain steps of extra
    (served on the CPU, ~3 % of a 128-step load went to two probes). While off,
    probes keep their extra under PROBE_SHARE of the time at every point; at
    batch 1, where a probe is cheap, the usual gaps decide."""
    p = policy(per_token=0.003, accept=(0.0,) * 6)
    p.probes.every = 32
    plain, extra = p.step_cost(16), p.step_cost(32) - p.step_cost(16)
    probes = probe_steps(p, 16, 600)
    assert probes, "still re-examined"
    for k, n in enumerate(probes, 1):
        assert k * extra <= p.PROBE_SHARE * n * plain * 1.02, (k, n, probes)
    one = policy(per_token=0.003, accept=(0.0,) * 6)
    one.probes.every = 32
    assert probe_steps(one, 1, 600)[:3] == [32, 96, 224]
    # Speculating again before a postponed probe: probes every probe_every steps.
    back = policy(per_token=0.003, accept=(0.0,) * 6)
    back.probes.every = 32
    back.draft_overhead.add(16, 0.5)  # drafting priced dear: the next probe ~600 steps away
    assert probe_steps(back, 16, 40) == []
    back.draft_overhead = LinearFit()
    back.accepted_at = [0.9, 0.8, 0.0, 0.0, 0.0, 0.0]
    depths = [back.plan_depth(16) for _ in range(33)]
    assert min(depths) > 0 and max(depths) > min(depths), depths
    # Negative control: without the share, the doubling gaps alone overspend at 16.
    free = policy(per_token=0.003, accept=(0.0,) * 6)
    free.probes.every, free.PROBE_SHARE = 32, 1e9
    assert any(k * extra > p.PROBE_SHARE * n * plain
               for k, n in enumerate(probe_steps(free, 16, 600), 1))


def test_a_probe_from_off_is_priced_with_the_drafter_catch_up_it_pays():
    """A probe after an off stretch first catches the drafter up on what the
    off steps deferred (one token a request a step, up to the store's bound):
    served at 64 requests, drafting steps took 100-400 ms, mostly that. Priced,
    probes come further apart, and further still the more is pending."""
    def first_probe(pending, bound):
        p = policy(per_token=0.003, accept=(0.0,) * 6)
        p.probes.every = 32
        if pending is not None:
            for n in (256, 1024, 2048):
                p.observe_catch_up(n, 0.0001 * n)  # 0.1 ms a token
            p.catch_up_pending = lambda: (pending, bound)
        return probe_steps(p, 16, 3000)[0]

    unpriced, light, heavy = first_probe(None, 0), first_probe(0, 64), first_probe(2048, 4096)
    assert unpriced < light < heavy


def test_the_first_step_after_off_steps_is_priced_with_the_catch_up_it_pays():
    """Drafting after off steps first catches the drafter up on what they
    deferred; a plain step would not (served under load, such steps drafted
    about as long as a plain step took). A tree that pays on its own stays off
    while much is pending, and turns on where little is (after a probe caught
    up, or while speculating, where nothing is)."""
    def plan(pending):
        p = policy(per_token=0.001)
        if pending is not None:
            for n in (256, 1024, 2048):
                p.observe_catch_up(n, 0.0001 * n)  # 0.1 ms a token
            p.catch_up_pending = lambda: (pending, 4096)
        return p.predicted_ratio(16, 2), p.plan_depth(16)

    (unpriced, on), (nothing, on_again) = plan(None), plan(0)
    assert on > 0 and on_again == on and nothing == pytest.approx(unpriced)
    (a_step, still_on), (much, off) = plan(16), plan(2048)
    assert still_on > 0 and off == 0
    assert unpriced > a_step > much
    # The bound caps what is priced: the store never holds more.
    assert plan(10**6)[0] == pytest.approx(plan(4096)[0])


def test_probes_while_off_bring_a_stale_tree_estimate_down_at_depth_one():
    """One tree step of 8 trees that accepted nothing leaves the tree estimate
    at depth 1 near its prior (0.16); while off only chains are verified (the
    probes). Their first nodes accept nothing either, and the tree estimate
    follows them down: before, it stayed at 0.16 for good, and where a verified
    token is nearly free a depth-1 tree was priced above plain (issue 83)."""
    p = AdaptiveBudget(num_nodes=16, depth=6, width=4, probe_every=0)
    p._verifying_chain = p._chain_whole = False
    p.observe_acceptance([0] * 8, 1, 0.0)
    assert 0.1 < p.accepted_at[0] < 0.2
    for _ in range(4):  # four probes from off, 8 chains each
        p._probing_while_off, p._verifying_chain, p._chain_whole = True, True, True
        p.observe_acceptance([0] * 8, 1, 0.0)
    assert p.accepted_at[0] < 0.01 and p.chain_accepted_at[0] < 0.01
    # Chain mode while on (not a probe from off) leaves the tree estimate alone.
    on = AdaptiveBudget(num_nodes=16, depth=6, width=4, probe_every=0)
    on.observe_acceptance([0] * 8, 1, 0.0)
    before = on.accepted_at[0]
    on._verifying_chain = on._chain_whole = True
    on.observe_acceptance([0] * 8, 1, 0.0)
    assert on.accepted_at[0] == before


def test_a_probe_verifies_the_chain_even_when_estimates_say_no():
    """Estimates gone wrong (kappa at its floor after an unlucky start) must be
    correctable: probe steps verify each request's chain to the probed depth."""
    p = policy(accept=(0.0,) * 6)
    p.kappa, p.probes.every = 0.05, 4
    scores = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.6, 0.1, 0.05, 0.01]]))
    chain = torch.tensor([[True, False, True, False], [True, False, False, True]])
    depths, picks = [], []
    for _ in range(4):
        depths.append(p.plan_depth(1))
        picks.append(p.select(scores, 4, chain))
    assert depths == [0, 0, 0, 1]
    budgets, chain_only = picks[-1]
    assert chain_only and budgets.tolist() == [1, 1]


def test_acceptance_observations_calibrate_and_update_rates():
    p = policy()
    # Depth d+1 learns from the trees that reached depth d: one a step at depth 4.
    for _ in range(200):
        p.observe_acceptance([3, 0, 1, 2], depth_used=6, predicted=12.0)
    assert p.kappa == pytest.approx(0.5, rel=0.05)
    assert p.accepted_at[0] == pytest.approx(0.75, abs=0.02)
    assert p.accepted_at[3] == pytest.approx(0.0, abs=0.02)


def test_a_fresh_engines_first_drafting_step_does_not_turn_speculation_off():
    """Served, a fresh engine's first step drafted 5 nodes, accepted none and
    timed 40 ms of one-time drafting work: kappa fell to its floor, drafting
    was priced at that sample, and speculation stayed off for turns."""
    p = policy(base=0.025, per_token=0.0003)
    assert p.plan_depth(1) > 0
    p.observe_budget(p.last_depth, 5.0)
    p.observe_draft(1, 0.003, levels=4, nodes_forwarded=4, levels_s=0.020, batch=1,
                    overhead_s=0.040, one_wide=True)
    p.observe_acceptance([0], depth_used=p.last_depth, predicted=2.0)
    assert p.kappa > 0.4 and p.draft_overhead(1) is None
    assert p.plan_depth(1) > 0
    # The steps after it are learned from.
    p.observe_draft(1, 0.003, levels=2, nodes_forwarded=2, levels_s=0.004, batch=1,
                    overhead_s=0.002, one_wide=True)
    assert p.draft_overhead(1) == pytest.approx(0.002)


def test_select_keeps_the_best_nodes_batch_wide():
    p = policy(per_token=0.001)
    gen = torch.Generator().manual_seed(0)
    # Request 0 has confident drafts, request 1 hopeless ones.
    good = torch.log(torch.linspace(0.9, 0.3, 20))
    bad = torch.log(torch.full((20,), 1e-4))
    budgets, _ = p.select(torch.stack([good, bad]), max_nodes=16)
    assert budgets[0] > 0 and budgets[1] == 0
    # Free verification: everything up to the cap; prohibitive: nothing.
    costly = policy(per_token=10.0)
    assert costly.select(torch.stack([good, bad]), max_nodes=16)[0].tolist() == [0, 0]
    free = policy(per_token=0.0)
    assert free.select(torch.log(torch.rand(3, 40, generator=gen)), 16)[0].tolist() == [16] * 3
    assert policy(per_token=10.0).select(torch.stack([good, good]), 16)[0].tolist() == [0, 0]


def test_branch_cost_is_learned_and_makes_chains_win():
    p = policy(base=0.028, per_token=0.0016)
    # Steps with branching trees take 8 ms more than the fit predicts for their size.
    for _ in range(40):
        p.observe_step(4, 0.028 + 0.0016 * 4 + 0.008, branching=True)
        p.observe_step(1, 0.028 + 0.0016)
    assert p.branch_cost == pytest.approx(0.008, abs=0.001)
    # Two confident siblings at depth 1 and a chain below the first one.
    scores = torch.log(torch.tensor([[0.6, 0.5, 0.4, 0.1]]))
    chain = torch.tensor([[True, False, True, False]])
    budgets, chain_only = p.select(scores, 4, chain)
    assert chain_only and budgets.tolist() == [2]
    p.branch_cost = 0.0  # a fused tree kernel: branching is free, the tree wins
    budgets, chain_only = p.select(scores, 4, chain)
    assert not chain_only and budgets.tolist() == [3]
    # The depth plan counts the extra for depths whose trees branched.
    p.branch_cost = 0.05
    p.observe_budget(1, 2.0, branching=True)
    assert p.branch_at[0] == pytest.approx(0.2)


def test_the_branching_extra_follows_the_table_to_live_scale():
    """Branching steps first, measured against the startup sweep; live steps
    cost the sweep + 5 ms of per-step work (sampler, bookkeeping) + 2.5 ms of
    tree attention. The common 5 ms is not a branching extra: once chain steps
    bring the table to live scale, it leaves the extra, and a tree that pays (depth 1, 4
    nodes, 0.55 accepted: 1.55 tokens for 23.5 vs 20.8 ms) is planned again."""
    p = AdaptiveBudget(num_nodes=4, depth=1, width=4, probe_every=0)
    for n, t in {1: 0.0158, 4: 0.0153, 16: 0.0203, 64: 0.0481}.items():
        p.step_cost.set_knot(n, t)
    p.accepted_at = [0.55]
    for _ in range(100):
        p.observe_budget(1, 4.0, branching=True)
        p.observe_step(5, 0.0160 + 0.005 + 0.0025, branching=True)
    assert p.branch_cost == pytest.approx(0.0075, abs=0.0005)  # all it can know yet
    for _ in range(60):  # off steps or chains: plain steps at live cost
        p.observe_step(1, 0.0158 + 0.005)
    assert p.step_cost(1) == pytest.approx(0.0208, abs=0.001)
    # The 5 ms left the extra, and the tree attention's 2.5 ms fades while only
    # chains run (nothing re-measures it): the prediction errs toward trying the
    # tree again, not away from it.
    assert 0.0 < p.branch_cost < 0.0025
    true_ratio = 1.55 * 0.0208 / 0.0235
    assert true_ratio * 0.92 <= p.predicted_ratio(1, 1) <= 1.55 * 1.02
    assert p.plan_depth(1) == 1


def _branching_policy(extra: float) -> AdaptiveBudget:
    p = policy(base=0.028, per_token=0.0016)
    for _ in range(40):
        p.observe_step(5, 0.028 + 0.0016 * 5 + extra, branching=True)
    return p


@pytest.mark.parametrize("clamp, bound", [(AdaptiveBudget.BRANCH_STEP_CLAMP, (0.0, 0.006)),
                                          (100.0, (0.012, 1.0))])  # control: unclamped
def test_two_stalled_branching_steps_do_not_price_trees_out(monkeypatch, clamp, bound):
    monkeypatch.setattr(AdaptiveBudget, "BRANCH_STEP_CLAMP", clamp)
    p = _branching_policy(0.002)
    assert p.branch_cost == pytest.approx(0.002, abs=0.0005)
    for _ in range(2):  # a page-fault storm, a pause: 3x the usual step
        p.observe_step(5, 3 * (0.028 + 0.0016 * 5 + 0.002), branching=True)
    assert bound[0] < p.branch_cost < bound[1]


@pytest.mark.parametrize("decay, bound", [(AdaptiveBudget.BRANCH_EXTRA_DECAY, (0.0, 0.0015)),
                                          (0.0, (0.009, 0.011))])  # control: no decay
def test_a_high_branching_extra_fades_while_chains_run(monkeypatch, decay, bound):
    """Seen served: an extra of ~10 ms kept trees out for two whole requests,
    since only a branching step could correct it and chains won every step."""
    monkeypatch.setattr(AdaptiveBudget, "BRANCH_EXTRA_DECAY", decay)
    p = _branching_policy(0.010)
    assert p.branch_cost == pytest.approx(0.010, abs=0.0005)
    for _ in range(200):
        p.observe_step(2, 0.028 + 0.0016 * 2)
    assert bound[0] < p.branch_cost < bound[1]


def test_selected_nodes_are_each_requests_best():
    """The batch-wide cut is a per-request top-n by score: with the dynamic
    builder's strictly decreasing scores, that set is ancestor-closed."""
    p = policy(per_token=0.002)
    gen = torch.Generator().manual_seed(1)
    scores = torch.log(torch.rand(4, 30, generator=gen))
    budgets, _ = p.select(scores, 24)
    q = torch.exp(scores)
    kept = [set(torch.topk(q[b], int(budgets[b])).indices.tolist()) for b in range(4)]
    threshold = min(min(q[b, list(k)].tolist()) for b, k in enumerate(kept) if k)
    for b in range(4):
        dropped = set(range(30)) - kept[b]
        assert all(q[b, i] <= threshold for i in dropped)


def test_levels_are_one_wide_while_selections_keep_chains():
    p = policy()
    assert [p.level_width(d) for d in range(1, 7)] == [1] * 6  # chains until trees branch
    for _ in range(10):
        p.observe_budget(3, 6.0, branching=True)
    assert p.level_width(3) == 8 and p.level_width(2) == 1
    # The level cost is fitted per forwarded node (one-wide levels reported as such
    # go to their own fit, see the next test).
    for _ in range(20):
        p.observe_draft(1, 0.001, levels=2, nodes_forwarded=2, levels_s=0.004)
        p.observe_draft(1, 0.001, levels=2, nodes_forwarded=16, levels_s=0.018)
    assert p.level_cost(1) == pytest.approx(0.002, rel=0.05)
    assert p.level_cost(8) == pytest.approx(0.009, rel=0.05)


def test_one_wide_levels_are_costed_apart_from_wide_ones():
    """The CPU runs one-wide levels as stock chain steps on the native kernel and
    wide ones on the side buffer: two kernels, two fits. Pooled, a run of chain
    steps (every sample at one node per request) would price a wide level like a
    chain level and favour trees until a wide step came to correct it."""
    pooled, apart = policy(), policy()
    for _ in range(20):
        pooled.observe_draft(1, 0.001, levels=2, nodes_forwarded=2, levels_s=0.002)
        apart.observe_draft(1, 0.001, levels=2, nodes_forwarded=2, levels_s=0.002,
                            one_wide=True)
        for p in (pooled, apart):
            p.observe_draft(1, 0.001, levels=2, nodes_forwarded=16, levels_s=0.018)
    assert apart.chain_level_cost(1) == pytest.approx(0.001, rel=0.05)
    assert apart.level_cost(8) == pytest.approx(0.009, rel=0.05)
    for p in (pooled, apart):  # a batch of 8: eight tips against one 8-wide frontier
        for _ in range(20):
            p.observe_draft(8, 0.001, levels=2, nodes_forwarded=16, levels_s=0.004,
                            one_wide=p is apart)
    # Negative control: pooled, the batch of 8 tips reads as one 8-wide frontier.
    assert pooled.level_cost(8) < 0.006
    assert apart.level_cost(8) == pytest.approx(0.009, rel=0.05)
    assert apart.chain_level_cost(8) == pytest.approx(0.002, rel=0.05)
    # And pricing uses both: a depth-3 tree whose selections branch forwards wide
    # levels (two of them), the chain of 3 one-wide ones.
    for p in (pooled, apart):
        for _ in range(10):
            p.observe_budget(3, 6.0, branching=True)
    assert apart.level_width(3) == 8
    assert apart.predicted_ratio(1, 3) < pooled.predicted_ratio(1, 3) - 0.05  # pooled:
    # the wide levels looked as cheap as the tips the batch of 8 forwarded
    chain8 = apart.predicted_ratio(8, 3, chain=True)  # 8 tips a level: 2 ms, not 9
    apart.chain_level_cost = apart.level_cost
    assert chain8 > apart.predicted_ratio(8, 3, chain=True) + 0.01


def test_a_drafting_step_pays_the_first_pass_an_off_step_skips():
    """Off skips the drafter entirely, so speculation must beat a plain step
    including the drafter's first pass over the verified tokens."""
    cheap, dear = policy(accept=(0.2,) + (0.0,) * 5), policy(accept=(0.2,) + (0.0,) * 5)
    for _ in range(20):
        dear.observe_draft(2, 0.012, levels=0, nodes_forwarded=0, levels_s=0.0)
    assert cheap.predicted_ratio(1, 1) > dear.predicted_ratio(1, 1) + 0.15
    assert cheap.plan_depth(1) == 1 and dear.plan_depth(1) == 0


def test_a_depth_one_step_pays_the_fixed_drafting_work():
    """The drafting step's work besides its first pass and levels (planning, the
    roots' log-probs, selection, hand-over) is paid at every depth: a depth-1
    step runs no level to carry it. Served, leaving it out priced depth-1 trees
    5 ms under what they cost."""
    free, fixed = policy(accept=(0.2,) + (0.0,) * 5), policy(accept=(0.2,) + (0.0,) * 5)
    for p, rest in ((free, 0.0), (fixed, 0.012)):
        for _ in range(20):
            p.observe_draft(2, 0.001, levels=0, nodes_forwarded=0, levels_s=0.0,
                            batch=1, overhead_s=rest)
    assert free.draft_overhead(1) == pytest.approx(0.0, abs=1e-5)
    assert fixed.draft_overhead(1) == pytest.approx(0.012)
    assert free.predicted_ratio(1, 1) > fixed.predicted_ratio(1, 1) + 0.15
    assert free.plan_depth(1) == 1 and fixed.plan_depth(1) == 0
    # Fixed per step: deeper steps pay it once, not per level.
    for _ in range(20):
        fixed.observe_draft(2, 0.001, levels=2, nodes_forwarded=2, levels_s=0.004,
                            batch=1, overhead_s=0.012)
    assert fixed.level_cost(1) == pytest.approx(0.002, rel=0.05)
    assert fixed.draft_overhead(1) == pytest.approx(0.012)
    # Depth 3 as a chain, by hand: 3 nodes verified, first pass + fixed work + 2 levels.
    gain = 1.0 + sum(fixed.chain_accepted_at[:3])
    step = fixed.step_cost(4) + fixed.first_pass_cost(4) + 0.012 + 2 * fixed.level_cost(1)
    assert fixed.predicted_ratio(1, 3, chain=True) == pytest.approx(
        gain / step * fixed.step_cost(1), rel=1e-3)


def test_parallel_drafting_prices_one_forward_for_all_depths():
    """With parallel drafting a depth-d step runs the first pass and one forward of
    d - 1 slots a request, not d - 1 levels: deep trees cost about what shallow
    ones do, so with the same acceptance the plan goes deeper."""
    sequential, parallel = policy(), policy()
    parallel.parallel = True
    for _ in range(20):
        sequential.observe_draft(2, 0.001, levels=5, nodes_forwarded=40, levels_s=0.030,
                                 batch=1)
        parallel.observe_draft(2, 0.001, levels=1, nodes_forwarded=5, levels_s=0.007,
                               batch=1)
    assert parallel.level_cost(5) == pytest.approx(0.007, rel=0.05)
    # Depth 6 as a chain, by hand: first pass + one forward of 5 slots.
    gain = 1.0 + sum(parallel.chain_accepted_at[:6])
    step = parallel.step_cost(7) + parallel.first_pass_cost(7) + parallel.level_cost(5)
    assert parallel.predicted_ratio(1, 6, chain=True) == pytest.approx(
        gain / step * parallel.step_cost(1), rel=1e-3)
    assert parallel.predicted_ratio(1, 6) > sequential.predicted_ratio(1, 6) + 0.1
    assert parallel.plan_depth(1) >= sequential.plan_depth(1)
    # Depth 1 runs no slot forward.
    assert parallel.predicted_ratio(1, 1, chain=True) == pytest.approx(
        (1.0 + parallel.chain_accepted_at[0])
        / (parallel.step_cost(2) + parallel.first_pass_cost(2)) * parallel.step_cost(1),
        rel=1e-3)


def test_drafting_steps_that_verify_nothing_count_as_no_gain():
    """The selection may keep no node on most steps (an unconfident drafter): those
    steps still paid for drafting. If only the verified (confident) steps fed the
    acceptance estimates, the plan would keep drafting every step for a gain that
    only a few steps get. The CPU case: a 44 ms step, 5 ms of drafting."""
    def run(verified_every):
        p = policy(base=0.040, per_token=0.004, accept=(0.45, 0.1, 0.0, 0.0, 0.0, 0.0))
        assert p.plan_depth(1) == 1
        for step in range(200):
            p.observe_draft(1, 0.005, 0, 0, 0.0)  # the drafter's pass: 5 ms
            if step % verified_every == 0:  # a confident step: one node, accepted
                p.observe_budget(1, 1.0, unverified=0)
                p.observe_acceptance([1], depth_used=1, predicted=0.9)
            else:
                p.observe_budget(1, 0.0, unverified=1)
        return p
    assert run(verified_every=1).plan_depth(1) >= 1      # every step gains: keep drafting
    sparse = run(verified_every=10)
    assert sparse.accepted_at[0] == pytest.approx(0.1, abs=0.08)
    assert sparse.plan_depth(1) == 0                      # 1 step in 10 gains: off


def batch_one_off_fraction(seed, acceptance, start=None, steps=3000):
    """Fraction of steps a batch-1, one-draft policy spends off: verifying 2 tokens
    costs 20.7 ms, drafting 2 ms, a plain step 20 ms (break-even about 0.15); each
    draft is accepted with probability ``acceptance``; ``start``: the initial
    acceptance estimate, if not the prior."""
    rng = random.Random(seed)
    p = AdaptiveBudget(num_nodes=1, depth=1, width=1, probe_every=32)
    for n, t in {1: 0.020, 2: 0.0207, 4: 0.021, 16: 0.026}.items():
        p.step_cost.set_knot(n, t)
    for _ in range(20):
        p.observe_draft(2, 0.002, 0, 0, 0.0)
    if start is not None:
        p.accepted_at = [start]
    off = 0
    for _ in range(steps):
        if p.plan_depth(1) == 0:
            off += 1
            continue
        p.observe_budget(1, 1.0)
        p.observe_acceptance([int(rng.random() < acceptance)], 1, 0.5)
    return off / steps


def test_batch_one_noise_does_not_turn_a_paying_chain_off():
    """Batch 1, one draft, accepted with probability 0.45. One step is one
    Bernoulli outcome: an estimate per step, not per tree, dipped below
    break-even on noise and was off for 0-47 % of the steps over five seeds.
    A drafter that really accepts 0.05 is still turned off."""
    assert max(batch_one_off_fraction(seed, 0.45) for seed in range(5)) < 0.02
    assert min(batch_one_off_fraction(seed, 0.05) for seed in range(3)) > 0.9


def test_unverified_requests_of_a_batch_join_its_next_verify_step():
    p = policy(accept=(0.5,) * 6)
    for _ in range(100):
        p.observe_budget(1, 0.5, unverified=1)      # batch of 2: one request kept a node
        p.observe_acceptance([1], depth_used=1, predicted=0.5)
    assert p.accepted_at[0] == pytest.approx(0.5, abs=0.02)  # half the requests accept
    assert p.kappa == pytest.approx(2.0, rel=0.05)           # calibrated on verified nodes only


def test_a_depth_never_seen_inherits_the_conditional_acceptance_above_it():
    p = AdaptiveBudget(num_nodes=8, depth=6, width=4, probe_every=0)
    assert p.accepted_at[:3] == pytest.approx([0.5, 0.25, 0.125])  # before any tree
    rng = random.Random(0)
    for _ in range(400):  # trees drafted to depth 2: 0.55 at depth 1, 0.12 of those at 2
        a = int(rng.random() < 0.55)
        a += a and int(rng.random() < 0.12)
        p.observe_acceptance([a], depth_used=2, predicted=0.5)
    acc = p.accepted_at
    assert acc[0] == pytest.approx(0.55, abs=0.1)
    assert acc[1] == pytest.approx(0.066, abs=0.04)
    # Depth 3 was never verified: its estimate carries depth 2's conditional on.
    assert acc[2] == pytest.approx(acc[1] * acc[1] / acc[0], rel=1e-6)
    assert acc[2] < 0.02 and acc[5] < acc[4] < acc[3] < acc[2]


def test_a_few_trees_outweigh_the_prior():
    """Depth 2 is drafted 20 times: 12 trees reach depth 1, 2 of them depth 2
    (P(>= 2) = 0.1). The estimate follows within a few trees, not after the whole
    EWMA has filled (a prior weighted like 50 trees still said 0.16): it lands
    far nearer the data's 0.1 than the prior's 0.3 (0.55 x 0.55)."""
    p = AdaptiveBudget(num_nodes=8, depth=6, width=4, probe_every=0)
    p.accepted_at = [0.55, 0.3, 0.3, 0.3, 0.3, 0.3]
    est = p.tree_acceptance
    est.data[1:] = est.seen[1:] = [0.0] * 5  # depth 1 long observed; deeper never
    for i in range(20):
        p.observe_acceptance([2 if i in (3, 11) else int(i % 2 == 0)], depth_used=2,
                             predicted=0.5)
    estimate = p.accepted_at[1]
    assert abs(estimate - 0.1) < abs(estimate - 0.3) / 3, estimate
    assert p.accepted_at[0] > 0.5



def test_speculation_turned_off_by_an_unlucky_start_comes_back_within_a_few_probes():
    """Batch 1, true acceptance 0.45, break-even about 0.15; the estimate starts at
    0.05 (an unlucky start). Probes while off weigh RATE_OFF_PROBE per tree: a few
    probes bring speculation back (at the on-rate of 0.02 per tree it took ~10
    probes at gaps growing to 256 steps: off for most of 3,000 steps)."""
    assert max(batch_one_off_fraction(seed, 0.45, start=0.05) for seed in range(5)) < 0.15


def test_deeper_estimates_move_with_depth_one():
    """Served, a turn whose text turned predictable lifted depth-1 acceptance from
    ~0.5 to 0.89 at once, while depth 2 was verified only by probes, and depth-1
    trees ran where stock chains of 2 accepted 2.1 tokens a step. Kept as
    conditionals (here stock k=2's: 0.13 / 0.39 = 1/3), deeper estimates follow
    depth 1, and the plan deepens with it."""
    p = policy(base=0.040, per_token=0.0005, accept=(0.39, 0.13, 0.04, 0.0, 0.0, 0.0))
    p.chain_level_cost.add(1, 0.004)  # a one-wide drafting level: 4 ms
    assert p.plan_depth(1) == 1
    for _ in range(100):  # depth-1 trees only, now almost always accepted
        p.observe_acceptance([1], depth_used=1, predicted=0.9)
    assert p.accepted_at[0] > 0.9
    assert p.accepted_at[1] == pytest.approx(p.accepted_at[0] / 3, rel=1e-6)
    assert p.plan_depth(1) == 2
    # Negative control: depth 2 kept at its old absolute value, depth 1 stays best.
    frozen = policy(base=0.040, per_token=0.0005, accept=(0.92, 0.13, 0.04, 0.0, 0.0, 0.0))
    frozen.accepted_at = [0.92, 0.13, 0.04, 0.0, 0.0, 0.0]
    frozen.chain_level_cost.add(1, 0.004)
    assert frozen.plan_depth(1) == 1


def test_the_greedy_chain_is_priced_apart_and_verified_whole():
    """The CPU trace that motivated it: tree-mode selections at depth 2 branched
    (3.5 nodes, 8 ms of tree attention), so depth 2 priced low and the plan ran
    depth 1 or off, while the chain of 2 beat every plan. Priced apart, the
    chain of 2 wins; chain mode drafts one wide and verifies the whole chain."""
    p = policy(base=0.038, per_token=0.0005, accept=(0.55, 0.3, 0.1, 0.03, 0.01, 0.0))
    p.chain_level_cost.add(1, 0.002)
    p.level_cost.add(8, 0.008)
    for _ in range(40):
        p.observe_step(5, 0.038 + 0.0005 * 5 + 0.008, branching=True)
        p.observe_budget(2, 3.5, branching=True)
    assert p.predicted_ratio(1, 2, chain=True) > p.predicted_ratio(1, 2) + 0.1
    assert p.plan_depth(1) == 2 and p.chain_mode and p.level_width(2) == 1
    scores = torch.log(torch.tensor([[0.9, 0.05, 0.04, 0.01, 0.3]]))
    chain = torch.tensor([[True, False, False, False, True]])
    budgets, chain_only = p.select(scores, 8, chain)
    assert chain_only and budgets.tolist() == [2]  # whole, however unsure node 2 looks
    nodes_before = list(p.nodes_at)
    p.observe_budget(2, 2.0)
    assert p.nodes_at == nodes_before  # chain mode says nothing of tree-mode sizes


def test_chain_mode_outcomes_feed_only_the_chain_estimates():
    p = policy(accept=(0.5, 0.25, 0.1, 0.0, 0.0, 0.0))
    p.chain_mode = True
    p.select(torch.zeros(1, 4), 4, torch.ones(1, 4, dtype=torch.bool))
    tree_before = p.accepted_at
    for _ in range(100):
        p.observe_acceptance([0], depth_used=2, predicted=0.5)
    assert p.accepted_at == tree_before
    assert p.chain_accepted_at[0] < 0.2
    p.chain_mode = False  # tree mode: trees and their chains both learn
    p.select(torch.zeros(1, 4), 4, torch.ones(1, 4, dtype=torch.bool))
    for _ in range(100):
        p.observe_acceptance([2], depth_used=2, predicted=0.5)
    assert p.accepted_at[0] > 0.8 and p.chain_accepted_at[0] > 0.8


def test_trees_win_where_branching_is_free_and_siblings_accept():
    """A fused tree kernel (no branching extra), trees accepting more than their
    chains: the plan keeps tree mode."""
    p = policy(base=0.040, per_token=0.0001, accept=(0.8, 0.6, 0.45, 0.3, 0.2, 0.1))
    p.chain_accepted_at = [0.5, 0.25, 0.1, 0.03, 0.01, 0.0]
    assert p.plan_depth(1) >= 3 and not p.chain_mode


def test_chain_depths_are_learned_from_chains_verified_whole():
    """Tree mode keeps a chain's second node only where it looks sure (1 step in
    4): there the target accepts 0.8 of depth 2 given depth 1, elsewhere 0.1.
    Verified whole, the chain accepts 0.25 * 0.8 + 0.75 * 0.1 = 0.275 at depth 2
    given depth 1; learned from the chains the selection let through it would
    be priced at 0.8. Every 4th step verifies the chain whole (chain mode); the
    estimate must come from those. Tree mode is priced as what its selection
    keeps, so for trees the cuts count as rejections."""
    def run(learn_from_cuts: bool):
        p = AdaptiveBudget(num_nodes=8, depth=2, width=4, probe_every=0)
        rng = random.Random(0)
        chain = torch.ones(1, 4, dtype=torch.bool)
        for i in range(1200):
            p.chain_mode = whole = i % 4 == 0
            p.select(torch.zeros(1, 4), 4, chain)
            if learn_from_cuts:
                p._chain_whole = True  # as if every tree-mode chain were unbiased
            sure = rng.random() < 0.25
            a = int(rng.random() < 0.9)
            cut = not (whole or sure)  # the selection kept one node
            a += a and not cut and int(rng.random() < (0.8 if sure else 0.1))
            tip = a == 2 or (a == 1 and cut)
            p.observe_acceptance(Outcome([a], [a], [tip]), depth_used=2, predicted=0.5)
        return (p.chain_accepted_at[1] / p.chain_accepted_at[0],
                p.accepted_at[1] / p.accepted_at[0], p.chain_accepted_at[0])
    chain, tree, first = run(learn_from_cuts=False)
    assert chain == pytest.approx(0.275, abs=0.1)
    assert first == pytest.approx(0.9, abs=0.06)  # depth 1: every step teaches it
    assert tree < 0.35
    assert run(learn_from_cuts=True)[0] > 0.5  # control: the confident chains decide


def test_probe_schedule_backs_off_while_off_and_respects_the_cost_floor():
    s = ProbeSchedule(every=4)
    # Speculating: every 4 steps.
    assert [n for n in range(1, 17) if s.due(n, True, lambda: 1000)] == [4, 8, 12, 16]
    # Off: the gap doubles from the last probe (8, 16, 32, 32), the floor unused.
    off = ProbeSchedule(every=4)
    assert [n for n in range(1, 120) if off.due(n, False, lambda: 0)] == [4, 12, 28, 60, 92]
    # Off with a floor of 50 steps between probes: never sooner.
    floored = ProbeSchedule(every=4)
    got = [n for n in range(1, 200) if floored.due(n, False, lambda: 50)]
    assert got == [50, 100, 150] and all(b - a >= 50 for a, b in zip(got, got[1:]))
    # Speculating again brings the on-state gap back at once.
    assert not floored.due(151, True, lambda: 50) and floored.due(155, True, lambda: 50)
    assert ProbeSchedule(every=0).due(1, False, lambda: 0) is False


def drafting_policy(level_s=0.002):
    """Tree mode at batch 1 with known drafting costs: one-wide levels of
    ``level_s``, a 1 ms first pass, 40 ms + 1 ms a verified token."""
    p = policy()
    p.chains = False  # tree mode only: chain mode never stops early
    for _ in range(20):
        p.observe_draft(2, 0.001, levels=2, nodes_forwarded=2, levels_s=2 * level_s,
                        batch=1, one_wide=True)
    return p


def test_a_step_stops_drafting_where_its_frontier_cannot_pay_for_a_level():
    p = drafting_policy()
    assert p.level_pays(torch.tensor([[-30.0]]), 0)  # unplanned: never stops
    assert p.plan_depth(1) > 0 and not p.chain_mode
    rate = p._plan_rate
    assert rate == pytest.approx(p.predicted_ratio(1, p.last_depth) / p.step_cost(1))
    # A level costs 2 ms of drafting + 1 ms for the token more it verifies: it
    # pays if the forwarded node's acceptance estimate reaches 3 ms of the rate.
    threshold = 0.003 * rate
    assert 0.05 < threshold < 0.5
    assert p.level_pays(torch.tensor([[np.log(1.05 * threshold)]]), 2)
    assert not p.level_pays(torch.tensor([[np.log(0.95 * threshold)]]), 2)
    # Calibrated: a drafter whose nodes are accepted twice as often as it says.
    p.kappa = 2.0
    assert p.level_pays(torch.tensor([[np.log(0.6 * threshold)]]), 2)
    p.kappa = 1.0
    # Chain mode (verified whole, priced whole) and probes draft their depth.
    p.chain_mode = True
    assert p.level_pays(torch.tensor([[-30.0]]), 2)
    p.chain_mode, p.probing = False, True
    assert p.level_pays(torch.tensor([[-30.0]]), 2)


def test_a_batch_pays_for_a_level_with_its_requests_together():
    """Four requests share one level: each alone is too unsure for it, together
    they are not (the level's drafting time is paid once for the batch)."""
    p = drafting_policy(level_s=0.004)
    for _ in range(20):  # the same level for 4 requests: 5 ms
        p.observe_draft(8, 0.002, levels=2, nodes_forwarded=8, levels_s=0.010,
                        batch=4, one_wide=True)
    assert p.plan_depth(4) > 0 and not p.chain_mode
    one = drafting_policy(level_s=0.004)
    assert one.plan_depth(1) > 0
    q = 0.8 * (0.005 + 0.001) * one._plan_rate
    assert not one.level_pays(torch.tensor([[np.log(q)]]), 1)
    cost = p.chain_level_cost(4) + p.step_cost(16) - p.step_cost(12)  # 3 -> 4 tokens each
    each = 1.2 * cost * p._plan_rate / 4
    assert p.level_pays(torch.full((4, 1), float(np.log(each))), 1)
    assert not p.level_pays(torch.full((4, 1), float(np.log(0.8 * each))), 1)


def test_a_depth_is_priced_with_the_levels_its_steps_ran():
    """Steps planned at depth 6 that stopped after one level cost one level's
    drafting, not five: the price of depth 6 follows (tree mode; the greedy
    chain verified whole still pays every level)."""
    p = drafting_policy(level_s=0.004)
    before = p.predicted_ratio(1, 6)
    chain_before = p.predicted_ratio(1, 6, chain=True)
    for _ in range(40):
        p.observe_budget(6, 6.0, levels=1)
    assert p.levels_at[5] == pytest.approx(1.0, abs=1e-3)
    p.probing = True  # a probe drafts its whole depth: not what planned steps run
    p.observe_budget(6, 6.0, levels=5)
    p.probing = False
    assert p.levels_at[5] == pytest.approx(1.0, abs=1e-3)
    after = p.predicted_ratio(1, 6)
    # Four levels (16 ms) fewer in a step of ~65 ms.
    assert after > 1.2 * before
    assert p.predicted_ratio(1, 6, chain=True) == pytest.approx(chain_before)
