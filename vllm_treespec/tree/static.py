"""Static trees (Medusa / OpenPangu style): the topology is fixed up front from
a list of child-rank paths (``"tree_choices"``), the drafter only fills in
tokens. :class:`StaticTreeBuilder` has :class:`~vllm_treespec.tree.build.DynamicTreeBuilder`'s
interface, so the proposer does not care which one it drives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from vllm_treespec.tree.build import Level, strictly_below, top_k_sanitized
from vllm_treespec.tree.tensorize import TreeBatch


@dataclasses.dataclass(frozen=True)
class StaticTopology:
    """A fixed tree from Medusa-style choices, in BFS order (node 0 = root)."""

    parent: tuple[int, ...]   # per node; parent[0] = 0
    depth: tuple[int, ...]
    rank: tuple[int, ...]     # child rank (which top-k slot the token comes from)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "StaticTopology":
        paths = sorted({tuple(c) for c in choices}, key=lambda p: (len(p), p))
        index = {(): 0}
        parent, depth, rank = [0], [0], [0]
        for p in paths:
            if p[:-1] not in index:
                raise ValueError(f"choice {list(p)} has no parent {list(p[:-1])}")
            index[p] = len(parent)
            parent.append(index[p[:-1]])
            depth.append(len(p))
            rank.append(p[-1])
        return cls(tuple(parent), tuple(depth), tuple(rank))

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def max_children(self) -> int:
        return max(self.rank[1:]) + 1


class StaticTreeBuilder:
    """Fills a fixed topology with the drafter's top-ranked tokens.

    The frontier forwarded at each level is the set of nodes at the previous depth
    that have children (only those need drafter scores).
    """

    def __init__(self, batch_size: int, topology: StaticTopology,
                 device: torch.device | str = "cpu", budget: torch.Tensor | None = None,
                 token_map: torch.Tensor | None = None):
        self.B, self.topo = batch_size, topology
        self.token_map = token_map
        self.device = torch.device(device)
        T = topology.num_nodes + 1
        self.budget = (torch.full((batch_size,), topology.num_nodes, dtype=torch.long,
                                  device=self.device)
                       if budget is None
                       else budget.to(self.device, torch.long).clamp(0, topology.num_nodes))
        self.token = torch.zeros(batch_size, T, dtype=torch.long, device=self.device)
        self.score = torch.full((batch_size, T), float("-inf"), device=self.device)
        self.score[:, 0] = 0.0
        # Per level d: nodes at depth d, their parents' slots in the level-(d-1)
        # frontier, their ranks; and the frontier (nodes at depth d with children).
        D = topology.max_depth
        self._levels = []
        has_kids = set(topology.parent[1:])
        prev_frontier = [0]
        for d in range(1, D + 1):
            nodes = [i for i in range(1, T) if topology.depth[i] == d]
            slot = [prev_frontier.index(topology.parent[i]) for i in nodes]
            ranks = [topology.rank[i] for i in nodes]
            frontier = [i for i in nodes if i in has_kids]
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
            self._levels.append((t(nodes), t(slot), t(ranks), t(frontier),
                                 t([nodes.index(i) for i in frontier]),
                                 t([topology.parent[i] for i in nodes]),
                                 max(ranks) + 1))
            prev_frontier = frontier
        self._level = 0

    @property
    def done(self) -> bool:
        # The frontier after level d is empty exactly when d is the deepest level.
        return self._level >= self.topo.max_depth

    def _fill(self, logprobs: torch.Tensor) -> Level:
        nodes, slot, ranks, frontier, frontier_pos, parent_ids, width = \
            self._levels[self._level]
        logp, tok = top_k_sanitized(logprobs, width, self.token_map)  # [B, F, w]
        node_tok = tok[:, slot, ranks]
        node_logp = logp[:, slot, ranks]
        parent_score = self.score[:, parent_ids]
        self.token[:, nodes] = node_tok
        self.score[:, nodes] = strictly_below(parent_score, parent_score + node_logp)
        self._level += 1
        return Level(tokens=node_tok[:, frontier_pos],
                     parent_slot=slot[frontier_pos].expand(self.B, -1),
                     depth=self._level, node_id=frontier.expand(self.B, -1))

    def first_level(self, root_logprobs: torch.Tensor) -> Level:
        assert self._level == 0
        return self._fill(root_logprobs.unsqueeze(1))

    def next_level(self, frontier_logprobs: torch.Tensor) -> Level:
        return self._fill(frontier_logprobs)

    def candidate_scores(self) -> torch.Tensor:
        return self.score[:, 1:]

    def finish(self, root_tokens: torch.Tensor, budget: torch.Tensor | None = None) -> TreeBatch:
        if budget is not None:
            self.budget = budget.to(self.device, torch.long).clamp(0, self.topo.num_nodes)
        T = self.topo.num_nodes + 1
        parent = torch.tensor(self.topo.parent, device=self.device).expand(self.B, T)
        depth = torch.tensor(self.topo.depth, device=self.device).expand(self.B, T)
        token = self.token.clone()
        token[:, 0] = root_tokens
        tree = TreeBatch(token=token, parent=parent.contiguous(), depth=depth.contiguous(),
                         node_counts=torch.full((self.B,), self.topo.num_nodes,
                                              dtype=torch.long, device=self.device),
                         max_depth=self.topo.max_depth,
                         max_children=self.topo.max_children, score=self.score.clone())
        return tree.truncated(self.budget)
