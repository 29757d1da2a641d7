"""Tree attention masks and verify-step metadata.

Verification runs the target model once over each request's tree: the query is
the T nodes of the tree, written to *linear* KV slots ``prefix_len + i`` (node i),
but rotated with *depth-based* positions ``prefix_len + depth(i)`` so that each
node sees the positions it would have in a plain sequence. Node i attends to the
whole prefix plus its ancestors and itself — the "ancestor-or-self" mask.

The mask is dense bool (True = may attend); a backend that wants it packed
(the Triton kernel's ancestor words) packs it itself.
"""

from __future__ import annotations

import torch

from vllm_treespec.tree.tensorize import TreeBatch


def tree_mask(tree: TreeBatch) -> torch.Tensor:
    """[B, T, T] bool: ``mask[b, i, j]`` iff node j is an ancestor-or-self of node i
    and j is valid. Padding rows see only the root (never empty: no NaN softmax)."""
    B, T = tree.batch_size, tree.tree_size
    mask = torch.zeros(B, T, T, dtype=torch.bool, device=tree.device)
    mask.scatter_(2, tree.ancestors, True)
    return mask & tree.valid.unsqueeze(1)
