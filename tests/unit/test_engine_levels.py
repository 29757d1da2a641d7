"""The engine's drafting level loop (``engine.levels.grow_levels``) with a drafter
whose next-token law is a known table: each level forwards its frontier nodes
with the side mask of their ancestors, the builder keeps the likeliest paths,
and a budget that refuses a level ends the loop there."""

from __future__ import annotations

import torch

from vllm_treespec.engine.levels import LevelStep, chain_steps, grow_levels
from vllm_treespec.tree import DynamicTreeBuilder

V = 8


class TableDrafter:
    """A drafter whose hidden state is the one-hot of its input token and whose
    next token after t is t + 1 (mod V) with probability 0.7, t + 2 with 0.2.
    Records each level's side mask and inputs."""

    device = torch.device("cpu")
    max_model_len = 64

    def __init__(self):
        law = torch.full((V, V), 0.1 / (V - 2))
        for t in range(V):
            law[t, (t + 1) % V], law[t, (t + 2) % V] = 0.7, 0.2
        self.log_law = law.log()
        self.calls: list[dict] = []

    def draft_vocab_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.log_law  # hidden: one-hot rows

    def side_level(self, step, width, side_offset, side_mask, *, input_ids, positions,
                   hidden_states):
        self.calls.append({"width": width, "side_offset": side_offset,
                           "side_mask": side_mask.clone(), "tokens": input_ids.tolist(),
                           "positions": positions.tolist()})
        hidden = torch.nn.functional.one_hot(input_ids.long(), V).float()
        return hidden, hidden


def _step(depth: int, width: int, budget=None) -> LevelStep:
    return LevelStep(batch_size=1, depth=depth, prefix_len=torch.tensor([10]), max_prefix=10,
                     block_table=torch.zeros(1, 1, dtype=torch.long), width=width, dynamic=True,
                     side_capacity=width * depth, budget=budget)


def _grow(depth=3, width=2, budget=None):
    drafter = TableDrafter()
    builder = DynamicTreeBuilder(1, top_k=2, depth=depth, num_nodes=6)
    root = torch.nn.functional.one_hot(torch.tensor([0]), V).float()  # root token 0
    level = builder.first_level(drafter.draft_vocab_logprobs(root))
    run = grow_levels(builder, level, root.unsqueeze(1), _step(depth, width, budget), drafter)
    return drafter, builder, run


def test_levels_forward_the_frontier_under_its_ancestors_side_mask():
    drafter, builder, run = _grow()
    assert run.levels == 2 and run.nodes_forwarded == 4 and builder.done
    first, second = drafter.calls
    assert first["tokens"] == [1, 2] and first["positions"] == [10, 10]  # root's children
    assert first["side_mask"].tolist() == [[[True, False], [False, True]]]
    # Level 2's frontier: the two likeliest grandchildren (1 -> 2 and 1 -> 3), whose
    # parent (token 1) is side column 0; each sees it and its own new column.
    assert second["tokens"] == [2, 3] and second["positions"] == [11, 11]
    assert second["side_offset"] == 2
    assert second["side_mask"].tolist() == [[[True, False, True, False],
                                             [True, False, False, True]]]
    tree = builder.finish(torch.tensor([0]))
    tokens = tree.token[0, : int(tree.node_counts[0]) + 1].tolist()
    assert tokens[:2] == [0, 1] and 2 in tokens and 3 in tokens  # the likeliest chain 0 1 2 3


class RefuseAfter:
    """An adaptive budget that pays for ``n`` levels only."""

    def __init__(self, n):
        self.n = n

    def level_pays(self, frontier_scores, levels_done):
        return levels_done < self.n


def test_a_budget_that_refuses_a_level_ends_the_loop_there():
    drafter, builder, run = _grow(depth=3, budget=RefuseAfter(1))
    assert run.levels == 1 and len(drafter.calls) == 1 and not builder.done
    # Negative control: the same step with a budget that pays forwards both levels.
    drafter, _, run = _grow(depth=3, budget=RefuseAfter(5))
    assert run.levels == 2 and len(drafter.calls) == 2


def test_chain_steps_only_for_one_wide_levels_within_the_lookahead():
    chain = object()
    assert chain_steps(_step(3, 1), 4, 64, chain)
    assert not chain_steps(_step(3, 2), 4, 64, chain)      # two wide: the side buffer
    assert not chain_steps(_step(5, 1), 4, 64, chain)      # deeper than the lookahead
    assert not chain_steps(_step(3, 1), 4, 64, None)       # no chain step offered
    assert not chain_steps(_step(3, 1), 4, 11, chain)      # the tip would pass max length
