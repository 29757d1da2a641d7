"""Sampling a verify step that contains trees.

vLLM's rejection sampler assumes chains: its logits processors see "output so
far = output + the first j drafts", and its bonus row is the last one. With a
tree, the context of node i is ``output + path(i)`` and any node can supply the
bonus token. So in tree mode:

* where some request has no tree (or logprobs are asked for), every request
  first goes through vLLM's own ``Sampler`` on one row (its only row, or its root
  row): requests without a tree take that token as their output, and
  batch-aligned logits processors see exactly the batch they expect; only the
  rows without a tree are drawn (``plain_rows``; the whole sampler for
  processed or specific-token logprobs); a batch of trees only skips it (nothing of it would
  be used);
* tree requests get their target distribution at the nodes from the same
  processing vLLM applies (allowed-token mask, repetition / frequency / presence
  penalties over ``output + path``, at the tokens they change: ``tree.penalties``;
  temperature, top-k, top-p), then the tree
  acceptance rule: greedy longest path at temperature 0 (every node's argmax),
  lossless multi-draft rejection sampling otherwise (per request, in one batch
  over the sampled trees only), which processes and asks for the distributions
  of the nodes its walk reaches only (``NodeLogits``, ``node_probs``); seeded
  requests sample with their positions' noise, again only at the nodes on the
  path their samples choose;
* logprobs of emitted tokens come from the node rows that produced them.

Requests whose sampling parameters need processing not listed above (min-p,
logit bias, bad words, min-tokens still pending, structured output, custom
logits processors, specific-token logprobs) are never given a tree
(``tree_safe``): they decode normally in the same batch, losslessly.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_treespec.tree import (
    PAD_TOKEN_ID,
    Acceptance,
    TreeBatch,
    greedy_accept,
    path_tokens,
    penalise_rows,
    samples_on_path,
    stochastic_accept,
    top_k_top_p_probs,
)
from vllm_treespec.vllm_glue.seeded_draws import plain_step_sampler, seeded_draws
from vllm_treespec.vllm_glue.request_checks import refusal
from vllm_treespec.vllm_glue.plain_rows import (
    SAMPLING_EPS,
    needs_whole_sampler,
    sample_rows_without_tree,
)


def tree_safe(params, num_output_tokens: int) -> bool:
    """Whether a request's sampling parameters are reproduced exactly on tree nodes."""
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
    if getattr(params, "structured_outputs", None) is not None:
        return False
    if getattr(params, "logits_processors", None):
        return False
    if getattr(params, "logprob_token_ids", None):
        return False
    # Refused at the frontend already; never given a tree should one get here.
    return refusal(params) is None


@dataclasses.dataclass
class VerifyStep:
    """Tree requests of one verify step (batch order), filled by the runner."""

    req_index: torch.Tensor      # [Bt] batch rows that carry a tree
    tree: TreeBatch              # [Bt, T]
    prefix_len: torch.Tensor     # [Bt] position of each root (= tokens before it)
    token_start: torch.Tensor    # [Bt] flat query index of each root (its drafts follow)
    logit_start: torch.Tensor    # [Bt] logits row of each root
    num_reqs: int
    # Per tree, per draft node: its draft probability (the product along its path).
    draft_probs: list[list[float]] | None = None
    # The ProposedTree of each tree (its sources and copy branches, if any).
    proposed: list | None = None
    depth: int = 0               # drafting depth that produced these trees
    prepare_s: float = 0.0       # tensorize + positions + attention metadata
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: list[torch.Tensor] | None = None

    @property
    def predicted(self) -> float:
        """Drafts the proposer expects accepted: the verified nodes' probabilities, summed."""
        return float(sum(sum(p) for p in self.draft_probs or ()))


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``. On the CPU through numpy: torch's index reduction is
    several times slower over a vocabulary of 49k, even for the few rows of a
    small tree (benchmarks/history/RESULTS-history.md, "Latest (2026-11-26,
    night): per-step overheads trimmed, probes sized to the batch; `eagle3_tree`
    1.07x stock k=2 served; the fixed M=8 tree ahead of stock; 0.98x plain at 16
    requests"), numpy's gives the same indices (the first maximum; NaN counts as
    the maximum)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 2
            and x.is_contiguous()):
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


def node_rows(step: VerifyStep) -> torch.Tensor:
    """[Bt, T] logits row of every node (padding nodes read the root's row)."""
    T = step.tree.tree_size
    offs = torch.arange(T, device=step.logit_start.device).unsqueeze(0)
    offs = torch.where(step.tree.valid, offs, torch.zeros_like(offs))
    return step.logit_start.unsqueeze(1) + offs


class NodeLogits:
    """Target logits of tree nodes after the request's processing (allowed-token
    mask; penalties over output + path, at the tokens they change), before
    temperature: what greedy takes the argmax of. ``self[trees, nodes]`` ->
    [n, V] float32 for node ``nodes[i]`` of tree ``trees[i]``, computed for the
    nodes asked for only: a sampled tree's walk reads at most depth + 1 of its
    nodes, and copying every node's row makes a step of many trees far dearer
    (benchmarks/history/RESULTS-history.md, "A sampled tree step processes only
    the nodes it reads (2026-12-01, later, AVX-512 machine): 25-30 ms less a step
    at 16 trees, 75-105 ms at 100"). Indexed like the [Bt, T, V] table it stands for
    (``bench.tree_reference.processed_node_logits``, the tests' reference), so
    ``node_probs`` takes either."""

    def __init__(self, logits: torch.Tensor, step: VerifyStep, md):
        self.logits, self.step, self.md = logits, step, md

    def __getitem__(self, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        trees, nodes = index
        x = self.logits[node_rows(self.step)[trees, nodes]].float()  # a copy: ours to edit
        md = self.md
        reqs = self.step.req_index[trees]
        if md.allowed_token_ids_mask is not None:
            x.masked_fill_(md.allowed_token_ids_mask[reqs], float("-inf"))
        if not md.no_penalties:
            penalised, slot, generated, path = self._penalty_inputs
            at = penalised[trees].nonzero().squeeze(1)
            if at.numel():
                t, r = trees[at], reqs[at]
                penalise_rows(x, at, md.prompt_token_ids[r],
                              torch.cat([generated[slot[t]], path[t, nodes[at]]], dim=1),
                              md.repetition_penalties[r], md.frequency_penalties[r],
                              md.presence_penalties[r])
        return x

    def of_trees(self, trees: torch.Tensor | None = None) -> torch.Tensor:
        """[len(trees), T, V] every node of trees ``trees`` (all if None)."""
        T = self.step.tree.tree_size
        if trees is None:
            trees = torch.arange(self.step.tree.batch_size, device=self.logits.device)
        nodes = torch.arange(T, device=self.logits.device).repeat(len(trees))
        return self[trees.repeat_interleave(T), nodes].view(len(trees), T, -1)

    @functools.cached_property
    def _penalty_inputs(self):
        """Per tree: whether its request sets a penalty (a neutral one, repetition
        1 and frequency and presence 0, would come back unchanged); its row of
        ``generated`` (the output so far, padded with V; penalised trees only);
        its nodes' path tokens [Bt, T, D]."""
        md, idx = self.md, self.step.req_index
        V = self.logits.shape[1]
        penalised = ((md.repetition_penalties[idx] != 1) | (md.frequency_penalties[idx] != 0)
                     | (md.presence_penalties[idx] != 0))
        trees = penalised.nonzero().squeeze(1)
        slot = torch.full_like(idx, -1)
        slot[trees] = torch.arange(len(trees), device=idx.device)
        outputs = [md.output_token_ids[b] if b < len(md.output_token_ids) else []
                   for b in idx[trees].tolist()]
        width = max(map(len, outputs), default=0)
        generated = torch.tensor([o + [V] * (width - len(o)) for o in outputs],
                                 dtype=torch.long).view(len(outputs), width).to(idx.device)
        return penalised, slot, generated, path_tokens(self.step.tree, V)


def node_probs(processed: torch.Tensor, step: VerifyStep, md, rows: torch.Tensor,
               nodes: torch.Tensor) -> torch.Tensor:
    """[n, V] target next-token distribution of tree ``rows[i]`` at node
    ``nodes[i]`` (temperature, top-k, top-p over the processed logits). On
    demand: the acceptance walk reads at most depth + 1 of a tree's nodes.
    Top-k / top-p as ``top_k_top_p_probs`` (the same sets, found among each row's
    largest entries instead of a sort of the vocabulary, which costs far more a
    row; ``vllm_treespec/tree/nucleus.py``). Seeded rows do not come here: they sample with vLLM's own op
    (``seeded_draws``)."""
    x, k, p = _scaled(processed[rows, nodes], md, step.req_index[rows])
    return top_k_top_p_probs(x, k, p)


def _seeded_acceptance(step: VerifyStep, seeded: list[tuple[int, int]], node_logits, md,
                       op, acc: Acceptance) -> Acceptance:
    """Sampled seeded requests accept with the sample a plain step would draw at
    each position (``seeded_draws``): their output depends on the seed alone, not
    on the trees or off steps the adaptive budget chose (timing-dependent).
    seeded: (tree row, the request's seed); only the nodes on the path the samples
    choose are processed."""
    dev = acc.path.device
    rows = torch.tensor([i for i, _ in seeded], device=dev)
    seed_of = [seed for _, seed in seeded]
    first = [int(step.prefix_len[i]) + 1 for i, _ in seeded]

    def draw(r: torch.Tensor, nodes: torch.Tensor, d: int) -> torch.Tensor:
        # One call of vLLM's op for the depth's nodes, batched across requests.
        x, k, p = _scaled(node_logits[rows[r], nodes], md, step.req_index[rows[r]])
        at = r.tolist()
        return seeded_draws(op, x, k, p, [seed_of[i] for i in at],
                             [first[i] + d for i in at]).to(dev).long()

    trees = step.tree.take(rows)
    return acc.put(rows, greedy_accept(trees, samples_on_path(trees, draw)))


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
    skip_base = step.tree.batch_size == num_reqs and not asks_logprobs(md)
    if skip_base and md.all_greedy and md.allowed_token_ids_mask is None and md.no_penalties:
        # Greedy and nothing to process: the argmax of the raw rows, without
        # copying every node's logits (the batch-1 step's common case).
        return _output(num_reqs, None, step,
                       greedy_accept(step.tree, row_argmax(logits)[node_rows(step)]))
    base = None
    if not skip_base:
        num_sampled = torch.tensor([n + 1 for n in spec_md.num_draft_tokens], device=dev)
        first_rows = spec_md.cu_num_sampled_tokens[:num_reqs].long() - num_sampled
        if needs_whole_sampler(sampler, md):
            base = sampler(logits=logits[first_rows], sampling_metadata=md)
        else:  # vLLM's draw for the rows without a tree only
            without_tree = torch.ones(num_reqs, dtype=torch.bool, device=dev)
            without_tree[step.req_index] = False
            base = sample_rows_without_tree(sampler, logits[first_rows], md,
                                            without_tree.nonzero().squeeze(1))
    # 2. Tree requests: node distributions and acceptance. Greedy trees take the
    #    argmax of every node; sampled ones read their walk's nodes only.
    node_logits = NodeLogits(logits, step, md)
    Bt = step.tree.batch_size
    greedy = md.temperature[step.req_index] < SAMPLING_EPS if md.temperature is not None \
        else torch.ones(Bt, dtype=torch.bool, device=dev)
    if bool(greedy.all()):
        acc = greedy_accept(step.tree, row_argmax(node_logits.of_trees()))
    else:
        probs = functools.partial(node_probs, node_logits, step, md)
        sampled = [(i, seeds.get(b)) for i, (b, g) in
                   enumerate(zip(step.req_index.tolist(), greedy.tolist())) if not g]
        unseeded = [i for i, seed in sampled if seed is None]
        if len(unseeded) == Bt:  # every tree (batch 1's case)
            acc = stochastic_accept(step.tree, probs)
        else:
            # A result of the right shape (nothing accepted); every row is replaced
            # below: greedy, unseeded and seeded trees cover the batch.
            acc = greedy_accept(step.tree, torch.full_like(step.tree.token, -1))
            rows = greedy.nonzero().squeeze(1)
            if rows.numel():
                acc = acc.put(rows, greedy_accept(step.tree.take(rows),
                                                  row_argmax(node_logits.of_trees(rows))))
            if unseeded:
                rows = torch.tensor(unseeded, device=dev)
                walked = stochastic_accept(step.tree.take(rows),
                                           lambda r, nodes: probs(rows[r], nodes))
                acc = acc.put(rows, walked)
        seeded = [(i, seed) for i, seed in sampled if seed is not None]
        if seeded:
            acc = _seeded_acceptance(step, seeded, node_logits, md,
                                     plain_step_sampler(sampler), acc)
    logprobs = None
    if base is not None and base.logprobs_tensors is not None:
        logprobs = _logprobs(sampler, logits, node_logits, step, md, acc, base,
                             acc.tokens.shape[1])
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
        x = _as_sampled(node_logits[trees, acc.path.reshape(-1)], step, md, trees)
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


def _as_sampled(x: torch.Tensor, step: VerifyStep, md, trees: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` of trees ``trees`` as vLLM's sampler and rejection sampler hand
    them to processed logprobs: a sampled request's after temperature, top-k and
    top-p; a greedy one's as they are (an all-greedy batch's; in a mixed batch
    vLLM also applies a greedy request's own top-k / top-p, rarely set)."""
    if md.temperature is None:
        return x
    idx = step.req_index[trees]
    at = (md.temperature[idx] >= SAMPLING_EPS).nonzero().squeeze(1)
    if at.numel():
        x[at] = apply_top_k_top_p(*_scaled(x[at], md, idx[at]))
    return x


def _scaled(x: torch.Tensor, md, idx: torch.Tensor):
    """Rows ``x`` of requests ``idx`` over their temperature, with their top-k and
    top-p: what vLLM's samplers cut and normalise."""
    x = x / md.temperature[idx].float().clamp_min(SAMPLING_EPS).unsqueeze(1)
    return (x, md.top_k[idx] if md.top_k is not None else None,
            md.top_p[idx] if md.top_p is not None else None)
