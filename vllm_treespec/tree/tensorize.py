"""Accelerator-safe tree tensors shared by every device.

A draft tree for request ``b`` is stored in a fixed-size slot of ``T = 1 + M``
nodes (M = node budget):

* node 0 is the *root*: the last token the target model already emitted (its KV
  is written in this verify step, at position ``prefix_len``). Its parent is
  itself (0), its depth 0. There is no "-1 = no parent" anywhere, so no negative
  index can ever reach a gather on any device.
* nodes ``1..node_counts[b]`` are draft tokens in BFS order: every parent precedes
  its children and depths never decrease. Hence *any prefix is a valid tree* —
  cutting a request's budget (the scheduler may truncate drafts) is just a
  smaller ``node_counts``.
* nodes ``node_counts[b]+1 .. T-1`` are padding: parent 0 (the root), depth 1,
  token 0, ``valid`` False. Padding keeps shapes static (graph capture) and is
  harmless: it only ever sees the root, and no valid node sees it.

Within one parent, children keep the order the builder gave them (best first);
the stochastic acceptance rule tries them in that order.
"""

from __future__ import annotations

import dataclasses
import functools

import torch


class TreeInvariantError(ValueError):
    """A tree violates an invariant; the message names the request and the node."""

    def __init__(self, request: int, node: int | None, what: str):
        where = f"request {request}" + (f", node {node}" if node is not None else "")
        super().__init__(f"tree invariant violated at {where}: {what}")
        self.request = request
        self.node = node


@dataclasses.dataclass(frozen=True, eq=False)
class TreeBatch:
    """A batch of draft trees, padded to ``T`` nodes each (see module docstring).

    token:     [B, T] int64 token ids (root = last emitted token; padding 0)
    parent:    [B, T] int64 parent node index (root and padding: 0)
    depth:     [B, T] int64 (root 0; padding 1)
    node_counts: [B]  int64 draft nodes per request (excluding the root; the
                      config's ``num_nodes`` is their budget)
    max_depth: static upper bound D on any depth (width of the ancestor table)
    max_children: static upper bound C on children per node (width of child tables)
    score:     optional [B, T] float32 cumulative draft log-probability (root 0)
    """

    token: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    node_counts: torch.Tensor
    max_depth: int
    max_children: int
    score: torch.Tensor | None = None

    # ---- shape -----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.token.shape[0]

    @property
    def tree_size(self) -> int:
        """T = 1 + M, the padded number of nodes per request."""
        return self.token.shape[1]

    @property
    def device(self) -> torch.device:
        return self.token.device

    def take(self, rows: torch.Tensor) -> "TreeBatch":
        """The trees of batch rows ``rows``, same padding and static bounds (a
        sampled step walks only its sampled trees)."""
        return TreeBatch(self.token[rows], self.parent[rows], self.depth[rows],
                         self.node_counts[rows], self.max_depth, self.max_children,
                         None if self.score is None else self.score[rows])

    @functools.cached_property
    def node_index(self) -> torch.Tensor:
        """[1, T] node indices (0..T-1)."""
        return torch.arange(self.tree_size, device=self.device).unsqueeze(0)

    @functools.cached_property
    def valid(self) -> torch.Tensor:
        """[B, T] bool: root and the first ``node_counts`` draft nodes."""
        return self.node_index <= self.node_counts.unsqueeze(1)

    # ---- derived tables (cached; computed with gathers only) -------------
    @functools.cached_property
    def ancestors(self) -> torch.Tensor:
        """[B, T, D+1] root-to-node paths: entry d is the ancestor at depth d.

        Entries beyond a node's own depth repeat the node itself, so the table is
        gather-safe and a row read left to right is the path root -> node -> node...
        """
        D = self.max_depth
        # up[..., s] = s-th ancestor (parent applied s times; sticks at the root).
        up = [self.node_index.expand_as(self.parent)]
        for _ in range(D):
            up.append(torch.gather(self.parent, 1, up[-1]))
        up_table = torch.stack(up, dim=-1)  # [B, T, D+1]
        d = torch.arange(D + 1, device=self.device)
        steps_up = (self.depth.unsqueeze(-1) - d).clamp(min=0)  # depth - d
        anc = torch.gather(up_table, 2, steps_up)
        return torch.where(d <= self.depth.unsqueeze(-1), anc, up_table[..., :1])

    @functools.cached_property
    def child_rank(self) -> torch.Tensor:
        """[B, T] position of each node among its valid siblings (root and padding: 0)."""
        T = self.tree_size
        same_parent = self.parent.unsqueeze(2) == self.parent.unsqueeze(1)  # [B, T, T]
        earlier = torch.ones(T, T, dtype=torch.bool, device=self.device).tril(-1)
        sib = same_parent & earlier & self.valid.unsqueeze(1)
        sib[:, :, 0] = False  # the root is nobody's sibling
        rank = sib.sum(-1)
        return torch.where(self.valid & (self.node_index > 0), rank, torch.zeros_like(rank))

    @functools.cached_property
    def children(self) -> torch.Tensor:
        """[B, T, C] children of each node in order; unused entries point at the root (0).

        A node has at most C = ``max_children`` children: the builders never make
        more, ``from_parents`` refuses more and ``validate`` checks it. (Beyond C,
        the clamp below would write a child over its C-th sibling's column.)
        """
        B, T, C = self.batch_size, self.tree_size, self.max_children
        table = torch.zeros(B, T * C + 1, dtype=torch.long, device=self.device)
        is_child = self.valid & (self.node_index > 0)
        # Non-children are routed to a spare column that is dropped afterwards.
        flat = torch.where(is_child, self.parent * C + self.child_rank.clamp(max=C - 1),
                           torch.full_like(self.parent, T * C))
        table.scatter_(1, flat, self.node_index.expand(B, T).clone())
        return table[:, : T * C].view(B, T, C)

    @functools.cached_property
    def num_children(self) -> torch.Tensor:
        """[B, T] number of valid children of each node."""
        is_child = (self.valid & (self.node_index > 0)).long()
        counts = torch.zeros_like(self.parent)
        counts.scatter_add_(1, self.parent, is_child)
        return counts

    @functools.cached_property
    def is_leaf(self) -> torch.Tensor:
        """[B, T] bool: valid nodes without valid children."""
        return self.valid & (self.num_children == 0)

    @functools.cached_property
    def causal_exact(self) -> torch.Tensor:
        """[B, T] bool: valid nodes whose ancestors are exactly the nodes before
        them (depth == index, the leading chain). Laid out linearly, their causal
        attention already is their tree attention, so a backend with a causal
        kernel needs to redo only the other rows (none when every tree is a chain).
        """
        return self.valid & (self.depth == self.node_index)

    @functools.cached_property
    def is_chain(self) -> bool:
        """Every tree is a chain (all valid nodes ``causal_exact``). One host sync."""
        return bool(torch.equal(self.causal_exact, self.valid))

    @functools.cached_property
    def greedy_chain(self) -> torch.Tensor:
        """[B, T] bool: the root and the chain of first children below it. Both
        builders lay siblings out best first, so this is the drafter's greedy
        chain, what a stock EAGLE chain would have proposed; the adaptive budget
        prices it apart from the tree."""
        if self.is_chain:
            return self.valid.clone()
        first = (self.child_rank == 0) & self.valid
        on_path = torch.gather(first, 1, self.ancestors.flatten(1)).view(self.ancestors.shape)
        return on_path.all(-1) & self.valid

    # ---- checks ------------------------------------------------------------
    def validate(self, vocab_size: int | None = None) -> None:
        """Check every invariant; raise TreeInvariantError naming request and node.

        Host-side and synchronising: for tests and ``validate_invariants`` mode.
        """
        B, T = self.token.shape
        for name in ("parent", "depth"):
            t = getattr(self, name)
            if t.shape != (B, T):
                raise TreeInvariantError(0, None, f"{name} has shape {tuple(t.shape)}, "
                                                  f"expected {(B, T)}")
        if self.node_counts.shape != (B,):
            raise TreeInvariantError(0, None, f"node_counts has shape "
                                              f"{tuple(self.node_counts.shape)}, expected {(B,)}")
        for name in ("token", "parent", "depth", "node_counts"):
            if getattr(self, name).dtype != torch.long:
                raise TreeInvariantError(0, None, f"{name} has dtype "
                                                  f"{getattr(self, name).dtype}, expected int64")
        token, parent, depth = self.token.cpu(), self.parent.cpu(), self.depth.cpu()
        counts = self.node_counts.cpu()
        valid = self.valid.cpu()
        for b in range(B):
            n = int(counts[b])
            if not 0 <= n <= T - 1:
                raise TreeInvariantError(b, None, f"node_counts {n} outside [0, {T - 1}]")
            if int(parent[b, 0]) != 0 or int(depth[b, 0]) != 0:
                raise TreeInvariantError(b, 0, "the root must have parent 0 and depth 0")
            for i in range(1, T):
                p, d = int(parent[b, i]), int(depth[b, i])
                if not 0 <= p < T:
                    raise TreeInvariantError(b, i, f"parent {p} outside [0, {T - 1}]")
                if not valid[b, i]:
                    if p != 0 or d != 1:
                        raise TreeInvariantError(b, i, f"padding must have parent 0 and "
                                                       f"depth 1, got parent {p} depth {d}")
                    continue
                if p >= i:
                    raise TreeInvariantError(b, i, f"parent {p} does not precede the node "
                                                   f"(parents first: acyclic, prefix-closed)")
                if d != int(depth[b, p]) + 1:
                    raise TreeInvariantError(b, i, f"depth {d} != parent {p}'s depth "
                                                   f"{int(depth[b, p])} + 1")
                if d > self.max_depth:
                    raise TreeInvariantError(b, i, f"depth {d} exceeds max_depth "
                                                   f"{self.max_depth}")
                if d < int(depth[b, i - 1]):
                    raise TreeInvariantError(b, i, f"depth {d} after depth "
                                                   f"{int(depth[b, i - 1])}: not in BFS order")
                tok = int(token[b, i])
                if tok < 0 or (vocab_size is not None and tok >= vocab_size):
                    raise TreeInvariantError(b, i, f"token {tok} outside "
                                                   f"[0, {vocab_size or 'vocab'})")
            for i in range(1, n + 1):
                p = int(parent[b, i])
                sibling_tokens = [int(token[b, j]) for j in range(1, i)
                                  if int(parent[b, j]) == p]
                if int(token[b, i]) in sibling_tokens:
                    raise TreeInvariantError(b, i, f"token {int(token[b, i])} repeats a "
                                                   f"sibling's (siblings must be distinct)")
                if len(sibling_tokens) >= self.max_children:
                    raise TreeInvariantError(b, i, f"node {p} has more than max_children="
                                                   f"{self.max_children} children")

    # ---- construction helpers ----------------------------------------------
    @classmethod
    def from_parents(cls, tokens: list[list[int]], parents: list[list[int]],
                     tree_size: int, max_depth: int | None = None,
                     max_children: int | None = None,
                     device: torch.device | str = "cpu") -> "TreeBatch":
        """Build from per-request Python lists (root included at index 0).

        ``parents[b][i]`` is the parent of node i (``parents[b][0]`` is ignored).
        A node with more than ``max_children`` children raises TreeInvariantError.
        Convenience for tests, static trees and traces — not the hot path.
        """
        B, T = len(tokens), tree_size
        tok = torch.zeros(B, T, dtype=torch.long)
        par = torch.zeros(B, T, dtype=torch.long)
        dep = torch.ones(B, T, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        deepest, widest = 1, 1
        for b, (ts, ps) in enumerate(zip(tokens, parents)):
            if len(ts) != len(ps) or not 1 <= len(ts) <= T:
                raise ValueError(f"request {b}: {len(ts)} tokens / {len(ps)} parents "
                                 f"for a tree of size {T}")
            num[b] = len(ts) - 1
            dep[b, 0] = 0
            tok[b, : len(ts)] = torch.tensor(ts, dtype=torch.long)
            kids: dict[int, int] = {}
            for i in range(1, len(ts)):
                p = ps[i]
                par[b, i] = p
                dep[b, i] = dep[b, p] + 1 if 0 <= p < i else 1
                deepest = max(deepest, int(dep[b, i]))
                kids[p] = kids.get(p, 0) + 1
                widest = max(widest, kids[p])
                if max_children is not None and kids[p] > max_children:
                    # ``children`` has max_children columns: refused here rather
                    # than written over another child's column.
                    raise TreeInvariantError(b, i, f"node {p} has {kids[p]} children; "
                                                   f"allowed: at most max_children="
                                                   f"{max_children}")
        return cls(token=tok.to(device), parent=par.to(device), depth=dep.to(device),
                   node_counts=num.to(device), max_depth=max_depth or deepest,
                   max_children=max_children or widest)

    def truncated(self, node_counts: torch.Tensor) -> "TreeBatch":
        """Keep only the first ``node_counts[b]`` draft nodes of each request.

        BFS order makes every prefix a valid tree, so this is just a smaller budget
        plus re-padding the dropped slots.
        """
        n = torch.minimum(node_counts.to(self.node_counts), self.node_counts)
        keep = self.node_index <= n.unsqueeze(1)
        zeros = torch.zeros_like(self.token)
        return TreeBatch(
            token=torch.where(keep, self.token, zeros),
            parent=torch.where(keep, self.parent, zeros),
            depth=torch.where(keep, self.depth, torch.ones_like(self.depth)),
            node_counts=n, max_depth=self.max_depth, max_children=self.max_children,
            score=None if self.score is None else torch.where(
                keep, self.score, torch.full_like(self.score, float("-inf"))),
        )

    def to_lists(self) -> list[dict[str, list[int]]]:
        """Per-request plain lists of the valid part (traces and failure dumps)."""
        out = []
        for b in range(self.batch_size):
            n = int(self.node_counts[b]) + 1
            out.append({"token": self.token[b, :n].tolist(),
                        "parent": self.parent[b, :n].tolist(),
                        "depth": self.depth[b, :n].tolist()})
        return out
