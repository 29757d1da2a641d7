"""Tenants of the cross-request store (docs/cross-request.md, "Tenants"): who a
request's tenant is (``scheduling.attach_tenants``), that requests without a
``cache_salt`` share nothing unless asked, and that one tenant's store hits
never change how many of another tenant's copy nodes are verified
(``CopySource.lengths``). Each check has a negative control: the old behaviour
fails it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.unit.test_copy_source import FixedCostBudget
from vllm_treespec.tree.copy_drafts import COPY, OTHER, CopyDraft
from vllm_treespec.tree.shared_suffixes import SharedSuffixes
from vllm_treespec.vllm_glue import scheduling
from vllm_treespec.vllm_glue.copy_source import CopySource
from vllm_treespec.vllm_glue.scheduling import attach_tenants


def _lora(name: str, int_id: int):
    return SimpleNamespace(lora_name=name, lora_int_id=int_id, lora_path=f"/loras/{name}")


def _request(req_id: str, salt=None, lora=None):
    return SimpleNamespace(request_id=req_id, cache_salt=salt, lora_request=lora)


def _scheduled(requests, unsalted=False, known=None):
    """The tree_tenants of one schedule output whose new requests are ``requests``
    (``known``: those the scheduler still holds; default all)."""
    known = requests if known is None else known
    scheduler = SimpleNamespace(
        requests={r.request_id: r for r in known},
        schedule=lambda: SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id) for r in requests]))
    attach_tenants(scheduler, unsalted)
    return scheduler.schedule().tree_tenants


def test_the_scheduler_names_each_new_requests_tenant():
    """The tenant is (cache_salt, LoRA adapter); a request without a salt (or an
    empty one) is left out unless unsalted requests share, and so is one the
    scheduler no longer holds: the runner treats both as of unknown tenant."""
    adapter = _lora("sql", 3)
    reqs = [_request("a", "alice"), _request("l", "alice", adapter), _request("n"),
            _request("e", ""), _request("gone", "alice")]
    assert _scheduled(reqs, known=reqs[:4]) == {
        "a": ("alice", None), "l": ("alice", ("sql", 3))}
    assert _scheduled(reqs, unsalted=True, known=reqs[:4]) == {
        "a": ("alice", None), "l": ("alice", ("sql", 3)), "n": (None, None),
        "e": (None, None)}


def _served(unsalted: bool, requests, finished: dict[str, list[int]]):
    """A store fed as the engine feeds it: the scheduler names the tenants, the
    runner admits them, ``finished`` requests' outputs are filed; then each
    other request looks up "5 6". Returns {req_id: continuations found}."""
    source = CopySource(branches=2, length=4, shared=SharedSuffixes(1000, length=4))
    source.admit(_scheduled(requests, unsalted))
    for req_id, output in finished.items():
        source.file_finished(req_id, None, output)
    asking = [r.request_id for r in requests if r.request_id not in finished]
    found, _ = source.find(np.array([[3, 5, 6]] * len(asking)), np.array([3] * len(asking)),
                           [6] * len(asking), asking)
    return {r: [c.tokens for c in row] for r, row in zip(asking, found)}


@pytest.mark.parametrize("unsalted", [False, True])
def test_requests_without_a_salt_share_only_when_the_operator_asks(unsalted):
    """By default an unsalted request's output is never filed and an unsalted
    request looks nothing up; salted ones share within their salt either way.
    Negative control: with unsalted sharing on (what every engine did before
    the key existed) the unsalted requests' check fails."""
    requests = [_request("n1"), _request("n2"), _request("s1", "t"), _request("s2", "t")]
    found = _served(unsalted, requests, {"n1": [5, 6, 7, 8], "s1": [5, 6, 9, 9]})
    assert found["s2"] == [(9, 9)]
    if not unsalted:
        assert found["n2"] == []
    else:
        with pytest.raises(AssertionError):
            assert found["n2"] == []


@pytest.mark.parametrize("salt_only", [False, True])
def test_a_lora_adapter_is_part_of_the_tenant(salt_only, monkeypatch):
    """Two adapters under one salt never see each other's outputs; the same
    adapter does. Negative control: a tenant of the salt alone (as before)
    hands one adapter's text to another."""
    if salt_only:
        monkeypatch.setattr(scheduling, "tenant_of", lambda r: r.cache_salt)
    sql, chat = _lora("sql", 1), _lora("chat", 2)
    requests = [_request("sql1", "t", sql), _request("sql2", "t", sql),
                _request("chat2", "t", chat), _request("base2", "t")]
    found = _served(False, requests, {"sql1": [5, 6, 7, 8]})
    assert found["sql2"] == [(7, 8)]
    if not salt_only:
        assert found["chat2"] == [] and found["base2"] == []
    else:
        with pytest.raises(AssertionError):
            assert found["chat2"] == [] and found["base2"] == []


def _bobs_lengths(alice_hit: bool, branch_cost: float, base_nodes: int, base_chains: bool,
                  store: int = OTHER) -> list[int]:
    """Bob's kept tokens (his own copy, his store copy) in a step beside alice,
    whose store had a hit or not; ``store=COPY`` prices every copy as the
    request's own, batch-wide, as every copy was priced before."""
    source = CopySource(branches=2, length=4)  # fresh: every estimate at the prior
    bob = [CopyDraft((11, 12, 13, 14), 2, COPY), CopyDraft((7, 8, 9, 10), 4, store, "bob")]
    alice = ([CopyDraft((1, 2, 3, 4), 4, store, "alice"),
              CopyDraft((5, 6, 7, 8), 3, store, "alice")] if alice_hit else [])
    kept = source.lengths([alice, bob], FixedCostBudget(branch_cost), 2.0 + 0.5 * base_nodes,
                          base_nodes, base_chains)
    return kept[1]


@pytest.mark.parametrize("branch_cost, base_nodes, base_chains", [
    (0.0, 0, True), (0.0, 2, True), (0.3, 0, True), (0.3, 2, True), (0.3, 2, False),
    (5.0, 0, True), (5.0, 2, True)])
def test_one_tenants_store_hits_never_change_anothers_verified_copies(
        branch_cost, base_nodes, base_chains):
    """Whatever the costs and the drafted selection, bob's copy nodes are the
    same whether alice's store had a hit or not."""
    assert (_bobs_lengths(True, branch_cost, base_nodes, base_chains)
            == _bobs_lengths(False, branch_cost, base_nodes, base_chains))


@pytest.mark.parametrize("branch_cost, base_nodes, without, with_hit", [
    (0.0, 0, [2, 2], [1, 1]),   # alice's copies raise the shared threshold
    (0.3, 2, [0, 0], [2, 2]),   # alice's copies pay the branching extra bob then rides on
])
def test_the_tenant_check_fails_batch_wide_pricing(branch_cost, base_nodes, without, with_hit):
    """Negative control: priced batch-wide (every copy as one group, the old
    rule), alice's hit changes bob's verified copies, both ways."""
    assert _bobs_lengths(False, branch_cost, base_nodes, True, store=COPY) == without
    assert _bobs_lengths(True, branch_cost, base_nodes, True, store=COPY) == with_hit


def test_own_copies_price_as_without_a_store():
    """A request's own copies are priced before any store copy: the same kept
    lengths, and the same forgetting, as in a step whose stores found nothing."""
    class Threshold:
        def copy_threshold(self, q, base_gain, base_nodes, batch, branching=False):
            return 0.4, 1.0  # the prior's first token (0.5) pays, its second (0.25) not

    def step(alice_hit: bool):
        source = CopySource(branches=2, length=4)
        for _ in range(30):  # bob's own copies: never right
            source.estimates.observe(match=2, kept=1, accepted=0)
        own = source.estimates.estimates(2, 1).copy()
        copies = [[CopyDraft((1, 2), 4, OTHER, "alice")] if alice_hit else [],
                  [CopyDraft((11, 12), 2, COPY)]]
        kept = source.lengths(copies, Threshold(), 2.0, 0, True)
        return kept[1], bool(source.estimates.estimates(2, 1)[0] > own[0])

    # Priced out, bob's own copies drift back towards the prior either way (before,
    # alice's kept store copy stopped that: the step "verified some copy").
    assert step(True) == step(False) == ([0], True)
