"""The tree shape this slice drafts on MRV2: the drafter's best path (one query per
request per level, as vLLM's decode steps run) plus siblings from each level's top-k.

Plain tensors, no vLLM: ``tests/unit/test_mrv2_tree.py``."""

from __future__ import annotations

import torch


def levels_needed(num_nodes: int, depth: int) -> int:
    """Drafter levels a tree of ``num_nodes`` nodes and at most ``depth`` levels takes."""
    return min(depth, num_nodes)


def fits(num_nodes: int, depth: int, top_k: int) -> bool:
    """Whether ``num_nodes`` nodes fit a chain of ``depth`` levels with at most
    ``top_k`` candidates (the chain's own node included) at each level."""
    return num_nodes <= depth * top_k


def node_picks(num_nodes: int, levels: int, top_k: int) -> list[tuple[int, int]]:
    """(level, rank) of each node, BFS order: the whole chain (rank 0) first, then the
    second-best token of every level, then the third, ...: a sibling at a shallow
    level is worth more than one deeper down only where the drafter is unsure, which a
    fixed shape cannot know, so every level gets the same number of siblings."""
    picks = [(d, r) for r in range(top_k) for d in range(levels)][:num_nodes]
    if len(picks) < num_nodes:
        raise ValueError(f"{num_nodes} nodes do not fit {levels} levels of top-{top_k}")
    return sorted(picks)  # by level, the chain's node first: BFS order


def chain_with_siblings(top: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, list[int]]:
    """``top``: [R, levels, K] each level's top-K draft tokens (rank 0: the token the
    chain continues with). Returns the tokens [R, num_nodes] in BFS order and each
    node's parent (1-based node index, 0 = the root), the same for every request:
    level ``d``'s nodes are children of the chain's node at level ``d - 1``."""
    _, levels, k = top.shape
    picks = node_picks(num_nodes, levels, k)
    index = {p: i + 1 for i, p in enumerate(picks)}
    parents = [0 if d == 0 else index[(d - 1, 0)] for d, _ in picks]
    depth_idx = torch.tensor([d for d, _ in picks], device=top.device)
    rank_idx = torch.tensor([r for _, r in picks], device=top.device)
    return top[:, depth_idx, rank_idx], parents
