"""Sampling a verify step that contains trees, in vLLM's V1 runner: vLLM's
sampler for the rows without a tree, the engine's tree acceptance
(``engine.accept``) for the others, the emitted tokens and logprobs in the
layout vLLM's sampler gives.

* where some request has no tree (or logprobs are asked for), every request
  first goes through vLLM's own ``Sampler`` on one row (its only row, or its root
  row): requests without a tree take that token as their output, and
  batch-aligned logits processors see exactly the batch they expect; only the
  rows without a tree are drawn (``plain_rows``; the whole sampler for
  processed or specific-token logprobs); a batch of trees only skips it (nothing of it would
  be used);
* tree requests accept under their own sampling parameters (``TreeSampling``,
  read from vLLM's sampling metadata), seeded ones with vLLM's own op at each
  position (``seeded_draws``);
* logprobs of emitted tokens come from the node rows that produced them.

Requests whose sampling parameters need processing the engine does not do
(min-p, logit bias, bad words, min-tokens still pending, structured output
the scheduler cannot walk, custom logits processors, specific-token logprobs)
are never given a tree (``tree_safe``): they decode normally in the same batch,
losslessly. Structured output it walks (``grammar_trees``) reaches acceptance
with each node's logits row already under that node's grammar mask (vLLM's
``apply_grammar_bitmask``, rows from the scheduler's walk).
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_treespec.engine.accept import (
    SAMPLING_EPS,
    NodeLogits,
    TreeSampling,
    accept_trees,
    scaled,
)
from vllm_treespec.engine.step import VerifyStep, node_rows
from vllm_treespec.tree import PAD_TOKEN_ID, Acceptance
from vllm_treespec.vllm_glue.seeded_draws import plain_step_sampler, seeded_draws
from vllm_treespec.vllm_glue.request_checks import refusal
from vllm_treespec.vllm_glue.plain_rows import needs_whole_sampler, sample_rows_without_tree


def tree_safe(params, num_output_tokens: int, grammar_trees: bool = False) -> bool:
    """Whether a request's sampling parameters are reproduced exactly on tree nodes.
    ``grammar_trees``: the scheduler walks structured-output grammars down trees
    (``grammar_trees``; xgrammar's only, and not behind a reasoning parser)."""
    if params is None:
        return False
    if getattr(params, "min_p", 0.0) and params.temperature >= SAMPLING_EPS:
        return False
    if getattr(params, "logit_bias", None) or getattr(params, "bad_words", None):
        return False
    if getattr(params, "bad_words_token_ids", None):
        return False
    if getattr(params, "min_tokens", 0) and num_output_tokens < params.min_tokens:
        return False
    structured = getattr(params, "structured_outputs", None)
    if structured is not None and not (grammar_trees
                                       and getattr(structured, "_backend", None) == "xgrammar"):
        return False
    if getattr(params, "logits_processors", None):
        return False
    if getattr(params, "logprob_token_ids", None):
        return False
    # Refused at the frontend already; never given a tree should one get here.
    return refusal(params) is None


def tree_sampling(md) -> TreeSampling:
    """What tree acceptance reads of vLLM's ``SamplingMetadata`` (references, no
    copies; a field it lacks, as a test's partial one may, reads as unset)."""
    return TreeSampling(
        all_greedy=getattr(md, "all_greedy", False), temperature=getattr(md, "temperature", None),
        top_k=getattr(md, "top_k", None), top_p=getattr(md, "top_p", None),
        allowed_mask=getattr(md, "allowed_token_ids_mask", None),
        no_penalties=getattr(md, "no_penalties", True),
        repetition=getattr(md, "repetition_penalties", None),
        frequency=getattr(md, "frequency_penalties", None),
        presence=getattr(md, "presence_penalties", None),
        prompt_token_ids=getattr(md, "prompt_token_ids", None),
        output_token_ids=getattr(md, "output_token_ids", None) or [])


def sample_with_trees(sampler, logits: torch.Tensor, spec_md, md, step: VerifyStep,
                      seeds: dict[int, int]) -> tuple[SamplerOutput, Acceptance]:
    num_reqs = step.num_reqs
    dev = logits.device
    # 1. vLLM's sampler on one row per request: the output of requests without a
    #    tree, and the logprobs layout. Tree requests' rows are overwritten below,
    #    so a batch of trees only (the common batch-1 step) skips it: at T > 0 it
    #    would sort the vocabulary for top-p once more per request, for nothing
    #    (tree requests need no batch-aligned processor: ``tree_safe``; seeded
    #    rows draw per-position noise, not from the generator's stream).
    base = None
    if step.tree.batch_size != num_reqs or asks_logprobs(md):
        num_sampled = torch.tensor([n + 1 for n in spec_md.num_draft_tokens], device=dev)
        first_rows = spec_md.cu_num_sampled_tokens[:num_reqs].long() - num_sampled
        if needs_whole_sampler(sampler, md):
            base = sampler(logits=logits[first_rows], sampling_metadata=md)
        else:  # vLLM's draw for the rows without a tree only
            without_tree = torch.ones(num_reqs, dtype=torch.bool, device=dev)
            without_tree[step.req_index] = False
            base = sample_rows_without_tree(sampler, logits[first_rows], md,
                                            without_tree.nonzero().squeeze(1))
    # 2. Tree requests: the engine's acceptance, seeded rows with vLLM's own op.
    sampling = tree_sampling(md)

    def draw_seeded(x, k, p, seed_list, positions):
        return seeded_draws(plain_step_sampler(sampler), x, k, p, seed_list, positions)

    acc = accept_trees(logits, step, sampling, seeds, draw_seeded)
    logprobs = None
    if base is not None and base.logprobs_tensors is not None:
        logprobs = _logprobs(sampler, logits, NodeLogits(logits, step, sampling), step, md,
                             acc, base, acc.tokens.shape[1])
    return _output(num_reqs, base, step, acc, logprobs)


def asks_logprobs(md) -> bool:
    """Whether some request of the batch asks for logprobs of its sampled tokens:
    top logprobs, or logprobs of specific tokens (``logprob_token_ids``, which
    vLLM's sampler returns without ``max_num_logprobs``)."""
    return md.max_num_logprobs is not None or bool(getattr(md, "logprob_token_ids", None))


def _output(num_reqs: int, base, step: VerifyStep, acc: Acceptance,
            logprobs: LogprobsTensors | None = None) -> tuple[SamplerOutput, Acceptance]:
    """[num_reqs, width] emitted tokens: tree requests' from ``acc``, the others'
    from vLLM's sampler (``base``)."""
    if base is None and step.tree.batch_size == num_reqs:  # every row a tree, in order
        return SamplerOutput(sampled_token_ids=acc.tokens.to(torch.int32),
                             logprobs_tensors=logprobs), acc
    width = acc.tokens.shape[1]
    out = torch.full((num_reqs, width), PAD_TOKEN_ID, dtype=torch.int32,
                     device=acc.tokens.device)
    if base is not None:
        out[:, 0] = base.sampled_token_ids[:, 0]
    out[step.req_index] = acc.tokens.to(torch.int32)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs), acc


def _logprobs(sampler, logits, node_logits: NodeLogits, step, md, acc, base,
              width) -> LogprobsTensors:
    """Per emitted token: logprobs from the node row that produced it, in the
    layout vLLM's sampler gave the batch (``base``): its top-k layout, or, where
    some request of the batch asks for specific tokens' logprobs, that layout for
    every row (vLLM's sampler prefers it for the whole batch; tree requests never
    ask for specific tokens: ``tree_safe``)."""
    num_reqs = step.num_reqs
    b_ids, b_lp, b_rank = base.logprobs_tensors[:3]
    K1 = b_ids.shape[1]
    ids = b_ids.new_zeros(num_reqs, width, K1)
    lps = b_lp.new_zeros(num_reqs, width, K1)
    ranks = b_rank.new_zeros(num_reqs, width)
    ids[:, 0], lps[:, 0], ranks[:, 0] = b_ids, b_lp, b_rank
    Bt = step.tree.batch_size
    mode = sampler.logprobs_mode
    rows = torch.gather(node_rows(step), 1, acc.path)                  # [Bt, width]
    if mode.startswith("processed"):
        trees = torch.arange(Bt, device=rows.device).repeat_interleave(width)
        x = _as_sampled(node_logits[trees, acc.path.reshape(-1)], step,
                         node_logits.sampling, trees)
    else:
        x = logits[rows.reshape(-1)].float()
    if not mode.endswith("logits"):
        x = x.log_softmax(-1)
    tokens = acc.tokens.reshape(-1).clamp_min(0).long()
    if getattr(md, "logprob_token_ids", None):
        t = _sampled_only(x, tokens, K1)
    else:
        t = sampler.gather_logprobs(x, md.max_num_logprobs, tokens)
    ids[step.req_index] = t.logprob_token_ids.view(Bt, width, K1).to(ids.dtype)
    lps[step.req_index] = t.logprobs.view(Bt, width, K1).to(lps.dtype)
    ranks[step.req_index] = t.selected_token_ranks.view(Bt, width).to(ranks.dtype)
    return LogprobsTensors(ids.view(-1, K1), lps.view(-1, K1), ranks.view(-1))


def _sampled_only(x: torch.Tensor, tokens: torch.Tensor, width: int) -> LogprobsTensors:
    """vLLM's specific-token layout (``Sampler.gather_specific_token_logprobs``)
    for rows that ask for no specific token: the sampled token's logprob and rank
    in column 0, then padding (token 0, -inf)."""
    chosen = x.gather(-1, tokens.unsqueeze(-1))
    ids = torch.zeros(len(tokens), width, dtype=torch.long, device=x.device)
    ids[:, 0] = tokens
    lps = torch.full((len(tokens), width), float("-inf"), device=x.device)
    lps[:, :1] = chosen
    return LogprobsTensors(ids, lps, (x >= chosen).sum(-1))  # vLLM's rank: 1 = the best


def _as_sampled(x: torch.Tensor, step: VerifyStep, sampling: TreeSampling,
                trees: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` of trees ``trees`` as vLLM's sampler and rejection sampler hand
    them to processed logprobs: a sampled request's after temperature, top-k and
    top-p; a greedy one's as they are (an all-greedy batch's; in a mixed batch
    vLLM also applies a greedy request's own top-k / top-p, rarely set)."""
    if sampling.temperature is None:
        return x
    idx = step.req_index[trees]
    at = (sampling.temperature[idx] >= SAMPLING_EPS).nonzero().squeeze(1)
    if at.numel():
        x[at] = apply_top_k_top_p(*scaled(x[at], sampling, idx[at]))
    return x
