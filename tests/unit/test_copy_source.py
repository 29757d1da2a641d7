"""Copy branches' pricing and learning (policy.copy_estimates, selection.best_extension,
vllm_glue.copy_source.eagle_outcome) and their config keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_treespec.config import TreeSpecConfig, TreeSpecConfigError
from vllm_treespec.policy.copy_estimates import CopyAcceptance
from vllm_treespec.policy.selection import best_extension
from vllm_treespec.tree.accept import Outcome
from vllm_treespec.tree.copy_drafts import BOTH, COPY, EAGLE, OTHER


def test_estimates_fall_along_a_branch_and_learn_from_its_accepted_part():
    est = CopyAcceptance(max_match=4, max_length=8)
    q = est.estimates(3, 8)
    assert np.all(np.diff(q) <= 0) and q[0] == pytest.approx(CopyAcceptance.PRIOR)
    for _ in range(50):
        est.observe(match=4, kept=8, accepted=8)   # long matches: always right
        est.observe(match=2, kept=8, accepted=0)   # short ones: never
    assert est.estimates(4, 8)[-1] > 0.8
    assert est.estimates(2, 1)[0] < 0.05
    # A rejected first token says nothing about the second (never verified after it).
    assert est.cond[2, 1] == pytest.approx(CopyAcceptance.PRIOR)
    before = est.cond[2, 0]
    est.forget()
    assert before < est.cond[2, 0] < CopyAcceptance.PRIOR


def test_an_extension_takes_the_nodes_that_raise_the_rate():
    cost = 1.0 + 0.1 * np.arange(20)  # each verified node adds a tenth of a step
    # Base: 1 request, 2 nodes with estimates summing to 1 -> gain 2 in 1.2.
    t, rate = best_extension(np.array([0.9, 0.8, 0.05]), 2.0, 2, cost, 0.0)
    assert t == pytest.approx(0.8)  # 0.05 lowers the rate; 0.9 and 0.8 raise it
    assert rate == pytest.approx((2.0 + 0.9 + 0.8) / cost[4])
    assert best_extension(np.array([0.05]), 2.0, 2, cost, 0.0) == (float("inf"), 2.0 / cost[2])
    # A branching extra of half a step prices a lone good node out.
    assert best_extension(np.array([0.9]), 2.0, 2, cost, 0.5)[0] == float("inf")
    assert best_extension(np.zeros(3), 2.0, 2, cost, 0.0)[0] == float("inf")


class FixedCostBudget:
    """What ``CopySource.lengths`` reads of the adaptive budget, on a fixed cost
    table (each verified token a tenth of a step) and branching extra."""

    def __init__(self, branch_cost: float):
        from vllm_treespec.policy import AdaptiveBudget

        self.budget = AdaptiveBudget(num_nodes=16, depth=4, width=4)
        for n in (1, 64, 256):
            self.budget.step_cost.set_knot(n, 1.0 + 0.1 * (n - 1))
        self.budget.branch_cost = branch_cost

    def copy_threshold(self, *args, **kwargs):
        return self.budget.copy_threshold(*args, **kwargs)


@pytest.mark.parametrize("branch_cost, kept", [
    (0.0, [[1, 1]]),    # branching is free: both copies' first tokens pay
    (5.0, [[1, 0]]),    # dear: the first copy alone, a chain
])
def test_copies_that_would_branch_pay_the_branching_extra(branch_cost, kept):
    """An undrafted request with two copies that part at once: verifying both
    makes its tree branch. Priced as chains (as they were), both were verified
    whatever branching cost; now the first copy alone competes, as a chain."""
    from vllm_treespec.tree.copy_drafts import CopyDraft
    from vllm_treespec.vllm_glue.copy_source import CopySource

    source = CopySource(branches=2, length=1)
    for _ in range(50):  # both kinds of match reliably right
        source.estimates.observe(match=4, kept=1, accepted=1)
        source.estimates.observe(match=3, kept=1, accepted=1)
    copies = [[CopyDraft((7,), 4), CopyDraft((8,), 3)]]
    budget = FixedCostBudget(branch_cost)
    assert source.lengths(copies, budget, base_gain=1.0, base_nodes=0,
                          base_chains=True) == kept
    # A lone copy never branches: the extra does not price it out.
    assert source.lengths([copies[0][:1]], budget, 1.0, 0, True) == [[1]]
    # Beside a drafted tree that branches already, no new extra: both stay.
    assert source.lengths(copies, budget, 1.5, 2, base_chains=False) == [[1, 1]]


def test_the_drafter_learns_only_from_its_own_nodes():
    class Tree:  # what eagle_outcome reads of a ProposedTree
        def __init__(self, sources):
            self.sources = sources

    from vllm_treespec.vllm_glue.copy_source import eagle_outcome

    trees = [Tree([BOTH, EAGLE, COPY]),   # root -> 1 (both) -> 3 (copy); root -> 2
             Tree([COPY, COPY]),          # a copy-only tree: not the drafter's
             Tree(None)]                  # no copies: as verified
    out = Outcome([2, 2, 1], [2, 2, 1], [True, True, True])
    got = eagle_outcome(out, trees, [[1, 3], [1, 2], [1]])
    assert got.accepted == [1, 1]  # stops at the copy-only node; tree 2 left out
    assert got.chain_accepted == [1, 1]
    assert got.chain_censored == [True, True]
    assert eagle_outcome(Outcome([1], [1], [False]), [Tree([COPY])], [[1]]) is None


def test_copy_keys_are_validated_by_name():
    assert TreeSpecConfig(copy_branches=2).max_children == 8 + 2
    with pytest.raises(TreeSpecConfigError, match="'copy_branches'.*9.*\\[0, 8\\]"):
        TreeSpecConfig(copy_branches=9)
    with pytest.raises(TreeSpecConfigError, match="'copy_length'.*num_nodes=4"):
        TreeSpecConfig(num_nodes=4, depth=2, copy_branches=1, copy_length=8)
    with pytest.raises(TreeSpecConfigError, match="'copy_branches'.*choices"):
        TreeSpecConfig.from_dict({"choices": [[0], [1]], "copy_branches": 1})


def test_copies_are_on_by_default_except_in_static_trees():
    default = TreeSpecConfig()
    assert (default.copy_branches, default.copy_length) == (2, 8)
    assert TreeSpecConfig.from_dict({"choices": [[0], [1], [0, 0]]}).copy_branches == 0
    # A small tree gets branches of its own size, not an error about a key not given.
    small = TreeSpecConfig.from_dict({"num_nodes": 4, "depth": 2})
    assert (small.copy_branches, small.copy_length) == (2, 4)
    assert TreeSpecConfig.from_dict({"copy_branches": 0}).copy_branches == 0
    # Given keys are kept as given, and still validated.
    with pytest.raises(TreeSpecConfigError, match="'copy_length'.*num_nodes=4"):
        TreeSpecConfig.from_dict({"num_nodes": 4, "depth": 2, "copy_length": 5})
    with pytest.raises(TreeSpecConfigError, match="'num_nodes'.*True"):
        TreeSpecConfig.from_dict({"num_nodes": True})


def test_a_copy_displaces_unlikely_drafts_of_a_full_tree():
    """A drafted tree at the node budget leaves a copy no room (graft alone would
    drop it): ranked together, the copy's first tokens (prior estimates 0.5, 0.25)
    take the places of two drafts of probability 0.1 (ties go to the earlier
    node), and the drafter keeps its likely node."""
    from vllm_treespec.tree.copy_drafts import CopyDraft
    from vllm_treespec.vllm_glue.copy_source import CopySource

    source = CopySource(branches=1, length=4)
    tokens, parents, probs = [10, 20, 11, 12], [0, 0, 1, 1], [0.9, 0.1, 0.1, 0.1]
    copy = CopyDraft((30, 31, 32, 33), 3)
    got_tokens, got_parents, got_probs, sources, branches = source.grafted(
        tokens, parents, probs, [copy], [2], max_nodes=4, max_children=4)
    assert (got_tokens, got_parents) == ([10, 20, 30, 31], [0, 0, 0, 3])
    assert got_probs == [0.9, 0.1, 0.0, 0.0] and sources == [EAGLE, EAGLE, COPY, COPY]
    assert branches == [(3, [3, 4], COPY)]
    # The drafter's calibration scales its probabilities: at 3x, its 0.3 beats 0.25.
    got_tokens, *_ = source.grafted(tokens, parents, probs, [copy], [2], max_nodes=4,
                                    max_children=4, drafter_scale=3.0)
    assert got_tokens == [10, 20, 30, 11]


def test_no_copies_while_the_budget_keeps_speculation_off():
    """The proposer searches and grafts copies only on steps the budget
    speculates on (or without a budget); a step it plans off stays plain."""
    from types import SimpleNamespace

    from vllm_treespec.vllm_glue.copy_source import CopySource
    from vllm_treespec.vllm_glue.hand_over import DraftHandOver

    history = np.array([[5, 6, 7, 8, 9, 5, 6, 7]])  # ends where "5 6 7" began: "8 9 .."
    proposer = SimpleNamespace(
        copies=CopySource(branches=2, length=4), adaptive_budget=None, last_depth=3,
        runner=SimpleNamespace(input_batch=SimpleNamespace(
            token_ids_cpu=history, num_tokens_no_spec=np.array([history.shape[1]]),
            req_ids=["r"])))
    hand_over = DraftHandOver(proposer)
    plan = hand_over.copy_plan(None, None, np.zeros(1, np.int64), torch.tensor([7]))
    assert plan is not None and [c.tokens for c in plan[0][0]] == [(8, 9, 5, 6)]
    assert plan[1] == [[4]]
    proposer.last_depth = 0  # the adaptive budget planned this step off
    assert hand_over.copy_plan(None, None, np.zeros(1, np.int64), torch.tensor([7])) is None


# Histories ending at their root (the last token), each offering copies: p's
# "1 2 3 4" was followed twice (two own copies) and its tenant's store holds a
# third; a's "5 6 7 8" once (and the store another); b's "11 12 13" once.
_PLAIN_ROW_HISTORIES = {
    "p": [1, 2, 3, 4, 50, 51, 52, 53, 1, 2, 3, 4, 60, 61, 62, 63, 9, 1, 2, 3, 4],
    "a": [5, 6, 7, 8, 70, 71, 72, 73, 5, 6, 7, 8],
    "b": [11, 12, 13, 80, 81, 82, 83, 11, 12, 13],
}
_PLAIN_ROW_DRAFTS = {"p": 10, "a": 20, "b": 30}  # each tree row's one drafted token


def _hand_over_with_copies(req_ids: list[str], allowed: list[bool]):
    """One hand-over of the batch ``req_ids`` (its rows ``allowed`` a tree get
    a one-node drafted tree, probability 0.6) with copies from own history and
    the tenant's store, priced on a fixed cost table: (drafts, proposed, source)."""
    import dataclasses
    from types import SimpleNamespace

    from vllm_treespec.tree import TreeBatch
    from vllm_treespec.vllm_glue.hand_over import DraftHandOver

    source = _cross_request_source()
    source.admit({r: "t" for r in ["f1", "f2", *req_ids]})
    source.file_finished("f1", None, [3, 4, 95, 96, 97])
    source.file_finished("f2", None, [7, 8, 90, 91])
    width = max(len(h) for h in _PLAIN_ROW_HISTORIES.values())
    history = np.array([_PLAIN_ROW_HISTORIES[r] + [0] * (width - len(_PLAIN_ROW_HISTORIES[r]))
                        for r in req_ids])
    roots = torch.tensor([_PLAIN_ROW_HISTORIES[r][-1] for r in req_ids])
    rows = [b for b, ok in enumerate(allowed) if ok]
    trees = TreeBatch.from_parents(
        [[int(roots[b]), _PLAIN_ROW_DRAFTS[req_ids[b]]] for b in rows],
        [[0, 0]] * len(rows), tree_size=2)
    trees = dataclasses.replace(trees, score=torch.full((len(rows), 2), float(np.log(0.6))))
    # A branching extra at which the tree rows' plan depends on what else is
    # priced beside it: with p's copies, a and b keep a token less each.
    policy = FixedCostBudget(branch_cost=0.2)
    policy.kappa = 1.0
    d = SimpleNamespace(
        copies=source, adaptive_budget=policy, last_depth=1, proposed={},
        tree_cfg=SimpleNamespace(num_nodes=16, max_children=10),
        runner=SimpleNamespace(
            tree_allowed_mask=lambda n: allowed[:n],
            input_batch=SimpleNamespace(token_ids_cpu=history, req_ids=req_ids,
                                        num_tokens_no_spec=np.array([len(
                                            _PLAIN_ROW_HISTORIES[r]) for r in req_ids]))))
    drafts = DraftHandOver(d)(trees, roots, [len(_PLAIN_ROW_HISTORIES[r]) for r in req_ids],
                              rows)
    return drafts, d.proposed, source


def test_a_plain_row_is_neither_searched_for_copies_nor_priced():
    """A row ``tree_safe`` refused (p) gets no drafts, so no copies: its history
    and its tenant's store are not searched (no lookup gate opened), and the
    tree rows beside it get exactly the copies and trees they get without it --
    its copies, bonus token and row priced nothing beside theirs (issue 94)."""
    drafts, proposed, source = _hand_over_with_copies(["p", "a", "b"], [False, True, True])
    alone, alone_proposed, _ = _hand_over_with_copies(["a", "b"], [True, True])
    assert drafts == [[], *alone]
    assert proposed == alone_proposed and "p" not in proposed
    assert set(source.gates) == {"a", "b"}  # p's store lookup never ran
    # The tree rows' plan is not trivial: copies from both sources were grafted.
    assert alone == [[20, 70, 90, 71], [30, 80, 81]]
    assert {src for tree in alone_proposed.values() for *_, src in tree.branches} == {
        COPY, OTHER}


def test_the_plain_row_control_searches_and_prices_the_same_row_allowed_a_tree():
    """Negative control: the same batch with p allowed a tree searches p (its
    gate opens) and grafts its copies, and pricing them beside a's and b's
    keeps fewer of theirs: the equality above is what a priced plain row breaks."""
    drafts, proposed, source = _hand_over_with_copies(["p", "a", "b"], [True, True, True])
    alone, _, _ = _hand_over_with_copies(["a", "b"], [True, True])
    assert "p" in source.gates and drafts[0] == [10, 60, 50, 95]
    assert drafts[1:] == [[20, 70, 90], [30, 80]] != alone


def _cross_request_source(file_prompts=False):
    from vllm_treespec.tree.shared_suffixes import SharedSuffixes
    from vllm_treespec.vllm_glue.copy_source import CopySource

    return CopySource(branches=2, length=4, shared=SharedSuffixes(1000, length=4),
                      file_prompts=file_prompts)


def test_other_requests_copies_come_from_the_same_tenant_only():
    """Finished outputs are filed under their request's cache_salt; a request
    finds them only under the same salt (None matches None), a request whose
    tenant the scheduler never named finds none and files none."""
    from vllm_treespec.tree.copy_drafts import OTHER

    source = _cross_request_source()
    source.admit({"a1": "alice", "b1": "bob", "n1": None, "a2": "alice", "b2": "bob",
                  "n2": None})
    source.file_finished("a1", [1, 1], [5, 6, 7, 8, 9])
    source.file_finished("n1", [1, 1], [5, 6, 30, 31])
    source.file_finished("x1", [1, 1], [5, 6, 40, 41])  # never admitted: not filed
    history = np.array([[3, 5, 6]] * 4)
    found, _ = source.find(history, np.array([3] * 4), [6] * 4, ["a2", "b2", "n2", "x2"])
    assert [[(c.tokens, c.source) for c in row] for row in found] == [
        [((7, 8, 9), OTHER)], [], [((30, 31), OTHER)], []]
    assert source.shared.tokens == 5 + 4 and "x1" not in source.tenants


def test_the_tenant_check_fails_a_source_that_ignores_tenants():
    """Negative control: filing everything under one tenant hands bob alice's text."""
    source = _cross_request_source()
    source.admit({"a1": "alice", "b2": "bob"})
    source.tenants["a1"] = "bob"  # isolation removed: alice's output filed as bob's
    source.file_finished("a1", None, [5, 6, 7, 8, 9])
    found, _ = source.find(np.array([[3, 5, 6]]), np.array([3]), [6], ["b2"])
    with pytest.raises(AssertionError):
        assert found == [[]]


def test_prompts_are_filed_only_when_asked():
    for file_prompts, expect in ((False, []), (True, [(9, 9, 1, 2)])):
        source = _cross_request_source(file_prompts)
        source.admit({"a": "t", "b": "t"})
        source.file_finished("a", [5, 6, 9, 9], [1, 2])
        found, _ = source.find(np.array([[5, 6]]), np.array([2]), [6], ["b"])
        assert [c.tokens for c in found[0]] == expect


def test_other_requests_copies_are_priced_learned_and_counted_apart():
    """An OTHER copy is grafted as OTHER nodes, a copy already among the
    request's own is not offered twice, its acceptance is learned by its own
    estimates, and accepted tokens are counted by source."""
    from vllm_treespec.tree.copy_drafts import OTHER, CopyDraft
    from vllm_treespec.tree.proposed import ProposedTree

    source = _cross_request_source()
    source.admit({"a": None, "c": None, "b": None})
    source.file_finished("a", None, [9, 5, 6, 7, 8, 0])
    source.file_finished("c", None, [5, 6, 11, 12])
    # own history: "5 6" was followed by 7 8 ..., which the store also holds
    history = np.array([[5, 6, 7, 8, 0, 5, 6]])
    found, _ = source.find(history, np.array([7]), [6], ["b"])
    assert [(c.tokens, c.source) for c in found[0]] == [
        ((7, 8, 0, 5), COPY), ((11, 12), OTHER)]
    tokens, parents, probs, sources, branches = source.grafted(
        [7], [0], [0.5], found[0], [4, 2], max_nodes=8, max_children=4)
    assert sources == [EAGLE | COPY, OTHER, COPY, OTHER, COPY, COPY]
    tree = ProposedTree(tokens, parents, probs, sources, branches)
    other_node = tokens.index(11) + 1
    before = source.other_estimates.of(None).estimates(2, 2).copy()
    own_before = source.estimates.estimates(2, 4).copy()
    counts = source.observe([tree], [[other_node, other_node + 2]], ["b"])
    assert counts == (0, 2, 0)  # own history, other requests, both
    assert (source.other_estimates.of(None).estimates(2, 2) > before).all()
    assert (source.estimates.estimates(2, 4) < own_before).all()  # its own copy missed
    assert source.estimates_of(CopyDraft((11, 12), 2, OTHER)).tolist() == \
        source.other_estimates.of(None).estimates(2, 2).tolist()


def _accepted_other_copy(source, req_id: str, tenant, drafted: bool = False):
    """Verify ``req_id``'s lookup: its copy of (7, 8) from ``tenant``'s outputs,
    both tokens accepted (``drafted``: the drafter proposed them too)."""
    from vllm_treespec.tree.copy_drafts import OTHER, CopyDraft
    from vllm_treespec.tree.proposed import ProposedTree

    copy = CopyDraft((7, 8), 2, OTHER, tenant)
    drafts = ([7, 8], [0, 1], [0.5, 0.4]) if drafted else ([], [], [])
    tree = ProposedTree(*source.grafted(*drafts, [copy], [2], max_nodes=8, max_children=4))
    return source.observe([tree], [[1, 2]], [req_id])


@pytest.mark.parametrize("isolated", [True, False])
def test_one_tenants_accepted_copies_never_price_anothers(isolated, monkeypatch):
    """Copies from other requests are priced by their tenant's own estimates:
    alice's accepted copies make alice's surer and leave bob's at the prior.
    Negative control: one estimate for every tenant fails the check."""
    from vllm_treespec.policy.copy_estimates import TenantAcceptance
    from vllm_treespec.tree.copy_drafts import OTHER, CopyDraft

    if not isolated:
        shared = CopyAcceptance(4, 4)
        monkeypatch.setattr(TenantAcceptance, "of", lambda self, tenant: shared)
    source = _cross_request_source()
    source.admit({"a": "alice", "b": "bob"})
    prior = source.estimates_of(CopyDraft((7, 8), 2, OTHER, "bob")).copy()
    for _ in range(5):
        assert _accepted_other_copy(source, "a", "alice") == (0, 2, 0)
    alice = source.estimates_of(CopyDraft((7, 8), 2, OTHER, "alice"))
    bob = source.estimates_of(CopyDraft((7, 8), 2, OTHER, "bob"))
    assert (alice > prior).all()
    if isolated:
        assert bob.tolist() == prior.tolist()
    else:
        assert (bob > prior).all()


class _Threshold:
    """A policy whose copy threshold is fixed (what ``CopySource.lengths`` reads)."""

    def __init__(self, threshold: float):
        self.threshold = threshold

    def copy_threshold(self, q, base_gain, base_nodes, batch, branching=False):
        return self.threshold, 1.0


def test_a_tenant_forgets_when_its_own_copies_were_priced_out():
    """Copies found and none kept drift back towards the prior, per tenant:
    bob's, priced out, drift although alice's were kept in the same step;
    alice's kept ones do not."""
    from vllm_treespec.tree.copy_drafts import OTHER, CopyDraft

    source = _cross_request_source()
    for tenant, accepted in (("alice", 2), ("bob", 0)):
        for _ in range(10):
            source.other_estimates.of(tenant).observe(2, 2, accepted)
    alice, bob = CopyDraft((7, 8), 2, OTHER, "alice"), CopyDraft((7, 8), 2, OTHER, "bob")
    a0, b0 = source.estimates_of(alice).copy(), source.estimates_of(bob).copy()
    threshold = (a0[0] + b0[0]) / 2  # alice's first token kept, bob's not
    kept = source.lengths([[alice], [bob]], _Threshold(threshold), 0.0, 0, True)
    assert kept[0][0] >= 1 and kept[1] == [0]
    assert source.estimates_of(alice).tolist() == a0.tolist()
    assert (source.estimates_of(bob) > b0).all()


def test_the_tenants_estimates_are_bounded(monkeypatch):
    from vllm_treespec.policy.copy_estimates import TenantAcceptance

    monkeypatch.setattr(TenantAcceptance, "MAX_TENANTS", 2)
    est = TenantAcceptance(4, 4)
    alice = est.of("alice")
    est.of("bob"), est.of("alice"), est.of("carol")  # bob least recently used: out
    assert est.of("alice") is alice and len(est._of) == 2 and "bob" not in est._of


def test_the_lookup_gate_backs_off_while_dry_and_opens_on_an_accepted_token():
    from vllm_treespec.policy.copy_estimates import LookupGate

    gate = LookupGate()
    looked = []
    for step in range(200):
        if gate.open():
            looked.append(step)
            gate.looked()
    # PATIENCE lookups every step, then gaps of 2, 4, 8 and MAX_GAP from there on
    p, m = LookupGate.PATIENCE, LookupGate.MAX_GAP
    assert looked[:p] == list(range(p))
    gaps = np.diff(looked[p - 1:]).tolist()
    assert gaps[:4] == [2, 4, 8, 16] and set(gaps[3:]) == {m}
    gate.accepted()
    assert all(gate.open() for _ in range(3))


def test_a_request_whose_other_copies_do_not_pay_looks_up_ever_more_rarely():
    """A request whose store copies are never accepted stops looking every
    step, as does one whose accepted store tokens the drafter proposed too
    (the store added nothing); one whose copies alone are accepted keeps
    looking every step; the gate is the request's own and leaves with it."""
    from vllm_treespec.policy.copy_estimates import LookupGate

    source = _cross_request_source()
    source.admit({"done": None, "dry": None, "echo": None, "paid": None})
    source.file_finished("done", None, [5, 6, 7, 8, 9])
    looked = {"dry": 0, "echo": 0, "paid": 0}
    steps = 100
    for _ in range(steps):
        for req_id in looked:
            found, _ = source.find(np.array([[3, 5, 6]]), np.array([3]), [6], [req_id])
            looked[req_id] += bool(found[0])
        assert _accepted_other_copy(source, "echo", None, drafted=True) == (0, 0, 2)
        _accepted_other_copy(source, "paid", None)
    assert looked["paid"] == steps
    rarely = LookupGate.PATIENCE + steps / LookupGate.MAX_GAP + 4
    assert looked["dry"] < rarely and looked["echo"] < rarely
    source.drop("dry")
    assert "dry" not in source.gates and "dry" not in source.tenants


def test_the_runner_files_finished_requests_under_their_tenant():
    """The runner notes new requests' tenants and files a finished request's
    output before vLLM drops its state; one it no longer holds files nothing."""
    from types import SimpleNamespace

    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    source = _cross_request_source()
    from vllm_treespec.vllm_glue.metrics import TreeMetrics

    runner = SimpleNamespace(tree_metrics=TreeMetrics(log_interval_s=None), requests={
        "a": SimpleNamespace(prompt_token_ids=[1, 2], output_token_ids=[5, 6, 7, 8])})
    TreeRunnerMixin._file_finished(runner, source, SimpleNamespace(
        tree_tenants={"a": "alice", "b": "bob"}, finished_req_ids=set()))
    assert source.tenants == {"a": "alice", "b": "bob"}
    TreeRunnerMixin._file_finished(runner, source, SimpleNamespace(
        tree_tenants={}, finished_req_ids={"a", "b"}))
    assert source.tenants == {} and source.shared.tokens == 4
    assert runner.tree_metrics.total.cross_request_tokens == 4  # the gauge follows filing
    found, _ = source.find(np.array([[5, 6]]), np.array([2]), [6], ["c"])
    assert found == [[]]  # "c": never named by the scheduler
    source.admit({"c": "alice"})
    found, _ = source.find(np.array([[5, 6]]), np.array([2]), [6], ["c"])
    assert [d.tokens for d in found[0]] == [(7, 8)]
    # the metrics count the store's lookups and hits once each, however often read
    for _ in range(2):
        runner.tree_metrics.on_cross_request(source.shared)
        total = runner.tree_metrics.total
        assert (total.cross_request_lookups, total.cross_request_hits) == (1, 1)


def test_a_request_id_sent_again_keeps_each_request_in_its_own_tenant():
    """An aborted request sent again under the same id is finished and new in one
    step: the old one's output is filed under its own tenant, the new one gets
    the tenant the scheduler named for it."""
    from types import SimpleNamespace

    from vllm_treespec.vllm_glue.metrics import TreeMetrics
    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    source = _cross_request_source()
    source.admit({"x": "alice"})
    runner = SimpleNamespace(tree_metrics=TreeMetrics(log_interval_s=None), requests={
        "x": SimpleNamespace(prompt_token_ids=[1], output_token_ids=[5, 6, 7, 8])})
    TreeRunnerMixin._file_finished(runner, source, SimpleNamespace(
        tree_tenants={"x": "bob"}, finished_req_ids={"x"}))
    assert source.tenants == {"x": "bob"}
    source.admit({"b2": "bob", "a2": "alice"})
    found, _ = source.find(np.array([[5, 6]] * 2), np.array([2, 2]), [6, 6], ["b2", "a2"])
    assert [[d.tokens for d in row] for row in found] == [[], [(7, 8)]]


def test_the_search_reaches_back_its_window_and_no_further():
    from vllm_treespec.vllm_glue.copy_source import HISTORY_WINDOW, CopySource

    rng = np.random.default_rng(0)
    n = HISTORY_WINDOW + 100
    history = rng.integers(1000, 40000, size=n)
    history[-2:] = history[100:102]  # the last two tokens occurred once, long ago
    row = history[None, :].astype(np.int64)
    found = lambda source: source.find(row, np.array([n]), [int(history[-1])])[0][0]
    copy = [tuple(history[102:110].tolist())]
    assert [d.tokens for d in found(CopySource(2, 8))] == copy  # the default reaches it
    assert [d.tokens for d in found(CopySource(2, 8, window=n - 100))] == copy
    assert found(CopySource(2, 8, window=n - 101)) == []  # its first token just outside


def test_the_store_files_the_last_tokens_of_a_long_request():
    from vllm_treespec.tree.shared_suffixes import SharedSuffixes
    from vllm_treespec.vllm_glue.copy_source import FILED_TOKENS, CopySource

    source = CopySource(2, 8, SharedSuffixes(10 * FILED_TOKENS))
    source.admit({"r": "tenant"})
    source.file_finished("r", None, list(range(FILED_TOKENS + 904)))
    assert source.shared.tokens == FILED_TOKENS
