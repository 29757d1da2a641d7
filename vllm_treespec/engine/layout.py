"""Where a step's tree rows sit: rotary positions ``prefix + depth`` while the
nodes are verified (their KV slots stay linear, ``prefix + i``), linear
positions again once the accepted path is committed, and the rows and
metadata every tree attention backend reads (``TreeVerifyRows``)."""

from __future__ import annotations

import torch

from vllm_treespec.attention import PagedTreeAttentionMetadata, TreeVerifyRows
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.tree import tree_mask


def set_tree_positions(step: VerifyStep, positions: torch.Tensor) -> None:
    """Depth-based rotary positions of a branching step's nodes in the runner's
    flat ``positions``; a chain's depths are its linear positions already."""
    tree = step.tree
    if not tree.is_chain:
        pos = step.prefix_len.unsqueeze(1) + tree.depth
        positions[step.node_tokens()[tree.valid]] = pos[tree.valid]


def set_linear_positions(step: VerifyStep, positions: torch.Tensor) -> None:
    """Linear positions again (after the commit): the drafter's first pass reads
    a plain chain."""
    tree = step.tree
    lin = step.prefix_len.unsqueeze(1) + tree.node_index
    positions[step.node_tokens()[tree.valid]] = lin[tree.valid]


def verify_rows(step: VerifyStep, total_rows: int, with_metadata: bool,
                block_table: torch.Tensor, block_size: int,
                spare_blocks: list[int]) -> TreeVerifyRows:
    """The step's tree rows for the attention backends. ``total_rows``: query
    rows of the whole step; ``with_metadata``: whether the device reads the
    reference metadata even where every tree is a chain; ``block_table``:
    [num_reqs, max_blocks] of the step's batch."""
    tree = step.tree
    rows = step.node_tokens()[tree.valid]
    chain_only = tree.is_chain
    meta = (None if chain_only and not with_metadata
            else tree_metadata(step, block_table, block_size))
    return TreeVerifyRows(rows=rows, meta=meta, covers_batch=rows.numel() == total_rows,
                          chain_only=chain_only, spare_blocks=spare_blocks)


def tree_metadata(step: VerifyStep, block_table: torch.Tensor,
                  block_size: int) -> PagedTreeAttentionMetadata:
    """The reference's metadata over the tree rows only (queries packed densely)."""
    tree = step.tree
    q_lens = tree.node_counts + 1
    qsl = torch.zeros(tree.batch_size + 1, dtype=torch.int32, device=q_lens.device)
    qsl[1:] = torch.cumsum(q_lens, 0)
    seq_lens = step.prefix_len + q_lens
    return PagedTreeAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq_lens.int(), block_table=block_table[step.req_index],
        block_size=block_size, tree_mask=tree_mask(tree),
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()))
