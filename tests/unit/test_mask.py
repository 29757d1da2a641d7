"""The tree mask and leaf paths against naive definitions."""

from hypothesis import given

from tests.unit.test_tensorize import naive_path
from tests.unit.treegen import tree_batches
from vllm_treespec.tree import tree_mask


@given(tree_batches(max_nodes=14))
def test_tree_mask_is_ancestor_or_self_over_valid_nodes(tree):
    mask = tree_mask(tree)
    for b, tl in enumerate(tree.to_lists()):
        n = len(tl["token"])
        for i in range(tree.tree_size):
            if i < n:
                allowed = set(naive_path((tl["token"], tl["parent"]), i))
            else:
                allowed = {0}  # padding rows see only the root
            assert {j for j in range(tree.tree_size) if mask[b, i, j]} == allowed


@given(tree_batches())
def test_ancestors_and_leaves(tree):
    paths, is_leaf = tree.ancestors, tree.is_leaf
    for b, tl in enumerate(tree.to_lists()):
        n = len(tl["token"])
        leaves = [i for i in range(n) if i not in tl["parent"][1:]]
        assert [i for i in range(tree.tree_size) if is_leaf[b, i]] == leaves
        for i in leaves:
            path = naive_path((tl["token"], tl["parent"]), i)
            assert paths[b, i, : len(path)].tolist() == path
