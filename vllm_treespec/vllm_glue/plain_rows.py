"""vLLM's sampler for the requests of a tree step that have no tree.

A verify step that mixes trees with requests decoding normally (off for the
budget, or ``tree_safe`` refused them) samples one row per request with vLLM's
own ``Sampler``: the requests without a tree take its token, and its
batch-aligned processing (allowed-token mask, bad words, logits processors,
penalties) must see the whole batch. Its random draw does not: top-k / top-p
sort the whole vocabulary of every row as soon as one request sets top-p, which
is the sampler's largest cost on the CPU, and the tree rows' draws are replaced
by the tree acceptance anyway. ``sample_rows_without_tree`` runs vLLM's
processing (and raw logprobs) on every row and vLLM's draw
(``Sampler.topk_topp_sampler``) on the sampled rows without a tree only, with
the top-k / top-p vLLM would pass for that sub-batch (none where no row of it
sets one). A row's draw depends on its
own logits and generator only (``tests/unit/test_seeded_noise.py``), so each
request without a tree gets the token the whole-batch sampler would give it.
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import SamplerOutput

from vllm_treespec.engine.accept import SAMPLING_EPS  # vLLM's greedy threshold


RAW_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")  # vLLM's default, and its raw logits


def needs_whole_sampler(sampler, md) -> bool:
    """Logprobs taken after processing (``--logprobs-mode processed_*``), of the
    whole vocabulary, or of specific tokens come from the whole sampler."""
    return (bool(getattr(md, "logprob_token_ids", None))
            or (md.max_num_logprobs is not None
                and (md.max_num_logprobs < 0 or sampler.logprobs_mode not in RAW_LOGPROBS_MODES)))


def sample_rows_without_tree(sampler, rows: torch.Tensor, md,
                             without_tree: torch.Tensor) -> SamplerOutput:
    """[num_reqs, 1] tokens: ``Sampler.forward`` on ``rows`` [num_reqs, V] (one
    logits row per request, a copy that is ours to edit), drawn for the rows
    ``without_tree`` only; the other rows hold 0 (the caller replaces them).
    With logprobs asked for, vLLM's raw logprobs of every row at its token (the
    tree rows' the caller replaces too). Not where ``needs_whole_sampler``."""
    raw = None
    if md.max_num_logprobs is not None:  # from the logits as they come, as vLLM takes them
        raw = (sampler.compute_logprobs(rows) if sampler.logprobs_mode == "raw_logprobs"
               else rows.to(torch.float32, copy=True))
    x = sampler.apply_logits_processors(rows.to(torch.float32), md, False)
    tokens = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    if md.all_greedy:
        sampled = torch.zeros_like(without_tree, dtype=torch.bool)
    else:
        sampled = md.temperature[without_tree] >= SAMPLING_EPS
    greedy = without_tree[~sampled]
    if greedy.numel():
        tokens[greedy] = sampler.greedy_sample(x[greedy]).view(-1)
    drawn = without_tree[sampled]
    if drawn.numel():
        x = sampler.apply_temperature(x, md.temperature, md.all_random)
        for processor in md.logitsprocs.argmax_invariant:
            x = processor.apply(x)
        generators = {j: md.generators[i] for j, i in enumerate(drawn.tolist())
                      if i in md.generators}
        k = _sub_batch(md.top_k, drawn, lambda k: k < x.shape[1])
        p = _sub_batch(md.top_p, drawn, lambda p: p < 1.0)
        draws, _ = sampler.topk_topp_sampler(x[drawn], generators, k, p)
        tokens[drawn] = draws.view(-1).to(tokens.dtype)
    logprobs = (None if raw is None
                else sampler.gather_logprobs(raw, md.max_num_logprobs, token_ids=tokens))
    return SamplerOutput(sampled_token_ids=tokens.to(torch.int32).unsqueeze(-1),
                         logprobs_tensors=logprobs)


def _sub_batch(values: torch.Tensor | None, rows: torch.Tensor, sets) -> torch.Tensor | None:
    """``values[rows]``, or None where no row of the sub-batch sets the option
    (as vLLM's input batch passes top-k / top-p: ``no_top_k``, ``no_top_p``)."""
    if values is None:
        return None
    sub = values[rows]
    return sub if bool(sets(sub).any()) else None
