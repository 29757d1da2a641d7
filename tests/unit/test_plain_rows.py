"""Rows without a tree in a tree step get the tokens vLLM's whole sampler gives them.

``plain_rows.sample_rows_without_tree`` runs vLLM's processing on every row and
its draw on the rows without a tree only. Against the installed vLLM's
``Sampler`` on the whole batch (real metadata: greedy and sampled rows, top-k,
top-p, penalties, seeded generators), the rows without a tree must come out the
same token for token (and with their raw logprobs), and the draw must see only
those rows.
"""

from __future__ import annotations

import torch
from torch import nn

import vllm._custom_ops  # noqa: F401 -- the CPU sampler's kernels
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm_treespec.vllm_glue.plain_rows import needs_whole_sampler, sample_rows_without_tree

V = 257
TEMPERATURE = [0.0, 0.8, 1.0, 0.7, 0.0, 1.0]
TOP_K = [V, 20, V, 5, V, V]
TOP_P = [1.0, 0.9, 1.0, 1.0, 1.0, 0.8]
SEEDS = {1: 11, 2: 12, 3: 13, 5: 15}  # every sampled row seeded: its draw is reproducible


def _metadata(seeds: dict[int, int], penalised: bool, logprobs: int | None = None
              ) -> SamplingMetadata:
    n = len(TEMPERATURE)
    rep = torch.tensor([1.3 if penalised and b % 2 else 1.0 for b in range(n)])
    return SamplingMetadata(
        temperature=torch.tensor(TEMPERATURE), all_greedy=False, all_random=False,
        top_p=torch.tensor(TOP_P), top_k=torch.tensor(TOP_K, dtype=torch.int32),
        generators={b: torch.Generator().manual_seed(s) for b, s in seeds.items()},
        max_num_logprobs=logprobs, no_penalties=not penalised,
        prompt_token_ids=torch.randint(0, V, (n, 6), generator=torch.Generator().manual_seed(1)),
        frequency_penalties=torch.full((n,), 0.2 if penalised else 0.0),
        presence_penalties=torch.zeros(n), repetition_penalties=rep,
        output_token_ids=[[b, b + 1, 7] for b in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def _logits() -> torch.Tensor:
    return torch.randn(len(TEMPERATURE), V, generator=torch.Generator().manual_seed(0)) / 2


class _CountingOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.rows = op, []

    def forward(self, logits, generators, k, p):
        self.rows.append((logits.shape[0], k is None, p is None))
        return self.op(logits, generators, k, p)


def test_rows_without_a_tree_sample_what_the_whole_batch_sampler_samples():
    for penalised in (False, True):
        whole = Sampler()(_logits(), _metadata(SEEDS, penalised)).sampled_token_ids.view(-1)
        for without in ([0, 1, 3, 5], [2, 4], [1], [0, 4]):
            rows = torch.tensor(without)
            got = sample_rows_without_tree(Sampler(), _logits(), _metadata(SEEDS, penalised), rows)
            assert got.sampled_token_ids.view(-1)[rows].tolist() == whole[rows].tolist()
    # The equality is not a constant: other seeds draw other tokens for the sampled rows.
    other = {b: s + 100 for b, s in SEEDS.items()}
    rows = torch.tensor([1, 2, 3, 5])
    a = sample_rows_without_tree(Sampler(), _logits(), _metadata(SEEDS, False), rows)
    b = sample_rows_without_tree(Sampler(), _logits(), _metadata(other, False), rows)
    assert a.sampled_token_ids.view(-1)[rows].tolist() != b.sampled_token_ids.view(-1)[rows].tolist()


def test_their_raw_logprobs_are_the_whole_sampler_s():
    for mode in ("raw_logprobs", "raw_logits"):
        whole = Sampler(logprobs_mode=mode)(_logits(), _metadata(SEEDS, True, logprobs=3))
        rows = torch.tensor([0, 1, 3])
        got = sample_rows_without_tree(Sampler(logprobs_mode=mode), _logits(),
                                       _metadata(SEEDS, True, logprobs=3), rows)
        for a, b in zip(got.logprobs_tensors[:3], whole.logprobs_tensors[:3]):
            assert torch.equal(a[rows], b[rows]), mode
    sampler = Sampler(logprobs_mode="processed_logprobs")
    assert needs_whole_sampler(sampler, _metadata(SEEDS, False, logprobs=3))
    assert not needs_whole_sampler(Sampler(), _metadata(SEEDS, False, logprobs=3))
    assert needs_whole_sampler(Sampler(), _metadata(SEEDS, False, logprobs=-1))


def test_the_draw_sees_only_the_sampled_rows_without_a_tree():
    sampler = Sampler()
    sampler.topk_topp_sampler = counting = _CountingOp(sampler.topk_topp_sampler)
    # Rows 2 and 3 sampled, without top-p: no sort of the vocabulary for them.
    sample_rows_without_tree(sampler, _logits(), _metadata(SEEDS, False), torch.tensor([0, 2, 3]))
    # Greedy rows only: no draw at all.
    sample_rows_without_tree(sampler, _logits(), _metadata(SEEDS, False), torch.tensor([0, 4]))
    assert counting.rows == [(2, False, True)]
