"""The cross-request store of finished outputs (``tree.shared_suffixes``): what it
proposes really followed the request's last tokens in its own tenant's outputs,
it holds at most its bound, a lookup reads a bounded number of occurrences, and
tenants never see each other's text (with a control that fails without it)."""

from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treespec.tree import shared_suffixes
from vllm_treespec.tree.shared_suffixes import SharedSuffixes

tokens = st.lists(st.integers(0, 5), min_size=0, max_size=40)  # few symbols: many matches
outputs = st.lists(st.tuples(st.sampled_from(["a", "b", None]), tokens), max_size=12)


def _followed(docs, history, cont, n) -> bool:
    """Whether ``cont`` followed the last ``n`` tokens of ``history`` in some doc."""
    key = list(history[-n:])
    for doc in docs:
        for end in range(n - 1, len(doc) - 1):
            if doc[end - n + 1: end + 1] == key and tuple(doc[end + 1: end + 1 + len(cont)]) == cont:
                return True
    return False


def _colliding_keys(ngram):
    """Every n-gram's key the same: each lookup meets every occurrence."""
    return 0


@settings(max_examples=200, deadline=None)
@given(outputs, tokens, st.integers(8, 120), st.integers(1, 4), st.booleans())
def test_what_it_proposes_followed_the_match_in_the_tenants_own_outputs(outs, history, bound,
                                                                         branches, collide):
    """Also where every key collides: a lookup checks the stored tokens."""
    with mock.patch.object(shared_suffixes, "ngram_key",
                           _colliding_keys if collide else shared_suffixes.ngram_key):
        _check_proposals(outs, history, bound, branches)


def _check_proposals(outs, history, bound, branches):
    store = SharedSuffixes(max_tokens=bound, length=6, per_key=4)
    for tenant, doc in outs:
        store.add(tenant, doc)
    assert store.tokens <= bound
    held = {}  # what the store still holds per tenant: the newest outputs within the bound
    room = bound
    for tenant, doc in reversed(outs):
        doc = doc[-bound:]
        if len(doc) < 3:  # no 2-gram with a token after it: not stored
            continue
        if len(doc) > room:
            break
        held.setdefault(tenant, []).append(doc)
        room -= len(doc)
    assert store.tokens == bound - room
    for tenant in ("a", "b", None):
        found = store.find(tenant, history, branches)
        assert len(found) <= branches
        assert store.examined <= 3 * store.per_key  # n = 4, 3, 2: bounded, whatever the size
        for draft in found:
            assert 1 <= len(draft.tokens) <= 6 and 2 <= draft.match <= 4
            assert _followed(held.get(tenant, []), history, draft.tokens, draft.match), (
                tenant, draft)
        # distinct branches: none a prefix of another
        for i, x in enumerate(found):
            for y in found[i + 1:]:
                assert x.tokens[:len(y.tokens)] != y.tokens and y.tokens[:len(x.tokens)] != x.tokens


def test_the_most_frequent_continuation_ranks_first_then_the_most_recent():
    store = SharedSuffixes(max_tokens=1000, length=3)
    store.add(None, [1, 2, 3, 7, 7, 7])
    store.add(None, [1, 2, 3, 8, 8, 8])
    store.add(None, [1, 2, 3, 7, 7, 7])
    store.add(None, [9, 2, 3, 5, 5])       # matches "2 3" only (n = 2)
    found = store.find(None, [4, 1, 2, 3], max_branches=3)
    assert [(d.tokens, d.match) for d in found] == [((7, 7, 7), 3), ((8, 8, 8), 3),
                                                     ((5, 5), 2)]
    assert store.hits == 1 and store.lookups == 1


def test_the_oldest_output_goes_first_and_leaves_no_trace_in_the_index():
    store = SharedSuffixes(max_tokens=10)
    store.add("t", [1, 2, 3, 4, 5, 6])
    assert store.find("t", [1, 2], 1)[0].tokens == (3, 4, 5, 6)
    store.add("t", [7, 8, 9, 10, 11])  # 6 + 5 > 10: the first goes
    assert store.tokens == 5 and store.find("t", [1, 2], 1) == []
    assert all(e >> 32 != 0 for seen in store._index["t"].values() for e in seen)
    store.add("u", list(range(100, 130)))  # longer than the bound: its last 10 kept
    assert store.tokens == 10 and "t" not in store._index
    assert store.find("u", [120, 121], 1)[0].tokens == (122, 123, 124, 125, 126, 127, 128, 129)


def test_outputs_too_short_to_index_are_not_stored():
    """An output with no n-gram followed by a token is not kept (nothing could be
    found in it); it used to leave its tenant's index to be evicted twice."""
    store = SharedSuffixes(max_tokens=4)
    store.add("t", [1, 2])
    store.add("t", [5, 6])
    store.add("u", [7, 8, 9])
    assert store.tokens == 3 and list(store._index) == ["u"]
    store.add("t", [1, 2, 3])
    store.add("t", [4, 5])
    store.add("u", [6, 7, 8])  # evicts t's only output
    assert store.tokens == 3 and list(store._index) == ["u"]


def test_tenants_never_see_each_others_outputs():
    store = SharedSuffixes(max_tokens=100)
    store.add("alice", [1, 2, 3, 4, 5])
    store.add(None, [1, 2, 6, 6, 6])
    assert store.find("alice", [1, 2], 2)[0].tokens == (3, 4, 5)
    assert [d.tokens for d in store.find("bob", [1, 2], 2)] == []
    assert [d.tokens for d in store.find(None, [1, 2], 2)] == [(6, 6, 6)]  # none matches none


def test_the_isolation_check_fails_a_store_that_shares_across_tenants():
    """Negative control: a store that files every output under one tenant leaks
    alice's text to bob, and the check above catches it."""

    class Shared(SharedSuffixes):
        def add(self, tenant, tokens):
            super().add("everyone", tokens)

        def find(self, tenant, history, max_branches):
            return super().find("everyone", history, max_branches)

    store = Shared(max_tokens=100)
    store.add("alice", [1, 2, 3, 4, 5])
    with pytest.raises(AssertionError):
        assert [d.tokens for d in store.find("bob", [1, 2], 2)] == []


def test_the_collision_check_is_what_keeps_colliding_keys_honest():
    """Negative control: without the check of the stored tokens, colliding keys
    propose what followed another n-gram, and the property above catches it."""

    class Unchecked(SharedSuffixes):
        def _ranked(self, seen, ngram):
            return super()._ranked(seen, ())

    with mock.patch.object(shared_suffixes, "ngram_key", _colliding_keys):
        store = Unchecked(max_tokens=100, length=2)
        store.add(None, [1, 2, 3, 9, 9])
        found = store.find(None, [7, 8], 1)
        assert found and not _followed([[1, 2, 3, 9, 9]], [7, 8], found[0].tokens,
                                        found[0].match)


def test_keys_are_the_same_in_every_process():
    """Tensor-parallel ranks and restarted workers must key alike: no per-process salt."""
    import os
    import subprocess
    import sys

    code = "from vllm_treespec.tree.shared_suffixes import ngram_key; print(ngram_key((5, 6, 7)))"
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2")}
    assert keys == {f"{shared_suffixes.ngram_key((5, 6, 7))}\n"}


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=10, per_key=0),
                                    dict(max_tokens=10, min_ngram=3, max_ngram=2)])
def test_bad_bounds_are_refused_by_name(kwargs):
    with pytest.raises(ValueError, match="shared suffixes: max_tokens="):
        SharedSuffixes(**kwargs)
