"""Handing a drafting step's trees to vLLM's scheduler.

The trees become draft token lists (BFS order); on the way, copy branches from
the request's own history and, with ``cross_request_tokens``, from its tenant's
finished requests (``copy_source``) are grafted below each root, and
where the CPU runner verifies trees in its spare blocks, trees are cut to what
those blocks hold. Each request's tree shape is remembered in the drafter's
``proposed`` until the runner verifies it (``TreeEagleProposer.tree_for``).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_treespec.attention.chain_split import scratch_prefix
from vllm_treespec.tree import TreeBatch
from vllm_treespec.tree.proposed import ProposedTree


class DraftHandOver:
    def __init__(self, drafter):
        self.drafter = drafter  # TreeEagleProposer: its runner, budget, copies, proposed

    def __call__(self, trees: TreeBatch | None, roots: torch.Tensor | None = None,
                 root_positions: list[int] | None = None,
                 rows: list[int] | None = None) -> list[list[int]]:
        """Draft token lists for the scheduler; remember each tree's shape.
        ``roots``: each request's new root, to graft copy branches below;
        ``root_positions``: where they sit (the trees' scratch blocks are counted
        exactly with them, bounded without); ``rows``: the batch rows ``trees``
        are for (None: all), the others get no drafts."""
        d = self.drafter
        req_ids = d.runner.input_batch.req_ids
        B = len(req_ids)
        if trees is None and not self.copies_wanted(roots):
            for r in req_ids:
                d.proposed.pop(r, None)
            return [[] for _ in req_ids]
        if trees is None:
            num = np.zeros(B, dtype=np.int64)
        else:
            tokens = trees.token.cpu().numpy()
            parents = trees.parent.cpu().numpy()
            probs = torch.exp(trees.score.float()).cpu().numpy()
            num = trees.node_counts.cpu().numpy()
            if rows is not None:
                tokens, parents, probs, num = (_scattered(a, rows, B)
                                               for a in (tokens, parents, probs, num))
        allowed = d.runner.tree_allowed_mask(B)
        num = np.where(allowed, num[:B], 0)
        copies = self.copy_plan(trees, probs if trees is not None else None, num, roots,
                                allowed)
        kappa = d.adaptive_budget.kappa if d.adaptive_budget is not None else 1.0
        scratch = self.scratch_capacity(B)
        out: list[list[int]] = []
        for b, req_id in enumerate(req_ids):
            n = int(num[b])
            tree = (ProposedTree(tokens[b, 1: n + 1].tolist(), parents[b, 1: n + 1].tolist(),
                                 probs[b, 1: n + 1].tolist()) if n else ProposedTree([], [], []))
            if copies is not None and allowed[b] and copies[0][b]:
                tree = ProposedTree(*d.copies.grafted(
                    tree.tokens, tree.parents, tree.probs, copies[0][b], copies[1][b],
                    d.tree_cfg.num_nodes, d.tree_cfg.max_children, kappa))
            if scratch is not None and tree.tokens:
                kept, blocks = scratch_prefix(tree.parents, d.block_size, scratch,
                                              None if root_positions is None
                                              else root_positions[b])
                tree, scratch = tree.prefix(kept), scratch - blocks
            out.append(tree.tokens)
            if tree.tokens:
                d.proposed[req_id] = tree
            else:
                d.proposed.pop(req_id, None)
        return out

    def scratch_capacity(self, batch_size: int) -> int | None:
        """Scratch blocks the next verify step's trees may take, or None for no bound.

        A CPU runner verifies trees as chains of the native kernel in its spare
        blocks (``cpu_attention``); a step whose trees need more falls back to the
        torch tree attention for every tree row, which gathers each tree request's
        whole context: cheap for one request, seconds a step for dozens at long
        contexts. So where the adaptive budget sizes trees for speed and there is
        more than one request, trees are cut (BFS prefixes, in batch order) to what
        the spare blocks verify natively. A lone request's tree, and a fixed tree
        (``adaptive`` false: every request gets the full tree), are never cut.
        The bound is per hand-over: a request left out of the next step keeps its
        tree for a later one, beside trees cut without it (that step may fall back)."""
        d = self.drafter
        spare = getattr(d.runner, "tree_spare_blocks", None)
        return len(spare) if spare and batch_size > 1 and d.adaptive_budget is not None else None

    def copies_wanted(self, roots) -> bool:
        """Whether this step searches for copies: they are on, the step has its
        roots, and the adaptive budget did not keep speculation off. Off, it
        predicts that plain steps win at this batch, and the steps it prices by
        the forward's time cost more than that served under load, where the
        processes around the forward share its cores. There, copies priced to
        pay lost to plain decoding (benchmarks/RESULTS.md, "Hybrid trees (copy
        branches)"), and the search itself costs every step."""
        d = self.drafter
        return d.copies is not None and roots is not None and d.last_depth > 0

    def copy_plan(self, trees, probs, num: np.ndarray, roots,
                  allowed: list[bool] | None = None):
        """(copies, tokens of each to verify) per request, or None
        (``copies_wanted``). Only the rows ``allowed`` a tree (None: all) are
        searched and priced; a plain row (``tree_safe`` refused it) gets none.
        Its copies are never grafted, so searching them was waste, and pricing
        them (with its bonus token) moved the tree rows' threshold and could make
        the copy estimates forget -- a batch the budget plans for its tree
        rows alone (``TreeEagleProposer._plan_depth``) prices copies so too."""
        d = self.drafter
        if not self.copies_wanted(roots):
            return None
        batch = d.runner.input_batch
        B = len(roots)
        rows = [b for b in range(B) if allowed is None or allowed[b]]
        found, mismatches = d.copies.find(batch.token_ids_cpu, batch.num_tokens_no_spec,
                                          roots.tolist(), batch.req_ids, rows)
        metrics = getattr(d.runner, "tree_metrics", None)
        if metrics is not None:
            metrics.on_fallback("copy_history_mismatches", mismatches)
            if d.copies.shared is not None:
                metrics.on_cross_request(d.copies.shared)
        kappa = d.adaptive_budget.kappa if d.adaptive_budget is not None else 1.0
        # Each searched row's bonus token, and its drafts' estimates.
        gain = len(rows) + sum(float(np.minimum(kappa * probs[b, 1: n + 1], 1.0).sum())
                               for b in rows if (n := int(num[b])))
        chains = trees is None or bool(trees.is_chain)
        lengths = d.copies.lengths(found, d.adaptive_budget, gain, int(num.sum()), chains)
        return _spread(found, rows, B), _spread(lengths, rows, B)


def _spread(per_row: list[list], rows: list[int], batch_size: int) -> list[list]:
    """``per_row``'s lists placed at batch rows ``rows``; empty lists elsewhere."""
    out: list[list] = [[] for _ in range(batch_size)]
    for b, value in zip(rows, per_row, strict=True):
        out[b] = value
    return out


def _scattered(a: np.ndarray, rows: list[int], batch_size: int) -> np.ndarray:
    """``a``'s rows placed at batch rows ``rows``; zeros (no tree) elsewhere."""
    out = np.zeros((batch_size,) + a.shape[1:], dtype=a.dtype)
    out[rows] = a
    return out
