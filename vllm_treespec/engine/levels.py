"""Growing a drafting step's trees below the first pass, free of vLLM.

After the first pass the tree builder holds each request's root children;
``grow_levels`` forwards the drafter over the frontier a level at a time until
the builder is done (or the adaptive budget stops it). Level d forwards the F
frontier nodes of every request together (positions ``P' + d - 1``), attending
to the committed prefix plus their ancestors among the earlier levels' nodes,
kept in a per-layer side buffer; a structured request's scores are masked by
its grammar after each node (``LevelStep.draft_masks``). A one-wide level (a
chain's tip) may run as a chain step over the paged cache instead, where the
runner offers one (``LevelForwards.chain_level``), so that a chain costs a stock
chain's drafting.

The runner adapter supplies the forwards (``LevelForwards``); what the levels
forwarded (``LevelsRun``) and the step's timings (``StepTimes``) go to the
adaptive budget in one place (``hand_to_budget``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


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
    # Grammar masks of structured requests' nodes (``engine.draft_masks``), where
    # some request of the step drafts under its grammar.
    draft_masks: Any = None

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


class LevelForwards(Protocol):
    """The drafter forwards a runner adapter supplies to ``grow_levels``."""

    device: torch.device
    max_model_len: int

    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, V'] log-probabilities over the drafter's vocabulary."""

    def side_level(self, step: LevelStep, width: int, side_offset: int,
                   side_mask: torch.Tensor, *, input_ids: torch.Tensor,
                   positions: torch.Tensor, hidden_states: torch.Tensor):
        """One forward of ``width`` nodes a request over the paged prefix and the
        side buffer (``side_mask`` [B, width, side_offset + width]); their K/V go
        to side columns ``side_offset ..``. Returns (last_hidden, hidden)."""


ChainLevel = Callable[[torch.Tensor, torch.Tensor, Any, torch.Tensor],
                      tuple[torch.Tensor, torch.Tensor]]


def chain_steps(step: LevelStep, max_depth: int, max_model_len: int,
                chain_level: ChainLevel | None) -> bool:
    """Whether this step's levels run as paged chain steps: one node a level,
    the scheduler's lookahead covers them (``max_depth``: the configured depth)
    and the deepest tip stays within the model's length."""
    return (chain_level is not None and step.one_wide and step.depth <= max_depth
            and step.max_prefix + step.depth - 2 < max_model_len)


def grow_levels(builder, level, parent_hidden: torch.Tensor, step: LevelStep,
                forwards: LevelForwards, chain_level: ChainLevel | None = None) -> LevelsRun:
    """Forward the frontier level by level into ``builder``. ``chain_level``
    (block_table, prefix_len, level, parent_hidden) -> (last_hidden, hidden):
    the paged chain step, where this step's levels run as chain steps."""
    t0 = time.perf_counter()
    run = LevelsRun()
    B = step.batch_size
    parent_mask = torch.zeros(B, 1, 0, dtype=torch.bool, device=forwards.device)
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
        if chain_level is not None:  # F == 1
            last_hidden, hidden = chain_level(step.block_table, step.prefix_len, level,
                                              parent_hidden)
        else:
            last_hidden, hidden, parent_mask = side_level(
                forwards, step, level, F, parent_hidden, parent_mask, side_offset)
            side_offset += F
        logprobs = forwards.draft_vocab_logprobs(last_hidden).view(B, F, -1)
        if step.draft_masks is not None:
            logprobs = step.draft_masks.level(builder, level.node_id[:, :F], logprobs)
        parent_hidden = hidden.view(B, F, -1)
        level = builder.next_level(logprobs)
    run.seconds = time.perf_counter() - t0
    return run


def side_level(forwards: LevelForwards, step: LevelStep, level, F: int,
               parent_hidden: torch.Tensor, parent_mask: torch.Tensor, side_offset: int):
    """Forward the level's F best frontier nodes of every request; their K/V
    go to the side buffer's next F columns. Returns the drafter's outputs
    and the level's side mask (the next level's parents')."""
    B = step.batch_size
    device = forwards.device
    tokens, slot = level.tokens[:, :F], level.parent_slot[:, :F]   # [B, F]
    h_in = torch.gather(parent_hidden, 1,
                        slot.unsqueeze(-1).expand(-1, -1, parent_hidden.shape[-1]))
    # Each node sees its parent's side entries plus its own new column.
    inherited = torch.gather(parent_mask, 1,
                             slot.unsqueeze(-1).expand(-1, -1, parent_mask.shape[-1]))
    own = torch.eye(F, dtype=torch.bool, device=device).expand(B, F, F)
    side_mask = torch.cat([inherited, own], dim=2)
    positions = (step.prefix_len + (level.depth - 1)).clamp(max=forwards.max_model_len - 1)
    n = B * F
    last_hidden, hidden = forwards.side_level(
        step, F, side_offset, side_mask, input_ids=tokens.reshape(n).int(),
        positions=positions.repeat_interleave(F),  # contiguous: indexed raw
        hidden_states=h_in.reshape(n, -1))
    return last_hidden, hidden, side_mask


def hand_to_budget(budget, step: LevelStep, run: LevelsRun, times: StepTimes, *,
                   first_tokens: int, caught_up: int, verified: float, branching: bool,
                   unverified: int, agree: Callable[..., tuple] = lambda *s: s) -> None:
    """Hand a drafting step's costs and selection to the adaptive budget: the
    one place its timings are read. ``verified``: the mean drafter nodes a
    request goes on to verify; ``unverified``: requests left without a tree;
    ``agree``: the timings every tensor-parallel rank learns (rank 0's)."""
    budget.observe_budget(step.depth, verified, branching=branching, unverified=unverified,
                          levels=run.levels if run.sequential else None)
    # The rest of the step (planning, roots, selection, hand-over) is fixed
    # drafting work; catching up belongs to the off steps before, and
    # validation must not price speculation out.
    rest = (time.perf_counter() - times.start) - times.catch_up - times.first - run.seconds \
        - times.check
    first_s, levels_s, rest, catch_up_s = agree(times.first, run.seconds, rest, times.catch_up)
    budget.observe_catch_up(caught_up, catch_up_s)
    budget.observe_draft(first_tokens, first_s, run.levels, run.nodes_forwarded, levels_s,
                         batch=step.batch_size, overhead_s=rest,
                         one_wide=step.one_wide and run.sequential)
