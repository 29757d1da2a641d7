"""The KV commit of a verify step, shared by every device and runner: the
accepted path of each tree moves to the front of its slots (``P+idx_k ->
P+k``), in every layer's KV cache and in the step's input ids and hidden
states, and positions become linear again. Afterwards the scheduler's
``num_computed -= rejected`` and the drafter's first pass see an ordinary
accepted chain."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_treespec.engine.layout import set_linear_positions
from vllm_treespec.engine.step import VerifyStep
from vllm_treespec.tree import compaction_plan


def commit_accepted(step: VerifyStep, acc, block_table: torch.Tensor, block_size: int,
                    move_kv: Callable[[torch.Tensor, torch.Tensor], None],
                    input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    """``acc``: the step's ``Acceptance``; ``block_table``: [num_reqs, max_blocks]
    of the step's batch (its KV-cache group); ``move_kv(src, dst)``: copies the
    KV of every layer from physical (block, offset) pairs ``src`` [N, 2] to
    ``dst`` (the device's layout; all sources read before any is written)."""
    if step.tree.is_chain:
        return  # accepted drafts are a prefix of their chain: in place, positions linear
    plan = compaction_plan(acc)
    if bool(plan.needs_copy.any()):  # else every accepted node already sits in its slot
        move_kv(*plan.slots(step.prefix_len, block_table[step.req_index], block_size))
        moves = plan.src != plan.dst
        tok_src = (step.token_start.unsqueeze(1) + plan.src)[moves]
        tok_dst = (step.token_start.unsqueeze(1) + plan.dst)[moves]
        buffers = [input_ids]
        if step.hidden_states is not None:
            buffers.append(step.hidden_states)
        buffers += list(step.aux_hidden_states or [])
        for buf in buffers:
            buf[tok_dst] = buf[tok_src]
    set_linear_positions(step, positions)
