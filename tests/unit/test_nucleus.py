"""Top-k / top-p without a sort of the vocabulary (tree/nucleus.py) against vLLM's
own ``apply_top_k_top_p``, and the inverse-CDF residual draw."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from vllm_treespec.tree import nucleus
from vllm_treespec.tree.nucleus import sample_rows, top_k_top_p_probs

V = 4096


def vllm_probs(logits, k, p):
    return torch.softmax(apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True),
                         dim=-1)


def near_boundary(logits, k, p, eps=1e-5) -> torch.Tensor:
    """[n] rows where some token's higher-ranked mass is within eps of p: there the
    two summation orders may round the boundary differently (not a disagreement)."""
    x = logits.double()
    if k is not None:
        kth = x.sort(-1, descending=True).values.gather(1, (k.long().clamp(1, V) - 1)[:, None])
        x = x.masked_fill(x < kth, -float("inf"))
    vals = torch.softmax(x, -1).sort(-1, descending=True).values
    above = vals.cumsum(-1) - vals
    if p is None:
        return torch.zeros(len(x), dtype=torch.bool)
    return ((above - p.double()[:, None]).abs() < eps).any(-1) & (p < 1)  # 1: top-p off


def rows(seed: int, n: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed logits, as a language model's: a few large, most small.
    return torch.randn(n, V, generator=g) * scale + torch.randn(n, V, generator=g).exp() * scale


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.2, 1.0, 3.0, 8.0]),
       p=st.sampled_from([None, 0.5, 0.9, 0.95, 0.999, 1.0]),
       k=st.sampled_from([None, 1, 5, 50, 1000, V]))
def test_same_distribution_as_vllm(seed, scale, p, k):
    n = 6
    x = rows(seed, n, scale)
    kt = None if k is None else torch.full((n,), k, dtype=torch.long)
    pt = None if p is None else torch.full((n,), p)
    got, want = top_k_top_p_probs(x, kt, pt), vllm_probs(x, kt, pt)
    ok = ~near_boundary(x, kt, pt)
    assert torch.equal(got[ok] > 0, want[ok] > 0)  # the same kept tokens
    torch.testing.assert_close(got[ok], want[ok], atol=1e-6, rtol=1e-4)


def test_mixed_rows_and_widening(monkeypatch):
    # Per-row k and p (off as V and 1.0, as vLLM's batch tensors carry them);
    # near-flat rows whose nucleus is far wider than the first candidates.
    monkeypatch.setattr(nucleus, "FIRST_CANDIDATES", 8)
    x = torch.cat([rows(1, 3, 0.05), rows(2, 3, 4.0)])
    k = torch.tensor([V, 7, V, 3000, V, 2])
    p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.8])
    got, want = top_k_top_p_probs(x, k, p), vllm_probs(x, k, p)
    assert not near_boundary(x, k, p).any()
    assert int((want[0] > 0).sum()) > 1000  # widened well past 8 candidates
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_a_boundary_off_by_one_is_caught():
    # Negative control: keeping tokens by the mass up to and including them
    # (instead of above them) drops each nucleus' last token, and the comparison
    # used above sees it.
    x, p = rows(3, 4, 2.0), torch.full((4,), 0.9)
    want = vllm_probs(x, None, p)
    probs = torch.softmax(x, -1)
    vals, idx = probs.sort(-1, descending=True)
    wrong = torch.zeros_like(probs, dtype=torch.bool).scatter(
        1, idx, vals.double().cumsum(-1) < 0.9)
    assert not torch.equal(wrong, want > 0)
    assert torch.equal(nucleus._nucleus(probs, p.double()), want > 0)


def test_logits_untouched():
    x = rows(4, 2, 3.0)
    before = x.clone()
    top_k_top_p_probs(x, torch.tensor([5, V]), torch.tensor([0.9, 0.5]))
    assert torch.equal(x, before)


def test_sample_rows_draws_in_proportion_and_never_a_zero():
    w = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0, 2.0]])
    n = 40000
    g = torch.Generator().manual_seed(0)
    draws = sample_rows(w.repeat(n, 1), torch.rand(2 * n, generator=g)).view(n, 2)
    first = torch.bincount(draws[:, 0], minlength=5).double() / n
    second = torch.bincount(draws[:, 1], minlength=5).double() / n
    assert set(draws[:, 0].unique().tolist()) == {1, 3}
    assert set(draws[:, 1].unique().tolist()) == {0, 4}
    assert first[3] == pytest.approx(0.75, abs=0.01)
    assert second[0] == pytest.approx(0.5, abs=0.01)
    # Edges: the largest uniform below 1 stays on the last positive entry.
    edge = sample_rows(w, torch.full((2,), 1 - 2**-24))
    assert edge.tolist() == [3, 4]
