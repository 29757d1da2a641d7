"""How a drafting step grows its trees below the first pass: the level strategies.

After the first pass the tree builder holds each request's root children; a
strategy forwards the drafter over the frontier until the builder is done (or
the adaptive budget stops it). One is chosen when the drafter loads:

* ``SequentialLevels``: a level at a time. Level d forwards the F frontier
  nodes of every request together (positions ``P' + d - 1``), attending to the
  committed prefix plus their ancestors among the earlier levels' nodes, kept
  in a per-layer side buffer (``draft_level``). Where the runner's device
  allows it (``paged_chain_levels``: the CPU), a one-wide level (the chain's
  tip) runs as a stock EAGLE chain step over the paged cache instead
  (``paged_drafts``), so a chain costs a stock chain's drafting.
* ``ParallelLevels`` (``parallel_drafts``): one forward of parallel-drafting
  slots gives every depth's marginal.

A strategy reports what it forwarded (``LevelsRun``); the proposer hands that,
with the step's timings, to the adaptive budget in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context

from vllm_treespec.attention import DraftTreeLevelMetadata
from vllm_treespec.vllm_glue import rank_agreement


@dataclass
class LevelStep:
    """What every level of one drafting step shares."""

    batch_size: int
    depth: int            # the step's planned depth
    prefix_len: torch.Tensor   # [B] drafter KV valid below it (the new root's position)
    max_prefix: int
    block_table: torch.Tensor  # [B, blocks]
    width: int            # frontier nodes a level may forward per request
    dynamic: bool         # a dynamic tree (a static topology forwards all it has)
    side_capacity: int    # side-buffer columns the step may use
    budget: object | None = None  # the adaptive budget, where it may stop early
    scratch: dict = field(default_factory=dict)  # per-step backend state of the levels

    @property
    def one_wide(self) -> bool:
        return self.dynamic and self.width == 1


@dataclass
class LevelsRun:
    levels: int = 0
    nodes_forwarded: int = 0
    seconds: float = 0.0
    sequential: bool = True  # levels one after another (the budget learns their count)


@dataclass
class StepTimes:
    """Seconds of a drafting step's parts, which the adaptive budget prices apart."""

    start: float           # perf_counter at the step's start
    catch_up: float = 0.0  # deferred drafter inputs forwarded (the off steps' work)
    first: float = 0.0     # the first pass
    check: float = 0.0     # validation (a debugging mode)


def hand_to_budget(budget, step: LevelStep, run: LevelsRun, times: StepTimes, *,
                   first_tokens: int, caught_up: int, verified: float, branching: bool,
                   unverified: int) -> None:
    """Hand a drafting step's costs and selection to the adaptive budget: the
    one place its timings are read. ``verified``: the mean drafter nodes a
    request goes on to verify; ``unverified``: requests left without a tree."""
    budget.observe_budget(step.depth, verified, branching=branching, unverified=unverified,
                          levels=run.levels if run.sequential else None)
    # The rest of the step (planning, roots, selection, hand-over) is fixed
    # drafting work; catching up belongs to the off steps before, and
    # validation must not price speculation out.
    rest = (time.perf_counter() - times.start) - times.catch_up - times.first - run.seconds \
        - times.check
    first_s, levels_s, rest, catch_up_s = rank_agreement.timings(
        times.first, run.seconds, rest, times.catch_up)
    budget.observe_catch_up(caught_up, catch_up_s)
    budget.observe_draft(first_tokens, first_s, run.levels, run.nodes_forwarded, levels_s,
                         batch=step.batch_size, overhead_s=rest,
                         one_wide=step.one_wide and run.sequential)


class SequentialLevels:
    def __init__(self, drafter, paged=None):
        self.drafter = drafter
        self.paged = paged  # PagedForwards where one-wide levels run as chain steps

    def _chain_steps(self, step: LevelStep) -> bool:
        """Whether this step's levels run as paged chain steps: one node a level,
        the scheduler's lookahead covers them (``scheduling.reserve_tree_lookahead``)
        and the deepest tip stays within the model's length."""
        d = self.drafter
        return (self.paged is not None and step.one_wide
                and step.depth <= d.tree_cfg.depth
                and step.max_prefix + step.depth - 2 < d.max_model_len)

    def grow(self, builder, level, parent_hidden: torch.Tensor, step: LevelStep) -> LevelsRun:
        t0 = time.perf_counter()
        run = LevelsRun()
        chain = self._chain_steps(step)
        B = step.batch_size
        parent_mask = torch.zeros(B, 1, 0, dtype=torch.bool, device=self.drafter.device)
        side_offset = 0
        while not builder.done and level.tokens.shape[1] > 0:
            F = min(level.tokens.shape[1], step.width) if step.dynamic else level.tokens.shape[1]
            if step.dynamic and step.width > 1:  # only frontier nodes whose children can be kept
                F = min(F, builder.selectable_width())
            if step.budget is not None and not step.budget.level_pays(
                    builder.frontier_scores(F), run.levels):
                break  # too unsure to pay for another level (see AdaptiveBudget.level_pays)
            run.levels += 1
            run.nodes_forwarded += B * F
            if chain:  # F == 1
                last_hidden, hidden = self.paged.chain_level(step.block_table, step.prefix_len,
                                                             level, parent_hidden)
            else:
                last_hidden, hidden, parent_mask = self._side_level(
                    step, level, F, parent_hidden, parent_mask, side_offset)
                side_offset += F
            logprobs = self.drafter.draft_vocab_logprobs(last_hidden).view(B, F, -1)
            parent_hidden = hidden.view(B, F, -1)
            level = builder.next_level(logprobs)
        run.seconds = time.perf_counter() - t0
        return run

    def _side_level(self, step: LevelStep, level, F: int, parent_hidden: torch.Tensor,
                    parent_mask: torch.Tensor, side_offset: int):
        """Forward the level's F best frontier nodes of every request; their K/V
        go to the side buffer's next F columns. Returns the drafter's outputs
        and the level's side mask (the next level's parents')."""
        d = self.drafter
        B = step.batch_size
        tokens, slot = level.tokens[:, :F], level.parent_slot[:, :F]   # [B, F]
        h_in = torch.gather(parent_hidden, 1,
                            slot.unsqueeze(-1).expand(-1, -1, parent_hidden.shape[-1]))
        # Each node sees its parent's side entries plus its own new column.
        inherited = torch.gather(parent_mask, 1,
                                 slot.unsqueeze(-1).expand(-1, -1, parent_mask.shape[-1]))
        own = torch.eye(F, dtype=torch.bool, device=d.device).expand(B, F, F)
        side_mask = torch.cat([inherited, own], dim=2)
        positions = (step.prefix_len + (level.depth - 1)).clamp(max=d.max_model_len - 1)
        n = B * F
        last_hidden, hidden = side_buffer_forward(
            d, step, F, side_offset, step.side_capacity, side_mask,
            input_ids=tokens.reshape(n).int(),
            positions=positions.repeat_interleave(F),  # contiguous: indexed raw
            hidden_states=h_in.reshape(n, -1))
        return last_hidden, hidden, side_mask


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
