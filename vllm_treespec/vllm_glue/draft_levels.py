"""How a drafting step grows its trees below the first pass, on V1's EAGLE
proposer: the level strategies, one chosen when the drafter loads.

* ``SequentialLevels``: the engine's level loop (``engine.levels.grow_levels``),
  with V1's forwards: a level through the side buffer (``side_buffer_forward``,
  attention in ``draft_level``), or, where the runner's device allows it
  (``paged_chain_levels``: the CPU), a one-wide level (the chain's tip) as a
  stock EAGLE chain step over the paged cache (``paged_drafts``).
* ``ParallelLevels`` (``parallel_drafts``): one forward of parallel-drafting
  slots gives every depth's marginal.

A strategy reports what it forwarded (``LevelsRun``); the proposer hands that,
with the step's timings, to the adaptive budget in one place
(``engine.levels.hand_to_budget``).
"""

from __future__ import annotations

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context

from vllm_treespec.attention import DraftTreeLevelMetadata
from vllm_treespec.engine.levels import LevelsRun, LevelStep, chain_steps, grow_levels


class SequentialLevels:
    """The engine's level loop over V1's drafter (``engine.levels.LevelForwards``)."""

    def __init__(self, drafter, paged=None):
        self.drafter = drafter
        self.paged = paged  # PagedForwards where one-wide levels run as chain steps

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def max_model_len(self) -> int:
        return self.drafter.max_model_len

    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_vocab_logprobs(hidden)

    def side_level(self, step: LevelStep, width: int, side_offset: int,
                   side_mask: torch.Tensor, **inputs):
        return side_buffer_forward(self.drafter, step, width, side_offset, step.side_capacity,
                                   side_mask, **inputs)

    def grow(self, builder, level, parent_hidden: torch.Tensor, step: LevelStep) -> LevelsRun:
        chain_level = self.paged.chain_level if self.paged is not None else None
        if not chain_steps(step, self.drafter.tree_cfg.depth, self.max_model_len, chain_level):
            chain_level = None
        return grow_levels(builder, level, parent_hidden, step, self, chain_level)


def side_buffer_forward(drafter, step: LevelStep, width: int, side_offset: int,
                        side_capacity: int, side_mask: torch.Tensor, **inputs):
    """One drafter forward of ``width`` nodes a request, attending to the paged
    prefix and, by ``side_mask``, to the side buffer, where their K/V go
    (columns ``side_offset ..``; ``draft_level``): a sequential tree level or
    the parallel-drafting slots. ``inputs``: the drafter's input_ids,
    positions, hidden_states."""
    md = DraftTreeLevelMetadata(
        batch_size=step.batch_size, width=width, side_offset=side_offset,
        side_capacity=side_capacity, prefix_len=step.prefix_len, max_prefix_len=step.max_prefix,
        block_table=step.block_table, block_size=drafter.block_size, side_mask=side_mask,
        scratch=step.scratch)
    with set_forward_context({name: md for name in drafter._draft_attn_layer_names},
                             drafter.vllm_config, num_tokens=step.batch_size * width,
                             cudagraph_runtime_mode=CUDAGraphMode.NONE, slot_mapping={}):
        return drafter.model(**inputs)
