"""A verify step's inputs: the scheduled drafts as trees, their roots and positions.

vLLM lays each request's root and drafts out linearly at the end of its chunk;
here they become a ``TreeBatch`` (the proposed tree of each request, or a chain
where it is not the one proposed here: ``rank_agreement``), vLLM's placeholder
drafts are replaced, and the tree rows get rotary positions ``prefix + depth``
(the slot mapping stays linear). Functions of the runner (``TreeRunnerMixin``),
whose input batch, buffers and drafter they read.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from vllm_treespec.engine.layout import set_tree_positions
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.observability import trace_dir_from
from vllm_treespec.tree import TreeBatch
from vllm_treespec.tree.proposed import ProposedTree
from vllm_treespec.tree_fallback import validated
from vllm_treespec.vllm_glue import rank_agreement
from vllm_treespec.vllm_glue.grammar_trees import TREE_SHAPES


def make_verify_step(runner, scheduler_output, spec_md) -> VerifyStep:
    """This step's scheduled trees as a ``VerifyStep``: each request's proposed tree
    (a chain where it is not the one proposed here), its root, positions and
    logits; the tree rows' rotary positions rewritten to ``prefix + depth``."""
    num_reqs = runner.input_batch.num_reqs
    index = runner.input_batch.req_id_to_index
    scheduled = sorted((index[r], r, d) for r, d in
                       scheduler_output.scheduled_spec_decode_tokens.items() if d)
    # The scheduler's drafts are rank 0's. A request whose drafts another rank
    # did not propose is verified as a chain on every rank (rank_agreement);
    # one its grammar walk kept names its shape to every rank (grammar_trees).
    shapes = getattr(scheduler_output, TREE_SHAPES, None) or {}
    as_chain = rank_agreement.any_rank_each(
        [r not in shapes and not runner.drafter.proposed_here(r, d) for _, r, d in scheduled])
    trees = [ProposedTree.chain(d) if chain else runner.drafter.tree_for(r, d, shapes.get(r))
             for (_, r, d), chain in zip(scheduled, as_chain)]
    req_index = np.array([i for i, _, _ in scheduled], dtype=np.int64)
    # The root is the token just before the drafts, which vLLM schedules at the
    # end of the request's chunk; the chunk may begin with tokens it had not
    # computed yet (the rest of a prompt), so the root's place is counted from
    # the chunk's end, not taken to be its start.
    chunk_start = runner.query_start_loc.np[req_index].astype(np.int64)
    token_start = (runner.query_start_loc.np[req_index + 1].astype(np.int64)
                   - np.array([len(d) + 1 for _, _, d in scheduled], dtype=np.int64))
    padded = replace_placeholder_drafts(runner, trees, token_start)
    runner.tree_metrics.on_fallback("unmatched_trees", sum(
        chain and i not in padded for i, chain in enumerate(as_chain)))
    roots = runner.input_ids.gpu[torch.from_numpy(token_start).to(runner.device)].tolist()
    prefix = (runner.input_batch.num_computed_tokens_cpu[req_index].astype(np.int64)
              + token_start - chunk_start)  # the root's position
    tree = tree_batch(runner, roots, trees, req_index, prefix)
    num_draft = np.asarray(spec_md.num_draft_tokens, dtype=np.int64)
    cu_sampled = np.cumsum(num_draft + 1)
    logit_start = cu_sampled[req_index] - (num_draft[req_index] + 1)
    dev = runner.device
    step = VerifyStep(req_index=torch.from_numpy(req_index).to(dev), tree=tree,
                      prefix_len=torch.from_numpy(prefix).to(dev),
                      token_start=torch.from_numpy(token_start).to(dev),
                      logit_start=torch.from_numpy(logit_start).to(dev),
                      num_reqs=num_reqs, draft_probs=[t.probs for t in trees],
                      proposed=trees,
                      depth=getattr(runner.drafter, "last_depth", tree.max_depth))
    set_tree_positions(step, runner.positions)  # the slot mapping above stays linear
    return step


def tree_batch(runner, roots: list[int], trees: list[ProposedTree], req_index: np.ndarray,
                prefix: np.ndarray) -> TreeBatch:
    """The scheduled trees below their roots, one row a request. With
    ``validate_invariants`` a malformed one (a node with more children than
    the configuration's ``max_children`` included) is dumped and verified as a
    chain of the same drafts instead (always correct). Without, the child
    tables are made as wide as the widest tree (no builder exceeds the
    configuration's bound; the tests' oracle trees do)."""
    bound = max(runner.tree_cfg.max_children, 1)
    validate = runner.tree_cfg.validate_invariants

    def build():
        widest = max(max(Counter(t.parents).values(), default=1) for t in trees)
        return TreeBatch.from_parents(
            [[r] + t.tokens for r, t in zip(roots, trees)], [[0] + t.parents for t in trees],
            tree_size=1 + max(len(t.tokens) for t in trees),
            max_children=bound if validate else max(bound, widest), device=runner.device)

    def as_chain(b):  # a chain of in-vocabulary drafts is always valid
        trees[b] = ProposedTree.chain(trees[b].tokens)

    def lists():
        return [{"token": [r] + t.tokens, "parent": [0] + t.parents}
                for r, t in zip(roots, trees)]

    req_ids = [runner.input_batch.req_ids[i] for i in req_index]
    return validated(build, runner.input_batch.vocab_size, as_chain, "verify", req_ids,
                     prefix, trace_dir_from(runner.tree_cfg.trace_dir), check=validate,
                     lists=lists)


def replace_placeholder_drafts(runner, trees: list[ProposedTree],
                                token_start: np.ndarray) -> set[int]:
    """vLLM (0.27.1; 0.32.0 more often) pads a request that joins a decode batch
    with one token to schedule (a one-token prompt, or a resumed request whose
    prefix is cached) to the batch's draft count with -1 placeholder drafts
    (uniform shapes for graphs). -1 is not a token: its input row would index
    the embedding with -1 and its acceptance would read the last vocabulary
    entry's probability.
    Such drafts are verified as a chain of token 0 instead, in the tree and in
    the input row. That is lossless: every draft is verified as a
    deterministic proposal, whichever token it is. Counted (``placeholder_drafts``);
    returns the trees that had any."""
    vocab = runner.input_batch.vocab_size
    rows, padded = [], set()
    for i, tree in enumerate(trees):
        bad = [j for j, t in enumerate(tree.tokens) if not 0 <= t < vocab]
        if bad:
            trees[i] = ProposedTree.chain([0 if j in bad else t
                                           for j, t in enumerate(tree.tokens)])
            rows += [int(token_start[i]) + 1 + j for j in bad]
            padded.add(i)
    if rows:
        runner.input_ids.gpu[torch.tensor(rows, device=runner.device)] = 0
    runner.tree_metrics.on_fallback("placeholder_drafts", len(rows))
    return padded
