"""Acceptance of one step's trees: the target's distribution at the nodes and
the rule that walks them.

vLLM's rejection sampler assumes chains: its logits processors see "output so
far = output + the first j drafts", and its bonus row is the last one. With a
tree, the context of node i is ``output + path(i)`` and any node can supply the
bonus token. So each tree request gets its target distribution at the nodes from
the processing a plain step applies (allowed-token mask, repetition / frequency /
presence penalties over ``output + path``, at the tokens they change:
``tree.penalties``; temperature, top-k, top-p), each node under its own grammar
mask where the request has a grammar (``VerifyStep.grammar_masks``: a draft the
grammar rejects has probability 0 at its parent, so it is never accepted, and
every emitted token is one the grammar allows), then the acceptance rule: greedy
longest path at temperature 0 (every node's argmax), lossless multi-draft
rejection sampling otherwise (per request, in one batch over the sampled trees
only), which processes the nodes its walk reaches only (``NodeLogits``,
``node_probs``); seeded requests sample with their positions' noise
(``draw_seeded``, the runner's own op), again only at the nodes on the path
their samples choose.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from vllm_treespec.engine.grammar import disallowed
from vllm_treespec.engine.step import VerifyStep, node_rows
from vllm_treespec.tree import (
    Acceptance,
    greedy_accept,
    path_tokens,
    penalise_rows,
    samples_on_path,
    stochastic_accept,
    top_k_top_p_probs,
)

SAMPLING_EPS = 1e-5  # vLLM's greedy threshold on temperature

# (rows [n, V] after temperature, top-k [n] | None, top-p [n] | None, seeds,
# sequence positions) -> [n] tokens: the runner's draw for seeded rows, so that a
# seeded request samples what a plain step would at each position.
SeededDraw = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                       list[int], list[int]], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class TreeSampling:
    """Sampling parameters per batch row (a tree's row is ``step.req_index[tree]``),
    as a runner keeps them; what tree acceptance reads of them."""

    all_greedy: bool
    temperature: torch.Tensor | None = None        # [B]; None where every row is greedy
    top_k: torch.Tensor | None = None              # [B]; None where no row sets one
    top_p: torch.Tensor | None = None              # [B]
    allowed_mask: torch.Tensor | None = None       # [B, V] True: a token the row may not take
    no_penalties: bool = True
    repetition: torch.Tensor | None = None         # [B] (1: none)
    frequency: torch.Tensor | None = None          # [B] (0: none)
    presence: torch.Tensor | None = None           # [B] (0: none)
    prompt_token_ids: torch.Tensor | None = None   # [B, P] padded with the vocabulary size
    output_token_ids: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy over its raw logits: nothing to process before the argmax."""
        return self.all_greedy and self.allowed_mask is None and self.no_penalties


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


class NodeLogits:
    """Target logits of tree nodes after the request's processing (grammar mask
    of the node; allowed-token mask; penalties over output + path, at the tokens
    they change), before
    temperature: what greedy takes the argmax of. ``self[trees, nodes]`` ->
    [n, V] float32 for node ``nodes[i]`` of tree ``trees[i]``, computed for the
    nodes asked for only: a sampled tree's walk reads at most depth + 1 of its
    nodes, and copying every node's row makes a step of many trees far dearer
    (benchmarks/history/RESULTS-history.md, "A sampled tree step processes only
    the nodes it reads (2026-12-01, later, AVX-512 machine): 25-30 ms less a step
    at 16 trees, 75-105 ms at 100"). Indexed like the [Bt, T, V] table it stands for
    (``bench.tree_reference.processed_node_logits``, the tests' reference), so
    ``node_probs`` takes either."""

    def __init__(self, logits: torch.Tensor, step: VerifyStep, sampling: TreeSampling):
        self.logits, self.step, self.sampling = logits, step, sampling

    def __getitem__(self, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        trees, nodes = index
        x = self.logits[node_rows(self.step)[trees, nodes]].float()  # a copy: ours to edit
        s = self.sampling
        reqs = self.step.req_index[trees]
        masks = self.step.grammar_masks
        if masks is not None:  # as vLLM masks logits before its sampler
            rows = masks[trees.to(masks.device), nodes.to(masks.device)]
            x.masked_fill_(disallowed(rows.to(x.device), x.shape[1]), float("-inf"))
        if s.allowed_mask is not None:
            x.masked_fill_(s.allowed_mask[reqs], float("-inf"))
        if not s.no_penalties:
            penalised, slot, generated, path = self._penalty_inputs
            at = penalised[trees].nonzero().squeeze(1)
            if at.numel():
                t, r = trees[at], reqs[at]
                penalise_rows(x, at, s.prompt_token_ids[r],
                              torch.cat([generated[slot[t]], path[t, nodes[at]]], dim=1),
                              s.repetition[r], s.frequency[r], s.presence[r])
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
        s, idx = self.sampling, self.step.req_index
        V = self.logits.shape[1]
        penalised = ((s.repetition[idx] != 1) | (s.frequency[idx] != 0)
                     | (s.presence[idx] != 0))
        trees = penalised.nonzero().squeeze(1)
        slot = torch.full_like(idx, -1)
        slot[trees] = torch.arange(len(trees), device=idx.device)
        outputs = [s.output_token_ids[b] if b < len(s.output_token_ids) else []
                   for b in idx[trees].tolist()]
        width = max(map(len, outputs), default=0)
        generated = torch.tensor([o + [V] * (width - len(o)) for o in outputs],
                                 dtype=torch.long).view(len(outputs), width).to(idx.device)
        return penalised, slot, generated, path_tokens(self.step.tree, V)


def scaled(x: torch.Tensor, sampling: TreeSampling, idx: torch.Tensor):
    """Rows ``x`` of batch rows ``idx`` over their temperature, with their top-k
    and top-p: what vLLM's samplers cut and normalise."""
    x = x / sampling.temperature[idx].float().clamp_min(SAMPLING_EPS).unsqueeze(1)
    return (x, sampling.top_k[idx] if sampling.top_k is not None else None,
            sampling.top_p[idx] if sampling.top_p is not None else None)


def node_probs(processed: torch.Tensor, step: VerifyStep, sampling: TreeSampling,
               rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """[n, V] target next-token distribution of tree ``rows[i]`` at node
    ``nodes[i]`` (temperature, top-k, top-p over the processed logits). On
    demand: the acceptance walk reads at most depth + 1 of a tree's nodes.
    Top-k / top-p as ``top_k_top_p_probs`` (the same sets, found among each row's
    largest entries instead of a sort of the vocabulary, which costs far more a
    row; ``vllm_treespec/tree/nucleus.py``). Seeded rows do not come here: they
    sample with the runner's own op (``SeededDraw``)."""
    x, k, p = scaled(processed[rows, nodes], sampling, step.req_index[rows])
    return top_k_top_p_probs(x, k, p)


def seeded_acceptance(step: VerifyStep, seeded: list[tuple[int, int]], node_logits,
                      sampling: TreeSampling, draw_seeded: SeededDraw,
                      acc: Acceptance) -> Acceptance:
    """Sampled seeded requests accept with the sample a plain step would draw at
    each position (``vllm_glue.seeded_draws``): their output depends on the seed
    alone, not on the trees or off steps the adaptive budget chose
    (timing-dependent). seeded: (tree row, the request's seed); only the nodes
    on the path the samples choose are processed."""
    dev = acc.path.device
    rows = torch.tensor([i for i, _ in seeded], device=dev)
    seed_of = [seed for _, seed in seeded]
    first = [int(step.prefix_len[i]) + 1 for i, _ in seeded]

    def draw(r: torch.Tensor, nodes: torch.Tensor, d: int) -> torch.Tensor:
        # One call of the runner's op for the depth's nodes, batched across requests.
        x, k, p = scaled(node_logits[rows[r], nodes], sampling, step.req_index[rows[r]])
        at = r.tolist()
        return draw_seeded(x, k, p, [seed_of[i] for i in at],
                           [first[i] + d for i in at]).to(dev).long()

    trees = step.tree.take(rows)
    return acc.put(rows, greedy_accept(trees, samples_on_path(trees, draw)))


def accept_trees(logits: torch.Tensor, step: VerifyStep, sampling: TreeSampling,
                 seeds: dict[int, int], draw_seeded: SeededDraw) -> Acceptance:
    """Every tree's accepted path: greedy trees take the argmax of every node,
    sampled ones read their walk's nodes only. ``seeds``: batch row -> seed of
    the rows that have one."""
    if sampling.plain_greedy and step.grammar_masks is None:
        # Nothing to process: the argmax of the raw rows, without copying every
        # node's logits (the batch-1 step's common case).
        return greedy_accept(step.tree, row_argmax(logits)[node_rows(step)])
    node_logits = NodeLogits(logits, step, sampling)
    dev = logits.device
    Bt = step.tree.batch_size
    greedy = (sampling.temperature[step.req_index] < SAMPLING_EPS
              if sampling.temperature is not None
              else torch.ones(Bt, dtype=torch.bool, device=dev))
    if bool(greedy.all()):
        return greedy_accept(step.tree, row_argmax(node_logits.of_trees()))
    probs = functools.partial(node_probs, node_logits, step, sampling)
    sampled = [(i, seeds.get(b)) for i, (b, g) in
               enumerate(zip(step.req_index.tolist(), greedy.tolist())) if not g]
    unseeded = [i for i, seed in sampled if seed is None]
    if len(unseeded) == Bt:  # every tree (batch 1's case)
        return stochastic_accept(step.tree, probs)
    # A result of the right shape (nothing accepted); every row is replaced
    # below: greedy, unseeded and seeded trees cover the batch.
    acc = greedy_accept(step.tree, torch.full_like(step.tree.token, -1))
    rows = greedy.nonzero().squeeze(1)
    if rows.numel():
        acc = acc.put(rows, greedy_accept(step.tree.take(rows),
                                          row_argmax(node_logits.of_trees(rows))))
    if unseeded:
        rows = torch.tensor(unseeded, device=dev)
        acc = acc.put(rows, stochastic_accept(step.tree.take(rows),
                                              lambda r, nodes: probs(rows[r], nodes)))
    seeded = [(i, seed) for i, seed in sampled if seed is not None]
    if seeded:
        acc = seeded_acceptance(step, seeded, node_logits, sampling, draw_seeded, acc)
    return acc
