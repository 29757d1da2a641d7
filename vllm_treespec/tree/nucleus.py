"""Top-k / top-p (nucleus) distributions and residual draws without sorting the vocabulary.

vLLM's CPU sampler finds a top-p nucleus by sorting the whole row (49152 tokens),
and draws a sample from Exp(1) noise over the whole vocabulary; both cost
milliseconds a row on the CPU. Plain decoding pays that once per token; a
sampled tree step pays it for every node its acceptance walk visits, which made
the accept stage a large share of a sampled step at 16 requests. The nucleus is
almost always a few dozen tokens, so here it is found among the row's largest
entries (``topk``, far cheaper than the sort), widening the candidates only for
rows whose nucleus is not inside them yet, and the bonus token is drawn by
inverse CDF from one uniform. Timings: benchmarks/history/RESULTS-history.md,
"Sampled requests on the AVX-512 machine: a sampled step without a sort of the
vocabulary; `eagle3_tree` 1.38x to 1.72x plain at batch 1 (T 0.7) where stock
`eagle3` loses, 0.83x to 1.13x at 16 requests (2026-11-28, evening and night)".

Same sets and distributions as vLLM's rule (``apply_top_k_top_p``: top-k keeps
every logit >= the k-th largest; top-p then drops the smallest tokens whose
cumulative probability, in ascending order, is <= 1 - p, always keeping the
largest): a token is kept by top-p iff the probability mass ranked above it is <
p. The sums are taken in another order (descending, float64), so a boundary
within rounding of p may fall the other way, as vLLM's own kernels differ between
batch sizes on an accelerator. Callers that must reproduce vLLM's sampler bit
for bit (seeded requests) keep vLLM's function.

Pure torch; no vLLM import.
"""

from __future__ import annotations

import torch

FIRST_CANDIDATES = 64  # the nucleus of a chat model's row at T <= 1 is usually smaller


def top_k_top_p_probs(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """[n, V] softmax of ``logits`` [n, V] after top-k (``k`` [n], V or more: off)
    and top-p (``p`` [n], 1 or more: off): what ``softmax(apply_top_k_top_p(...))``
    gives. ``logits`` is not modified."""
    x = logits.float()
    n, V = x.shape
    if k is not None:
        k = k.to(device=x.device, dtype=torch.long).clamp(1, V)
        if bool((k < V).any()):
            kmax = int(k[k < V].max())
            kth = x.topk(kmax, dim=-1).values.gather(1, (k.clamp_max(kmax) - 1).unsqueeze(1))
            kth = torch.where((k < V).unsqueeze(1), kth, torch.full_like(kth, -float("inf")))
            x = x.masked_fill(x < kth, -float("inf"))
    probs = torch.softmax(x, dim=-1)
    if p is None:
        return probs
    p = p.to(device=x.device, dtype=torch.float64)
    rows = (p < 1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return probs
    keep = _nucleus(probs[rows], p[rows])
    if bool(keep.all()):
        return probs
    x = x.clone() if x is logits else x
    x[rows] = x[rows].masked_fill(~keep, -float("inf"))
    return torch.softmax(x, dim=-1)


def _nucleus(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[n, V] bool: tokens whose higher-ranked mass is < p[i] (the largest always kept)."""
    n, V = probs.shape
    keep = torch.zeros_like(probs, dtype=torch.bool)
    todo = torch.arange(n, device=probs.device)
    width = min(FIRST_CANDIDATES, V)
    while todo.numel():
        vals, idx = probs[todo].topk(width, dim=-1)  # descending
        mass = vals.double().cumsum(-1)
        above = mass - vals.double()  # mass ranked above each candidate
        # Inside the candidates when their total reaches p: every other token
        # has at least that much above it. The last width (V) always is.
        done = (mass[:, -1] >= p[todo]) | (width == V)
        rows = todo[done]
        keep[rows] = keep[rows].scatter(1, idx[done], above[done] < p[rows].unsqueeze(1))
        todo = todo[~done]
        width = min(width * 8, V)
    return keep


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[n] index drawn from each row of ``weights`` [n, V] (non-negative, not
    necessarily normalised, each with a positive entry) in proportion to its
    entries, by inverse CDF from ``uniforms`` [n] in [0, 1). A zero entry is
    never drawn (its CDF interval is empty)."""
    cdf = weights.double().cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    return idx.clamp_max(weights.shape[1] - 1)
