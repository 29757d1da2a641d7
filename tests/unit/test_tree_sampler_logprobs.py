"""Logprobs of a tree step whose batch mixes what requests ask for: top logprobs
on a tree beside specific-token logprobs on a request without one (the pair that
once took the engine down), through vLLM's own ``Sampler`` and metadata."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_treespec.tree import TreeBatch  # noqa: E402
from vllm_treespec.engine.step import VerifyStep, node_rows  # noqa: E402
from vllm_treespec.vllm_glue.tree_sampler import sample_with_trees  # noqa: E402

V = 16
SPECIFIC = [11, 12, 13, 14, 15]


def _step_and_logits():
    """Request 0: a tree (root -> 1, 2, 3; 1 -> 4) on logits rows 0-4, greedy
    accepting 1 -> 4 then 11. Request 1: no tree, one row (5)."""
    tree = TreeBatch.from_parents([[9, 1, 2, 3, 4]], [[0, 0, 0, 0, 1]], tree_size=5,
                                  max_children=3)
    step = VerifyStep(req_index=torch.tensor([0]), tree=tree, prefix_len=torch.tensor([10]),
                      token_start=torch.tensor([0]), logit_start=torch.tensor([0]), num_reqs=2)
    spec_md = SimpleNamespace(num_draft_tokens=[4, 0], cu_num_sampled_tokens=torch.tensor([5, 6]))
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    logits[0, 1] = logits[1, 4] = logits[4, 11] = 9.0
    return step, spec_md, logits


def _metadata(max_num_logprobs, logprob_token_ids) -> SamplingMetadata:
    zeros = torch.zeros(2)
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=max_num_logprobs, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=zeros, presence_penalties=zeros,
        repetition_penalties=torch.ones(2), output_token_ids=[[], []],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        logprob_token_ids=logprob_token_ids)


@pytest.mark.parametrize("tree_top_logprobs", [2, None])
def test_specific_token_logprobs_beside_a_tree(tree_top_logprobs):
    """Request 1 asks logprobs of five specific tokens; request 0 (a tree) asks
    top-2 logprobs, or none. vLLM's sampler returns its specific-token layout for
    the whole batch, so the tree's rows come back in that layout too: each emitted
    token's logprob from the node row that produced it, then padding; request 1's
    row is vLLM's own. With no tree asking logprobs, request 1 still gets them."""
    step, spec_md, logits = _step_and_logits()
    md = _metadata(tree_top_logprobs, {1: SPECIFIC})
    sampler = Sampler()
    out, acc = sample_with_trees(sampler, logits, spec_md, md, step, {})
    assert out.sampled_token_ids[0].tolist() == [1, 4, 11]
    lp = out.logprobs_tensors
    assert lp is not None
    width = acc.tokens.shape[1]
    assert lp.logprobs.shape == (2 * width, len(SPECIFIC) + 1)
    # request 1: what vLLM's sampler gives a lone batch of its row
    alone = sampler.gather_specific_token_logprobs(
        logits[5:6].log_softmax(-1), {0: SPECIFIC}, out.sampled_token_ids[1, :1].long())
    assert lp.logprob_token_ids[width].tolist() == alone.logprob_token_ids[0].tolist()
    torch.testing.assert_close(lp.logprobs[width], alone.logprobs[0])
    # request 0: its node rows' logprobs at the emitted tokens
    rows = torch.gather(node_rows(step), 1, acc.path)[0]
    want = logits[rows].log_softmax(-1).gather(1, acc.tokens[0].long().unsqueeze(1))[:, 0]
    torch.testing.assert_close(lp.logprobs[:width, 0], want)
    assert lp.logprob_token_ids[:width, 0].tolist() == [1, 4, 11]
    assert bool(torch.isinf(lp.logprobs[:width, 1:]).all())
    assert lp.selected_token_ranks[:width].tolist() == [1, 1, 1]


def test_top_logprobs_of_a_tree_beside_a_request_without_logprobs():
    """The top-k layout as before: only request 0 (a tree) asks top-2 logprobs."""
    step, spec_md, logits = _step_and_logits()
    out, acc = sample_with_trees(Sampler(), logits, spec_md, _metadata(2, None), step, {})
    lp = out.logprobs_tensors
    width = acc.tokens.shape[1]
    assert lp.logprobs.shape == (2 * width, 3)
    rows = torch.gather(node_rows(step), 1, acc.path)[0]
    want = Sampler.gather_logprobs(logits[rows].log_softmax(-1), 2, acc.tokens[0].long())
    torch.testing.assert_close(lp.logprobs[:width], want.logprobs)
