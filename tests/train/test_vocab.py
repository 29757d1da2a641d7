"""Draft vocabulary: selection by frequency and the d2t/t2d mapping vLLM reads."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_treespec.train.vocab import coverage, mapping, select_vocab


@st.composite
def vocab_subsets(draw):
    vocab = draw(st.integers(2, 400))
    ids = draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=vocab))
    return vocab, np.array(sorted(ids), np.int64)


@given(vocab_subsets())
def test_d2t_maps_every_draft_id_to_its_target_id(case):
    vocab, ids = case
    d2t, t2d = mapping(ids, vocab)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert t2d.shape == (vocab,) and d2t.shape == (len(ids),)
    # vLLM: target = draft + d2t[draft]
    assert torch.equal(torch.arange(len(ids)) + d2t, torch.as_tensor(ids))
    assert int(t2d.sum()) == len(ids)
    assert bool(t2d[torch.as_tensor(ids)].all())


@given(vocab_subsets(), st.integers(0, 2**31 - 1))
def test_vllm_style_logit_scatter_keeps_the_draft_argmax(case, seed):
    """``Eagle3LlamaForCausalLM.compute_logits`` scatters draft logits to
    ``arange + d2t`` in a -inf target-vocab row; the argmax must be the mapped draft argmax."""
    vocab, ids = case
    d2t, _ = mapping(ids, vocab)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, len(ids), generator=g)
    full = torch.full((3, vocab), float("-inf"))
    full[:, torch.arange(len(ids)) + d2t] = logits
    assert torch.equal(full.argmax(-1), torch.as_tensor(ids)[logits.argmax(-1)])


def test_mapping_rejects_unsorted_ids():
    with pytest.raises(ValueError):
        mapping(np.array([3, 1, 2]), 10)


@given(st.lists(st.integers(0, 50), min_size=5, max_size=200), st.integers(1, 5),
       st.lists(st.integers(0, 4), max_size=2))
def test_select_vocab_takes_the_most_frequent(counts, size, always):
    resp = np.asarray(counts, np.int64)
    size = min(size, len(resp))
    ids = select_vocab(resp, np.zeros_like(resp), None, size, always=always)
    assert len(ids) == size and np.all(np.diff(ids) > 0)
    kept = [a for a in dict.fromkeys(always) if a < len(resp)][:size]
    assert set(kept) <= set(ids.tolist())
    free = [i for i in ids.tolist() if i not in kept]
    others = np.setdiff1d(np.arange(len(resp)), ids)
    if free and len(others):
        assert resp[free].min() >= resp[others].max()


def test_prompt_and_corpus_counts_only_break_ties():
    resp = np.array([5, 0, 0, 3, 0], np.int64)
    prompt = np.array([0, 100, 0, 0, 0], np.int64)
    corpus = np.array([0, 0, 100, 0, 0], np.int64)
    ids = select_vocab(resp, prompt, corpus, 4)
    assert ids.tolist() == [0, 1, 2, 3]  # response tokens first, then prompt/corpus ranked ones
    assert coverage(resp, ids) == 1.0
    assert select_vocab(resp, prompt, corpus, 2).tolist() == [0, 3]
