"""What a tree-attention backend receives from the runner and the drafter.

Both objects are device-agnostic and shared by every backend (CPU, Ascend,
reference); each backend only decides how to compute the same function.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PagedTreeAttentionMetadata:
    """What every tree-attention backend receives, besides q and the cache.

    query_start_loc: [B+1] int  token offsets of each request's queries
    seq_lens:        [B]   int  KV length per request, this step's tokens included
    block_table:     [B, max_blocks] int  physical block of each logical block
    block_size:      tokens per KV block
    tree_mask:       [B, Tq, Tq] bool or None — intra-query mask of tree rows
                     (ancestor-or-self); ignored for non-tree rows
    is_tree:         [B] bool or None — which rows use ``tree_mask`` (others causal)
    max_query_len / max_seq_len: host-side bounds (avoid a device sync when given)
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    tree_mask: torch.Tensor | None = None
    is_tree: torch.Tensor | None = None
    max_query_len: int | None = None
    max_seq_len: int | None = None


@dataclasses.dataclass
class TreeVerifyRows:
    """Tree rows of a verify batch, in the reference's terms (shared by all layers).

    rows: [Nt] flat query-token indices of the tree requests' tokens
    meta: reference metadata over those rows only (queries re-packed densely);
        None for a chain-only step on a device whose causal kernel needs nothing more
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
    meta: PagedTreeAttentionMetadata | None
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

    def write_side_kv(self, side: torch.Tensor | None, key: torch.Tensor,
                      value: torch.Tensor) -> torch.Tensor:
        """Store this level's frontier keys/values ([B*F, KVH, D]) in a layer's
        side buffer [2, B, capacity, KVH, D] and return the buffer: the one given,
        or a new one when the batch, the tree or the dtype outgrew it (one
        allocation per shape, none in the steady state)."""
        B, F = self.batch_size, self.width
        heads = key.shape[1:]
        if (side is None or side.shape[1] < B or side.shape[2] < self.side_capacity
                or side.shape[3:] != heads or side.dtype != key.dtype):
            side = torch.zeros(2, B, self.side_capacity, *heads, dtype=key.dtype,
                               device=key.device)
        lo, hi = self.side_offset, self.side_offset + F
        side[0, :B, lo:hi] = key[: B * F].view(B, F, *heads)
        side[1, :B, lo:hi] = value[: B * F].view(B, F, *heads)
        return side
