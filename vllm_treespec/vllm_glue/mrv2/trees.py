"""The dynamic draft trees this slice grows on MRV2, from the first pass's root
log-probabilities to MRV2's ``[num_reqs, N]`` drafts.

The same tree as the V1 proposer's: a ``DynamicTreeBuilder`` seeded from the root,
grown a level at a time by the engine's level loop (``engine.levels.grow_levels``)
over the forwards the speculator supplies, reranked to ``num_nodes`` nodes in BFS
order. No vLLM here: ``tests/unit/test_mrv2_tree.py`` drives it with a toy drafter."""

from __future__ import annotations

import torch

from vllm_treespec.config import TreeSpecConfig
from vllm_treespec.engine.levels import LevelForwards, LevelStep, grow_levels
from vllm_treespec.tree import DynamicTreeBuilder, TreeBatch
from vllm_treespec.tree.proposed import ProposedTree


def fits(num_nodes: int, depth: int, top_k: int) -> bool:
    """Whether every tree has ``num_nodes`` nodes: each of the ``depth`` levels adds
    at least ``top_k`` candidates, and MRV2 verifies a fixed draft count per request
    (a shorter tree would leave placeholder drafts to verify)."""
    return num_nodes <= depth * top_k


def level_step(cfg: TreeSpecConfig, prefix_len: torch.Tensor,
               block_table: torch.Tensor) -> LevelStep:
    """The levels' shared inputs for a fixed tree: ``prefix_len`` [B] the new roots'
    positions (the drafter's KV is valid below them), ``block_table`` [B, blocks]
    the batch rows' blocks, in the KV manager's block size."""
    B = int(prefix_len.shape[0])
    return LevelStep(batch_size=B, depth=cfg.depth, prefix_len=prefix_len.long(),
                     max_prefix=int(prefix_len.max()) if B else 0, block_table=block_table,
                     width=cfg.top_k, dynamic=True,
                     # Every forwarded level's columns: the side buffer is per step.
                     side_capacity=max(1, cfg.top_k * (cfg.depth - 1)))


def grow_trees(cfg: TreeSpecConfig, forwards: LevelForwards, root_logprobs: torch.Tensor,
               parent_hidden: torch.Tensor, step: LevelStep, roots: torch.Tensor,
               num_nodes: int, token_map: torch.Tensor | None = None) -> TreeBatch:
    """Each request's tree of ``num_nodes`` nodes. ``root_logprobs`` [B, V'] the
    drafter's log-probabilities after each root (its own vocabulary; ``token_map``
    to target ids), ``parent_hidden`` [B, 1, H] the drafter's hidden state there,
    ``roots`` [B] the root tokens."""
    builder = DynamicTreeBuilder(step.batch_size, cfg.top_k, cfg.depth,
                                 min(num_nodes, cfg.max_candidates(cfg.depth)),
                                 forwards.device, None, token_map, cfg.depth_weight)
    level = builder.first_level(root_logprobs)
    grow_levels(builder, level, parent_hidden, step, forwards)
    return builder.finish(roots.long())


def tree_drafts(trees: TreeBatch, slots: int) -> tuple[torch.Tensor, list[ProposedTree]]:
    """MRV2's drafts [B, slots] (each tree's nodes in BFS order, -1 past them) and
    each request's tree, kept until the verify step reads its drafts back."""
    tokens = trees.token.cpu()
    parents = trees.parent.cpu()
    probs = torch.exp(trees.score.float()).cpu()
    counts = trees.node_counts.cpu().tolist()
    drafts = torch.full((trees.batch_size, slots), -1, dtype=torch.long)
    proposed = []
    for b, n in enumerate(counts):
        n = min(int(n), slots)
        drafts[b, :n] = tokens[b, 1: n + 1]
        proposed.append(ProposedTree(tokens[b, 1: n + 1].tolist(),
                                     parents[b, 1: n + 1].tolist(),
                                     probs[b, 1: n + 1].tolist()))
    return drafts.to(trees.token.device), proposed
