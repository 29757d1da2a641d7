"""TreeBatch invariants, derived tables, and validate()'s rejections."""

import dataclasses

import pytest
import torch
from hypothesis import given

from tests.unit.treegen import tree_batches
from vllm_treespec.tree import TreeBatch, TreeInvariantError


def naive_path(tokens_parents, i):
    _, parents = tokens_parents
    path = [i]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


@given(tree_batches())
def test_random_trees_satisfy_invariants(tree):
    tree.validate()
    T, D = tree.tree_size, tree.max_depth
    assert tree.ancestors.shape == (tree.batch_size, T, D + 1)
    # No negative index anywhere a gather could see it.
    for t in (tree.parent, tree.depth, tree.ancestors, tree.children, tree.token):
        assert int(t.min()) >= 0
    assert int(tree.ancestors.max()) < T and int(tree.children.max()) < T


@given(tree_batches())
def test_ancestor_table_is_root_to_node_path(tree):
    lists = tree.to_lists()
    for b, tl in enumerate(lists):
        for i in range(len(tl["token"])):
            path = naive_path((tl["token"], tl["parent"]), i)
            row = tree.ancestors[b, i].tolist()
            assert row[: len(path)] == path
            assert all(x == i for x in row[len(path):])
        # Padding: parent root, depth 1, path [0, self, self, ...].
        for i in range(len(tl["token"]), tree.tree_size):
            assert tree.ancestors[b, i, :2].tolist() == [0, i]


@given(tree_batches())
def test_children_tables_match_parents(tree):
    for b, tl in enumerate(tree.to_lists()):
        n = len(tl["token"])
        for p in range(tree.tree_size):
            kids = [i for i in range(1, n) if tl["parent"][i] == p]
            assert int(tree.num_children[b, p]) == len(kids)
            assert tree.children[b, p, : len(kids)].tolist() == kids
            assert bool(tree.is_leaf[b, p]) == (p < n and not kids)
            for r, i in enumerate(kids):
                assert int(tree.child_rank[b, i]) == r


@given(tree_batches())
def test_causal_exact_rows_have_a_causal_mask_row(tree):
    """A causal kernel's result is exact for these rows, and only for these."""
    from vllm_treespec.tree import tree_mask

    mask = tree_mask(tree)
    causal = torch.ones(tree.tree_size, tree.tree_size, dtype=torch.bool).tril()
    for b, tl in enumerate(tree.to_lists()):
        for i in range(len(tl["token"])):
            on_chain = naive_path((tl["token"], tl["parent"]), i) == list(range(i + 1))
            assert bool(tree.causal_exact[b, i]) == on_chain
            assert torch.equal(mask[b, i], causal[i]) == on_chain
        assert not tree.causal_exact[b, len(tl["token"]):].any()  # padding never


def test_causal_exact_of_a_chain_and_a_branch():
    chain = TreeBatch.from_parents([[5, 6, 7]], [[0, 0, 1]], tree_size=4, max_children=2)
    assert chain.causal_exact.tolist() == [[True, True, True, False]]
    branch = TreeBatch.from_parents([[5, 6, 7, 8]], [[0, 0, 0, 1]], tree_size=4,
                                    max_children=2)
    assert branch.causal_exact.tolist() == [[True, True, False, False]]


@given(tree_batches(max_nodes=10))
def test_truncation_keeps_a_valid_prefix(tree):
    cut = torch.div(tree.node_counts, 2, rounding_mode="floor")
    small = tree.truncated(cut)
    small.validate()
    assert torch.equal(small.node_counts, cut)
    for b in range(tree.batch_size):
        n = int(cut[b]) + 1
        assert torch.equal(small.token[b, :n], tree.token[b, :n])
        assert torch.equal(small.parent[b, :n], tree.parent[b, :n])


def _good():
    # root 5 -> (1: 7, 2: 8); 1 -> (3: 9); padding at 4, 5
    return TreeBatch.from_parents([[5, 7, 8, 9]], [[0, 0, 0, 1]], tree_size=6,
                                  max_depth=3, max_children=2)


def _with(tree, **fields):
    return dataclasses.replace(tree, **fields)


def _edit(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


@pytest.mark.parametrize("name, make, needle", [
    ("parent out of range",
     lambda t: _with(t, parent=_edit(t.parent, (0, 3), 9)), "outside [0, 5]"),
    ("parent after child (cycle)",
     lambda t: _with(t, parent=_edit(t.parent, (0, 2), 3),
                     depth=_edit(t.depth, (0, 2), 3)), "does not precede"),
    ("self parent",
     lambda t: _with(t, parent=_edit(t.parent, (0, 3), 3)), "does not precede"),
    ("depth inconsistent",
     lambda t: _with(t, depth=_edit(t.depth, (0, 3), 3)), "parent 1's depth"),
    ("not BFS order",
     lambda t: TreeBatch.from_parents([[5, 7, 9, 8]], [[0, 0, 1, 0]], 6, 3, 2),
     "not in BFS order"),
    ("duplicate sibling tokens",
     lambda t: _with(t, token=_edit(t.token, (0, 2), 7)), "repeats a sibling"),
    ("root with a parent",
     lambda t: _with(t, parent=_edit(t.parent, (0, 0), 1)), "root must have"),
    ("padding attached elsewhere",
     lambda t: _with(t, parent=_edit(t.parent, (0, 5), 2)), "padding must have"),
    ("node_counts beyond the slot",
     lambda t: _with(t, node_counts=torch.tensor([6])), "node_counts 6 outside"),
    ("negative token",
     lambda t: _with(t, token=_edit(t.token, (0, 1), -3)), "token -3 outside"),
    ("too many children",
     lambda t: _with(t, max_children=1), "more than max_children"),
    ("too deep",
     lambda t: _with(t, max_depth=1), "exceeds max_depth"),
    ("wrong dtype",
     lambda t: _with(t, parent=t.parent.int()), "expected int64"),
])
def test_validate_rejects_each_kind_of_malformed_tree(name, make, needle):
    _good().validate(vocab_size=10)
    bad = make(_good())
    with pytest.raises(TreeInvariantError, match="request 0") as err:
        bad.validate(vocab_size=10)
    assert needle in str(err.value), (name, str(err.value))


def test_validate_names_the_request_and_node():
    good = _good()
    two = TreeBatch.from_parents([[5, 7, 8, 9], [1, 2, 3]], [[0, 0, 0, 1], [0, 0, 1]],
                                 tree_size=6, max_depth=3, max_children=2)
    bad = _with(two, depth=_edit(two.depth, (1, 2), 5))
    with pytest.raises(TreeInvariantError) as err:
        bad.validate()
    assert err.value.request == 1 and err.value.node == 2
    good.validate()


def test_token_beyond_vocab_is_rejected():
    with pytest.raises(TreeInvariantError, match="token 9 outside"):
        _good().validate(vocab_size=9)


def test_a_node_with_more_children_than_max_children_is_refused():
    """The children table has max_children columns: a third child under a bound of
    two used to be written over the second's column (the table then named node 3
    twice and node 2 never), silently."""
    with pytest.raises(TreeInvariantError, match=r"request 1, node 3: node 0 has 3 "
                                                 r"children; allowed: at most max_children=2"):
        TreeBatch.from_parents([[5, 6], [5, 6, 7, 8]], [[0, 0], [0, 0, 0, 0]], tree_size=4,
                               max_children=2)
    wide = TreeBatch.from_parents([[5, 6, 7, 8]], [[0, 0, 0, 0]], tree_size=4)
    assert wide.max_children == 3 and wide.children[0, 0].tolist() == [1, 2, 3]
