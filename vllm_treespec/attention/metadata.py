"""What a tree-attention backend receives from the runner and the drafter.

Both objects are device-agnostic and shared by every backend (CPU, Ascend,
reference); each backend only decides how to compute the same function.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_treespec.attention.reference import PagedTreeAttentionMetadata


@dataclasses.dataclass
class TreeVerifyRows:
    """Tree rows of a verify batch, in the reference's terms (shared by all layers).

    rows: [Nt] flat query-token indices of the tree requests' tokens
    meta: reference metadata over those rows only (queries re-packed densely)
    covers_batch: every query row of the step is a tree row (no other requests),
        so a backend can skip its regular kernel entirely
    chain_only: every tree row is causal-exact (``TreeBatch.causal_exact``: all
        trees of the step are chains), so a backend's causal kernel alone is exact
    spare_blocks: cache blocks outside the scheduler's that a backend may overwrite
        during the step (the CPU backend's chain copies; empty where none are reserved)
    scratch: per-step, layer-independent values a backend derives once (masks,
        indices) and reuses in every layer
    """

    rows: torch.Tensor
    meta: PagedTreeAttentionMetadata
    covers_batch: bool = False
    chain_only: bool = False
    spare_blocks: list[int] = dataclasses.field(default_factory=list)
    scratch: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class DraftTreeLevelMetadata:
    """Attention metadata of one tree-drafting level (drafter layers only).

    The level's B*F frontier tokens are queries; their K/V go to side-buffer
    columns ``[side_offset, side_offset + F)``; ``side_mask`` [B, F, side_offset+F]
    says which side entries each frontier node sees (ancestors and itself).
    """

    batch_size: int
    width: int
    side_offset: int
    side_capacity: int
    prefix_len: torch.Tensor
    max_prefix_len: int
    block_table: torch.Tensor
    block_size: int
    side_mask: torch.Tensor
    # Shared by all levels of one drafting step (e.g. a backend's gathered prefix).
    scratch: dict = dataclasses.field(default_factory=dict)
