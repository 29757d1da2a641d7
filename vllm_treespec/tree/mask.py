"""Tree attention masks and verify-step metadata.

Verification runs the target model once over each request's tree: the query is
the T nodes of the tree, written to *linear* KV slots ``prefix_len + i`` (node i),
but rotated with *depth-based* positions ``prefix_len + depth(i)`` so that each
node sees the positions it would have in a plain sequence. Node i attends to the
whole prefix plus its ancestors and itself — the "ancestor-or-self" mask.

Masks come in the forms the backends need: dense bool (True = may attend) and
a compact bitmask (one bit per tree column).
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


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def ancestor_bitmask(tree: TreeBatch) -> torch.Tensor:
    """[B, T, W] int64 with W = ceil(T / 64): bit (j % 64) of word j // 64 in row i
    is set iff node i may attend to node j. Bit 63 is the sign bit (two's
    complement), so words are exact; read them with shifts and ``& 1``."""
    mask = tree_mask(tree)
    B, T, _ = mask.shape
    W = (T + 63) // 64
    if W * 64 != T:
        mask = torch.nn.functional.pad(mask, (0, W * 64 - T))
    weights = _BIT_WEIGHTS.get(mask.device)
    if weights is None:
        weights = torch.ones(64, dtype=torch.long, device=mask.device) << torch.arange(
            64, device=mask.device)
        _BIT_WEIGHTS[mask.device] = weights
    # Distinct powers of two: the sum is the bitwise OR and never overflows.
    return (mask.view(B, T, W, 64).long() * weights).sum(-1)


def bitmask_to_mask(bits: torch.Tensor, tree_size: int) -> torch.Tensor:
    """Inverse of :func:`ancestor_bitmask` (for checks): [B, T, W] -> [B, T, T] bool."""
    shifts = torch.arange(64, device=bits.device)
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1
    return unpacked.flatten(-2)[..., :tree_size].bool()


def tree_positions(tree: TreeBatch, prefix_len: torch.Tensor) -> torch.Tensor:
    """[B, T] rotary positions: ``prefix_len + depth`` (root at ``prefix_len``)."""
    return prefix_len.to(tree.depth).unsqueeze(1) + tree.depth
