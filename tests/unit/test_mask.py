"""Masks, positions and slots against naive definitions."""

import torch
from hypothesis import given

from tests.unit.test_tensorize import naive_path
from tests.unit.treegen import tree_batches
from vllm_treespec.tree import (
    ancestor_bitmask,
    bitmask_to_mask,
    tree_mask,
    tree_positions,
)


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


@given(tree_batches(max_nodes=14))
def test_mask_forms_agree(tree):
    m = tree_mask(tree)
    assert torch.equal(bitmask_to_mask(ancestor_bitmask(tree), tree.tree_size), m)


def test_bitmask_uses_all_64_bits_and_several_words():
    from vllm_treespec.tree import TreeBatch
    # A chain of 70 nodes: row 69 sees every node 0..69 (bit 63 = the sign bit).
    n = 70
    tree = TreeBatch.from_parents([list(range(n))], [[0] + list(range(n - 1))],
                                  tree_size=n)
    bits = ancestor_bitmask(tree)
    assert bits.shape == (1, n, 2)
    assert int(bits[0, 69, 0]) == -1  # all 64 bits set
    assert int(bits[0, 69, 1]) == (1 << 6) - 1
    assert torch.equal(bitmask_to_mask(bits, n), tree_mask(tree))


@given(tree_batches())
def test_positions_are_depth_based(tree):
    prefix = torch.arange(tree.batch_size) * 17 + 3
    pos = tree_positions(tree, prefix)
    for b in range(tree.batch_size):
        assert pos[b].tolist() == [int(prefix[b]) + int(d) for d in tree.depth[b]]


@given(tree_batches())
def test_leaf_paths(tree):
    paths, is_leaf = tree.ancestors, tree.is_leaf
    for b, tl in enumerate(tree.to_lists()):
        n = len(tl["token"])
        leaves = [i for i in range(n) if i not in tl["parent"][1:]]
        assert [i for i in range(tree.tree_size) if is_leaf[b, i]] == leaves
        for i in leaves:
            path = naive_path((tl["token"], tl["parent"]), i)
            assert paths[b, i, : len(path)].tolist() == path
