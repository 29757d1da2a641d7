"""One MRV2 verify step's trees, from the input batch to the commit.

The model-state wrapper opens a step (``begin``: the trees the speculator proposed, as
MRV2 laid their drafts out), the rejection sampler records its acceptance, and the
speculator commits it before drafting (``commit``): three MRV2 hooks that share this
object, owned by the runner."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from vllm_treespec.engine.commit import commit_accepted
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.tree import TreeBatch
from vllm_treespec.tree.proposed import ProposedTree


class TreeSteps:
    """Proposed trees by request-state index, the current verify step and its
    acceptance, and counters (``counters``) a test or metric reads."""

    def __init__(self, move_kv: Callable[[torch.Tensor, torch.Tensor], None]):
        self.move_kv = move_kv
        self.proposed: dict[int, ProposedTree] = {}
        self.step: VerifyStep | None = None
        self.acceptance = None
        self.block_table: torch.Tensor | None = None
        self.block_size = 0
        self.counters = Counter()

    def begin(self, input_batch, block_table: torch.Tensor, block_size: int) -> None:
        """This step's trees (None: no request verifies drafts)."""
        self.step = make_verify_step(input_batch, self.proposed)
        self.acceptance = None
        self.block_table, self.block_size = block_table, block_size
        if self.step is not None:
            self.counters["verify_steps"] += 1
            self.counters["branching_steps"] += int(not self.step.tree.is_chain)

    def accepted(self, acc) -> None:
        self.acceptance = acc
        self.counters["accepted_tokens"] += int(acc.num_accepted.sum())
        self.counters["verified_trees"] += self.step.tree.batch_size

    def commit(self, input_batch, hidden: torch.Tensor, aux: list[torch.Tensor] | None) -> None:
        """The accepted paths to the front of their slots (every layer's KV, the input
        ids the drafter's first pass shifts, the hidden states it reads): vLLM's
        ``post_update`` and scheduler already count them as an accepted chain."""
        step, acc = self.step, self.acceptance
        self.step = self.acceptance = None
        if step is None or acc is None:
            return
        step.hidden_states, step.aux_hidden_states = hidden, aux
        # Positions: MRV2's input_batch.positions were never made tree-shaped (the
        # model read a copy), so commit_accepted rewrites them to the same values.
        commit_accepted(step, acc, self.block_table, self.block_size, self.move_kv,
                        input_batch.input_ids, input_batch.positions)


def make_verify_step(input_batch, proposed: dict[int, ProposedTree]) -> VerifyStep | None:
    """The requests of ``input_batch`` that verify drafts, each as its proposed tree
    (cut to the drafts scheduled: a BFS prefix is a tree), or as a chain where the
    drafts are not the tree proposed for it (always correct: each draft is verified
    as a proposal). The tokens are read from the input ids, what the target verifies."""
    n_draft = input_batch.num_draft_tokens_per_req
    if n_draft is None or input_batch.num_draft_tokens == 0:
        return None
    rows = np.nonzero(np.asarray(n_draft[:input_batch.num_reqs]) > 0)[0]
    if rows.size == 0:
        return None
    n = np.asarray(n_draft, dtype=np.int64)[rows]
    qsl = np.asarray(input_batch.query_start_loc_np, dtype=np.int64)
    # Root + drafts end each request's query (MRV2's combine_sampled_and_draft_tokens).
    token_start = qsl[rows + 1] - n - 1
    ids = input_batch.input_ids
    dev = ids.device
    tokens = [ids[s: s + k + 1].tolist() for s, k in zip(token_start.tolist(), n.tolist())]
    trees = []
    for b, k, toks in zip(rows.tolist(), n.tolist(), tokens):
        tree = proposed.get(int(input_batch.idx_mapping_np[b]))
        tree = tree.prefix(k) if tree is not None and len(tree.tokens) >= k else None
        trees.append(tree if tree is not None and tree.tokens == toks[1:]
                     else ProposedTree.chain(toks[1:]))
    widest = max(max(Counter(t.parents).values(), default=1) for t in trees)
    batch = TreeBatch.from_parents(tokens, [[0] + t.parents for t in trees],
                                   tree_size=1 + int(n.max()), max_children=widest,
                                   device=dev)
    prefix = input_batch.positions[torch.from_numpy(token_start).to(dev)].long()
    logit_start = np.asarray(input_batch.cu_num_logits_np, dtype=np.int64)[rows]
    return VerifyStep(req_index=torch.from_numpy(rows.astype(np.int64)).to(dev), tree=batch,
                      prefix_len=prefix, token_start=torch.from_numpy(token_start).to(dev),
                      logit_start=torch.from_numpy(logit_start).to(dev),
                      num_reqs=input_batch.num_reqs, draft_probs=[t.probs for t in trees],
                      proposed=trees, depth=batch.max_depth)
