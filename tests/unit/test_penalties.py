"""Penalties at the tokens they change (``tree.penalties``) against vLLM's own op
over whole rows: the same logits, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treespec.tree import TreeBatch
from vllm_treespec.tree.penalties import path_tokens, penalise_rows


@settings(deadline=None, max_examples=200)
@given(st.integers(0, 2**31 - 1), st.integers(2, 40), st.integers(1, 6), st.integers(0, 10),
       st.integers(0, 10))
def test_penalised_rows_equal_vllms_op_on_whole_rows(seed, V, N, Lp, Lo):
    vllm_utils = pytest.importorskip("vllm.model_executor.layers.utils")
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, N + 1, (1,), generator=g))
    rows = torch.randperm(N, generator=g)[:R]
    prompt = torch.randint(0, V + 1, (R, Lp), generator=g)     # V pads
    outputs = torch.randint(-1, V + 1, (R, Lo), generator=g)   # -1 and V pad
    x = torch.randn(N, V, generator=g) * 3
    x[torch.rand(N, V, generator=g) < 0.1] = float("-inf")
    x[torch.rand(N, V, generator=g) < 0.1] = 0.0
    rep = torch.rand(R, generator=g) * 2 + 0.5
    freq, pres = torch.rand(R, generator=g) * 4 - 2, torch.rand(R, generator=g) * 4 - 2
    expected = x.clone()
    whole = expected[rows].clone()
    vllm_utils.apply_penalties(whole, prompt, outputs.masked_fill(outputs < 0, V), pres, freq,
                               rep)
    expected[rows] = whole
    penalise_rows(x, rows, prompt, outputs, rep, freq, pres)
    assert torch.equal(x, expected)


def test_a_token_repeated_in_the_output_is_penalised_once_per_occurrence():
    """Frequency counts occurrences, presence and repetition apply once."""
    x = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    penalise_rows(x, torch.tensor([0]), torch.tensor([[1, 4]]), torch.tensor([[2, 2, 2, -1]]),
                  torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # token 1 (prompt): -1 * 2; token 2 (output x3): 3 / 2 - 0.5 * 3 - 0.25
    assert x.tolist() == [[2.0, -2.0, 1.5 - 1.5 - 0.25, 0.5]]


def test_path_tokens_read_each_nodes_path_below_the_root():
    tree = TreeBatch.from_parents([[9, 1, 2, 3, 4], [9, 5, 6]], [[0, 0, 0, 0, 1], [0, 0, 1]],
                                  tree_size=5, max_children=3)
    got = path_tokens(tree, pad=-7)
    for b in range(2):
        for node in range(5):
            depth = int(tree.depth[b, node])
            path = [int(tree.token[b, a]) for a in tree.ancestors[b, node, 1: depth + 1]]
            assert got[b, node].tolist() == path + [-7] * (got.shape[2] - depth)
    assert got[0, 4].tolist()[:2] == [1, 4]  # node 4 hangs under node 1
