"""Tree acceptance under per-node grammar masks (``VerifyStep.grammar_masks``):
each node's target distribution is the masked one vLLM's sampler would see at
that position, greedy takes the masked argmax, a draft the grammar rejects is
never accepted at T > 0, and masks shifted by one node give other answers."""

from __future__ import annotations

import torch

from vllm_treespec.engine.accept import NodeLogits, TreeSampling, accept_trees, node_probs
from vllm_treespec.engine.grammar import bitmask_width, disallowed, full_masks
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.tree import TreeBatch

V = 40  # two bitmask words, the second one partly used

GREEDY = TreeSampling(all_greedy=True)


def _allowing(rows: list[list[int] | None]) -> torch.Tensor:
    """[1, len(rows), W] bitmasks: row i allows the tokens listed (None: all)."""
    masks = full_masks(len(rows), V)
    for i, tokens in enumerate(rows):
        if tokens is not None:
            masks[i] = 0
            for t in tokens:
                masks[i, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return masks.unsqueeze(0)


def _step(masks=None):
    """Root -> 3, 5; 3 -> 7; 5 -> 33. Raw logits: the root prefers 3 then 5,
    node 3 prefers 7, node 5 prefers 33, each deepest node prefers 1."""
    tree = TreeBatch.from_parents([[0, 3, 5, 7, 33]], [[0, 0, 0, 1, 2]], tree_size=5,
                                  max_children=2)
    step = VerifyStep(req_index=torch.tensor([0]), tree=tree, prefix_len=torch.tensor([4]),
                      token_start=torch.tensor([0]), logit_start=torch.tensor([0]), num_reqs=1,
                      grammar_masks=masks)
    logits = torch.zeros(5, V)
    logits[0, 3], logits[0, 5] = 6.0, 5.0
    logits[1, 7], logits[2, 33] = 6.0, 6.0
    logits[3, 1], logits[4, 1], logits[4, 2] = 6.0, 6.0, 5.0
    return step, logits


# The grammar forbids 3 after the root and 1 after node 5 -> 33.
GRAMMAR = _allowing([[5, 9], None, None, None, [2, 8]])


def test_greedy_takes_the_masked_argmax_at_every_node():
    step, logits = _step()
    free = accept_trees(logits, step, GREEDY, {}, draw_seeded=None)
    assert free.tokens[0].tolist() == [3, 7, 1]           # no grammar: the raw argmaxes
    step, logits = _step(GRAMMAR)
    masked = accept_trees(logits, step, GREEDY, {}, draw_seeded=None)
    assert masked.tokens[0].tolist() == [5, 33, 2]        # 3 refused; bonus 1 refused, then 2


def test_masks_shifted_by_one_node_accept_otherwise():
    """Negative control: node i's mask on node i + 1's distribution is wrong."""
    step, logits = _step(torch.roll(GRAMMAR, shifts=1, dims=1))
    shifted = accept_trees(logits, step, GREEDY, {}, draw_seeded=None)
    assert shifted.tokens[0].tolist() != [5, 33, 2]


def test_node_distributions_are_the_masked_target_renormalised():
    step, logits = _step(GRAMMAR)
    sampling = TreeSampling(all_greedy=False, temperature=torch.tensor([0.8]))
    nodes = torch.arange(5)
    got = node_probs(NodeLogits(logits, step, sampling), step, sampling,
                     torch.zeros(5, dtype=torch.long), nodes)
    expected = torch.softmax((logits / 0.8).masked_fill(
        disallowed(GRAMMAR[0], V), float("-inf")), dim=-1)
    torch.testing.assert_close(got, expected)
    assert float(got[0, 3]) == 0.0 and float(got[4, 1]) == 0.0


def test_a_draft_the_grammar_rejects_is_never_accepted_at_t_above_zero():
    step, logits = _step(GRAMMAR)
    sampling = TreeSampling(all_greedy=False, temperature=torch.tensor([1.0]))
    firsts = set()
    for seed in range(200):
        torch.manual_seed(seed)
        acc = accept_trees(logits, step, sampling, {}, draw_seeded=None)
        first = int(acc.tokens[0, 0])
        firsts.add(first)
        assert first in (5, 9)  # what the root's mask allows, 3 never
        if int(acc.num_accepted[0]) == 2:
            assert int(acc.tokens[0, 2]) in (2, 8)  # the bonus under node 33's mask
    assert firsts == {5, 9}
    # Control: without the grammar the raw favourite 3 is drawn.
    step, logits = _step()
    drawn = set()
    for seed in range(50):
        torch.manual_seed(seed)
        drawn.add(int(accept_trees(logits, step, sampling, {}, None).tokens[0, 0]))
    assert 3 in drawn


def test_bitmask_rows_cover_the_vocabulary():
    assert bitmask_width(V) == 2 and GRAMMAR.shape == (1, 5, 2)
    assert disallowed(GRAMMAR[0], V)[0].sum() == V - 2
