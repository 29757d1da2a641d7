"""Whole-table forms of the tree sampler's on-demand steps, for tests and benchmarks.

The serving path (``vllm_glue.tree_sampler``, ``tree.accept``) asks for the
distribution or the sample of only the nodes an acceptance walk reaches. The
functions here compute them for every node of every tree up front: the
reference the on-demand forms are tested against (they must accept the same
tokens) and the "before" side of the cost benchmark (``tree_step_costs.py``).
Nothing in the serving path imports this module.
"""

from __future__ import annotations

import torch

from vllm_treespec.tree.accept import NodeProbs, probs_at_nodes, samples_on_path
from vllm_treespec.tree.tensorize import TreeBatch


def position_samples(target_probs: torch.Tensor, depth: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
    """[B, T] each node's sample for the positional rule (``tree.accept``'s
    docstring): argmax(p / E) with the noise of its position.
    ``greedy_accept(tree, samples)`` then accepts with it. target_probs: [B, T, V]
    (a table, every node samples); depth: [B, T] node depths; noise: [B, D+1, V]
    Exp(1) draws of the positions after the root (depth d samples position
    root + 1 + d)."""
    rows = torch.arange(depth.shape[0], device=depth.device).unsqueeze(1)
    return torch.argmax(target_probs.float() / noise[rows, depth], dim=-1)


def position_samples_on_path(tree: TreeBatch, target_probs: NodeProbs,
                             noise: torch.Tensor) -> torch.Tensor:
    """``position_samples`` where ``greedy_accept`` reads them, through the serving
    path's ``samples_on_path``: along each tree's accepted path, which the samples
    themselves choose, so at most D + 1 nodes per tree ask ``target_probs`` for a
    distribution (a [B, T, V] table, or (rows, nodes) -> [n, V] as for
    ``stochastic_accept``). noise: [B, >= deepest depth + 1, V] Exp(1) draws, as
    for ``position_samples``."""
    probs_at = probs_at_nodes(target_probs)

    def draw(rows, nodes, d):
        return torch.argmax(probs_at(rows, nodes).float() / noise[rows, d], dim=-1)

    return samples_on_path(tree, draw, min(tree.max_depth, noise.shape[1] - 1))


def processed_node_logits(logits: torch.Tensor, step, md) -> torch.Tensor:
    """[Bt, T, V] every node's ``engine.accept.NodeLogits`` (the serving path
    processes the nodes it reads only); ``md``: vLLM's sampling metadata."""
    from vllm_treespec.engine.accept import NodeLogits
    from vllm_treespec.vllm_glue.tree_sampler import tree_sampling  # imports vLLM

    return NodeLogits(logits, step, tree_sampling(md)).of_trees()


def node_table(probs, rows: torch.Tensor, tree_size: int) -> torch.Tensor:
    """[len(rows), T, V] every node's distribution of trees ``rows``, from a
    (rows, nodes) -> [n, V] function such as ``engine.accept.node_probs``."""
    nodes = torch.arange(tree_size, device=rows.device).repeat(len(rows))
    return probs(rows.repeat_interleave(tree_size), nodes).view(len(rows), tree_size, -1)
