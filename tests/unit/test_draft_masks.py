"""Drafting under a grammar (``engine.draft_masks``): the real dynamic tree
builder fed random drafter scores, masked by a real xgrammar matcher of a JSON
schema (the embedded target's tokenizer). With masks every drafted node is one
the grammar allows; without them (the control) the same scores draft nodes it
rejects. A row without a matcher drafts exactly what it did unmasked."""

from __future__ import annotations

import pytest
import torch

from vllm_treespec.engine.draft_masks import DraftMasks, fill_after, masked_logprobs
from vllm_treespec.engine.grammar import full_masks, walk_tree
from vllm_treespec.tree import DynamicTreeBuilder

xgr = pytest.importorskip("xgrammar")

from tests.unit.test_grammar_tree import g, matcher_at_root, state  # noqa: E402,F401


def test_masked_logprobs_renormalise_over_the_allowed_draft_tokens():
    V = 70
    masks = full_masks(2, V)
    masks[0] = 0
    masks[0, 0] = 0b1010  # tokens 1 and 3 allowed in row 0
    masks[1] = 0          # row 1 allows nothing
    token_map = torch.tensor([3, 1, 5, 69])  # draft ids -> target ids
    logprobs = torch.log_softmax(torch.randn(2, 4), dim=-1)
    out = masked_logprobs(logprobs, masks, V, token_map)
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    assert torch.allclose(out[0, :2].exp().sum(), torch.tensor(1.0))
    assert torch.allclose(out[0, 0] - out[0, 1], logprobs[0, 0] - logprobs[0, 1])
    assert torch.isneginf(out[1]).all()  # no NaN where nothing is allowed


def test_both_unpackings_of_a_bitmask_agree():
    from vllm_treespec.engine.grammar import _disallowed_by_shifts, disallowed

    masks = torch.randint(-2**31, 2**31 - 1, (5, 7), dtype=torch.int32)
    for vocab in (200, 224, 300):  # inside, at and past the bitmask's 32 W
        assert torch.equal(disallowed(masks, vocab), _disallowed_by_shifts(masks, vocab))


def test_fill_after_leaves_the_matcher_where_it_was(g):
    m = matcher_at_root(g)
    before = state(m, g.V)
    rows = full_masks(2, g.V)
    fill_after(m, g.answer[1:4], rows, 0)
    fill_after(m, [g.stop], rows, 1)  # a path the grammar rejects: nothing allowed
    assert state(m, g.V) == before
    assert rows[0].any() and not rows[1].any()


def grow(builder, masks, B, V, depth, seed):
    """The proposer's drafting loop with random drafter scores, each batch row's
    drawn from its own generator (a row scores the same in any batch)."""
    gens = [torch.Generator().manual_seed(seed + 1000 * b) for b in range(B)]

    def scores(*shape):
        return torch.log_softmax(torch.stack([torch.randn(*shape, V, generator=g)
                                              for g in gens]), -1)

    lp = scores()
    level = builder.first_level(masks.root(lp) if masks else lp)
    while not builder.done:
        F = level.tokens.shape[1]
        lp = scores(F)
        if masks:
            lp = masks.level(builder, level.node_id[:, :F], lp)
        level = builder.next_level(lp)
    return builder.finish(torch.zeros(B, dtype=torch.long))


def drafted(trees, b):
    n = int(trees.node_counts[b])
    return trees.token[b, 1:1 + n].tolist(), trees.parent[b, 1:1 + n].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_every_masked_draft_is_one_the_grammar_allows(g, seed):
    B, depth, k, M = 2, 4, 4, 12

    def build(masks):
        return grow(DynamicTreeBuilder(B, k, depth, M), masks, B, g.V, depth, seed)

    m = matcher_at_root(g)
    masks = DraftMasks([m, None], g.V, None)
    trees = build(masks)
    assert masks.masked_nodes > 0
    tokens, parents = drafted(trees, 0)
    walk = walk_tree(m, tokens, parents, g.V)
    assert len(tokens) == M and all(walk.valid), walk.valid
    # A batch of the masked row alone (every row under a grammar) drafts the same tree.
    alone = grow(DynamicTreeBuilder(1, k, depth, M), DraftMasks([m], g.V, None), 1, g.V,
                 depth, seed)
    assert drafted(alone, 0) == (tokens, parents)
    # Row 1 (no matcher) drafts what it drafts unmasked, bit for bit.
    plain = build(None)
    assert drafted(trees, 1) == drafted(plain, 1)
    # The control: unmasked, the same scores draft nodes the grammar rejects.
    walk = walk_tree(m, *drafted(plain, 0), g.V)
    assert not all(walk.valid)

