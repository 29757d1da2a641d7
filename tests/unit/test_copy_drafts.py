"""Copy drafts: continuations found in a request's own history, grafted into its tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treespec.tree import TreeBatch
from vllm_treespec.tree.copy_drafts import (
    BOTH, COPY, EAGLE, CopyDraft, Grafted, accepted_along, copy_continuations, graft, prune)


def test_the_continuation_after_the_last_match_is_found():
    #          0  1  2  3  4  5  6  7  8  9
    history = [5, 6, 7, 8, 9, 1, 2, 6, 7]  # ends with "6 7": it came before, then "8 9 1"
    (found,) = copy_continuations(history, max_ngram=3, min_ngram=2, length=3, max_branches=2)
    assert found == CopyDraft((8, 9, 1), 2)


def test_longer_matches_come_first_then_more_recent_ones():
    history = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    found = copy_continuations(history, max_ngram=3, min_ngram=2, length=2, max_branches=3)
    # "1 2 3" matched at 0 (-> 40 9); "2 3" at 5 (-> 50 1), then at 1 (-> 40 9: a duplicate).
    assert found == [CopyDraft((40, 9), 3), CopyDraft((50, 1), 2)]


def test_no_repeat_no_copies():
    assert copy_continuations(list(range(50)), max_ngram=4, min_ngram=1) == []
    assert copy_continuations([7], max_ngram=3, min_ngram=1) == []


def test_a_continuation_that_extends_a_kept_one_replaces_it():
    # "3 4" is followed by "5" at its latest occurrence (cut by the end) and by "5 6"
    # earlier: the longer one carries the shorter one's information.
    history = [3, 4, 5, 6, 0, 3, 4, 5, 3, 4]
    found = copy_continuations(history, max_ngram=2, min_ngram=2, length=2, max_branches=2)
    assert found == [CopyDraft((5, 3), 2), CopyDraft((5, 6), 2)]


def sliding_window_continuations(h, max_ngram, min_ngram, length, max_branches, max_matches):
    """The search spelled out: every n-token window compared with the last n,
    the ``max_matches`` most recent matching windows of each n read."""
    h = np.asarray(h, dtype=np.int64)
    out = []
    for n in range(min(max_ngram, len(h) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
        for s in np.flatnonzero((windows == h[-n:]).all(axis=1))[::-1][:max_matches]:
            cont = tuple(int(t) for t in h[s + n: s + n + length])
            if any(k.tokens[:len(cont)] == cont for k in out):
                continue
            out = [k for k in out if cont[:len(k.tokens)] != k.tokens]
            out.append(CopyDraft(cont, n))
            if len(out) == max_branches:
                return out
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 5),
       st.integers(1, 6), st.integers(1, 4), st.sampled_from([1, 3, 32]))
def test_the_search_finds_what_every_window_compared_finds(h, a, b, length, branches,
                                                           matches):
    # A 4-token alphabet: histories full of repeats, overlapping and nested matches.
    lo, hi = min(a, b), max(a, b)
    assert copy_continuations(h, hi, lo, length, branches, matches) == \
        sliding_window_continuations(h, hi, lo, length, branches, matches)


def test_only_the_most_recent_matches_are_read():
    # "7 8" follows "1 2" once, long ago; "9 9" follows it 40 times since.
    h = [1, 2, 7, 8] + [5, 1, 2, 9, 9] * 40 + [1, 2]
    assert [d.tokens for d in copy_continuations(h, 2, 2, 2, 2, max_matches=41)] == \
        [(9, 9), (7, 8)]
    assert [d.tokens for d in copy_continuations(h, 2, 2, 2, 2)] == [(9, 9)]


def test_bad_ngram_bounds_are_refused_by_name():
    with pytest.raises(ValueError, match="min_ngram=3 and max_ngram=2"):
        copy_continuations([1, 2, 3], max_ngram=2, min_ngram=3)


def test_a_copy_follows_matching_drafted_nodes_and_adds_the_rest():
    # Drafted: root -> 10 (1) -> 11 (3); root -> 20 (2).
    tokens, parents = [10, 20, 11], [0, 0, 1]
    out = graft(tokens, parents, [CopyDraft((10, 12, 13), 2)], max_nodes=8, max_children=4)
    # 10 is shared; 12 becomes 10's second child, 13 its child.
    assert tuple(out) == ([10, 20, 11, 12, 13], [0, 0, 1, 1, 4], [BOTH, EAGLE, EAGLE, COPY, COPY])
    assert out.branches == [[1, 4, 5]]


def test_grafting_stops_at_the_node_and_child_budgets():
    tokens, parents = [10, 20], [0, 0]
    assert graft(tokens, parents, [CopyDraft((30, 31), 2)], max_nodes=3, max_children=4).tokens \
        == [10, 20, 30]
    assert graft(tokens, parents, [CopyDraft((30, 31), 2)], max_nodes=8, max_children=2).tokens \
        == [10, 20]
    assert graft(tokens, parents, [CopyDraft((10, 31), 2)], max_nodes=8, max_children=2).tokens \
        == [10, 20, 31]


@st.composite
def drafted_trees(draw):
    n = draw(st.integers(0, 12))
    parents, tokens, kids = [], [], {0: set()}
    depth = {0: 0}
    for i in range(1, n + 1):
        # BFS: a parent at the deepest level so far or the one before it.
        candidates = [p for p in range(i) if depth[p] >= max(depth.values()) - 1
                      and len(kids[p]) < 3]
        if not candidates:
            break
        p = draw(st.sampled_from(candidates))
        t = draw(st.integers(0, 5).filter(lambda x, p=p: x not in kids[p]))
        parents.append(p), tokens.append(t)
        kids[p].add(t), kids.setdefault(i, set())
        depth[i] = depth[p] + 1
    order = sorted(range(1, len(tokens) + 1), key=lambda i: depth[i])  # BFS order
    index = {0: 0, **{old: k + 1 for k, old in enumerate(order)}}
    return [tokens[i - 1] for i in order], [index[parents[i - 1]] for i in order]


@settings(max_examples=200, deadline=None)
@given(drafted_trees(), st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5),
                                 max_size=3), st.integers(1, 20), st.integers(1, 4))
def test_grafted_trees_are_valid_and_keep_every_drafted_path(tree, copies, max_nodes,
                                                             max_children):
    tokens, parents = tree
    max_children = max([max_children] + [parents.count(p) for p in set(parents)])
    out_tokens, out_parents, source = graft(
        tokens, parents, [CopyDraft(tuple(c), 2) for c in copies],
        max_nodes=max(max_nodes, len(tokens)), max_children=max_children)
    batch = TreeBatch.from_parents([[99] + out_tokens], [[0] + out_parents],
                                   tree_size=1 + max(len(out_tokens), 1),
                                   max_children=max_children)
    batch.validate()  # BFS order, distinct siblings, the child bound

    def paths(toks, pars):
        out = []
        for i in range(len(toks)):
            path, j = [], i + 1
            while j:
                path.append(toks[j - 1])
                j = pars[j - 1]
            out.append(tuple(reversed(path)))
        return out

    got = paths(out_tokens, out_parents)
    assert set(paths(tokens, parents)) <= set(got)  # every drafted path survives
    assert len(set(got)) == len(got)                # no path verified twice
    assert len(out_tokens) <= max(max_nodes, len(tokens))
    for p, s in zip(got, source):
        assert s & EAGLE == (EAGLE if p in set(paths(tokens, parents)) else 0)
        assert bool(s & COPY) == any(tuple(c[:len(p)]) == p for c in copies)


@settings(max_examples=100, deadline=None)
@given(drafted_trees(), st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5),
                                 min_size=1, max_size=3), st.data())
def test_each_branch_lists_the_nodes_of_its_kept_tokens(tree, copies, data):
    tokens, parents = tree
    lengths = [data.draw(st.integers(0, len(c))) for c in copies]
    out = graft(tokens, parents, [CopyDraft(tuple(c), 2) for c in copies], max_nodes=40,
                max_children=12, lengths=lengths)
    for copy, keep, nodes in zip(copies, lengths, out.branches):
        assert len(nodes) == keep  # budgets this wide never cut a copy
        node_parent = 0
        for t, node in zip(copy, nodes):
            assert out.parents[node - 1] == node_parent and out.tokens[node - 1] == t
            assert out.sources[node - 1] & COPY
            node_parent = node


def test_accepted_along_counts_the_walked_part_of_a_branch():
    assert accepted_along([1, 4, 5], [1, 4, 5]) == 3
    assert accepted_along([1, 4], [1, 4, 5]) == 2
    assert accepted_along([2, 6], [1, 4, 5]) == 0
    assert accepted_along([], [1]) == 0


def test_a_full_tree_makes_room_for_a_likelier_copy():
    # Drafted (full at 4 nodes): root -> 10 (0.9) -> 11 (0.2); root -> 20 (0.3) -> 21 (0.1).
    tokens, parents = [10, 20, 11, 21], [0, 0, 1, 2]
    g = graft(tokens, parents, [CopyDraft((30, 31), 4)], max_nodes=6, max_children=4)
    # BFS: 10, 20, 30 | 11, 21, 31. The copy's estimates beat the weak drafts.
    values = [0.9, 0.3, 0.8, 0.2, 0.1, 0.7]
    out, kept = prune(g, values, max_nodes=4)
    assert tuple(out) == ([10, 20, 30, 31], [0, 0, 0, 3], [EAGLE, EAGLE, COPY, COPY])
    assert kept == [1, 2, 3, 6] and out.branches == [[3, 4]]
    # A child valued above its parent is kept only with it (values are capped).
    out, _ = prune(g, [0.9, 0.3, 0.05, 0.2, 0.1, 0.7], max_nodes=4)
    assert out.tokens == [10, 20, 11, 21]


@settings(max_examples=200, deadline=None)
@given(drafted_trees(), st.data())
def test_pruned_trees_are_subtrees_of_the_most_valuable_nodes(tree, data):
    tokens, parents = tree
    n = len(tokens)
    values = data.draw(st.lists(st.floats(0, 1), min_size=n, max_size=n))
    keep = data.draw(st.integers(0, n + 1))
    g = Grafted(tokens, parents, [EAGLE] * n, [])
    out, kept = prune(g, values, keep)
    assert len(kept) == min(n, keep) and kept == sorted(kept)
    if out.tokens:
        TreeBatch.from_parents([[99] + out.tokens], [[0] + out.parents],
                               tree_size=1 + len(out.tokens), max_children=3).validate()
    for old, new_parent in zip(kept, out.parents):  # each kept node's parent is kept
        assert new_parent == 0 or kept[new_parent - 1] == parents[old - 1]
    # Nothing dropped is worth more than something kept, once capped at its parent.
    capped = [float("inf")] + [0.0] * n
    for i in range(1, n + 1):
        capped[i] = min(values[i - 1], capped[parents[i - 1]])
    dropped = [capped[i] for i in range(1, n + 1) if i not in kept]
    assert not dropped or not kept or max(dropped) <= min(capped[i] for i in kept)
