"""Accepting a verified tree, and the KV compaction plan that commits it.

Inputs are the target model's outputs at every node of every tree (node i's
output predicts the token *after* node i). Two rules, both batched and free of
per-node Python loops (the stochastic walk loops over depth only):

* greedy (temperature 0): the longest root-to-node path whose every token equals
  the target's argmax at its parent; the bonus token is the argmax at the deepest
  accepted node. Emits exactly what plain greedy decoding would.

* stochastic (temperature > 0), lossless multi-draft rejection sampling for
  deterministic top-k drafts (the draft "distribution" of each child is a point
  mass). Walk from the root; at node n with target distribution p and children
  x_1..x_m (distinct tokens, best first), accept x_j with probability
  p_j(x_j) where p_1 = p and p_{j+1} = p_j with x_j removed and renormalised —
  i.e. with probability p(x_j) / (1 - p(x_1) - ... - p(x_{j-1})). On acceptance
  move to x_j and repeat; if every child is rejected (or n is a leaf) sample the
  bonus token from p with the children removed. Every emitted token is then
  distributed exactly as the target model's next-token distribution.

* positional (temperature > 0, a seeded request): the randomness of every
  sequence position is fixed in advance, an Exp(1) vector E_pos per position,
  and the token at a position is argmax(p / E_pos) (the exponential race: exact
  sampling from p). A node samples with the noise of its position, and a child
  is accepted iff it is its parent's sample, i.e. the greedy walk over samples
  instead of argmaxes. It accepts each child as often as the rule above (both
  sum p over the children) and emits exactly the sequence plain decoding with
  the same noise would, whatever the tree. The runner keys the noise of plain
  steps by position as well, so a seeded request reproduces even when the
  adaptive budget drafts different trees, or none, on another run.

The accepted path's nodes sit at KV slots ``prefix + idx_k``; the commit copies
them to ``prefix + k`` so the cache looks as if the accepted tokens had been
decoded one by one (idx_k >= k, and nothing to do when idx_k == k for all k).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from vllm_treespec.tree.nucleus import sample_rows
from vllm_treespec.tree.tensorize import TreeBatch

# Token id used to pad emitted-token rows (vLLM's placeholder convention). It is
# a value, never an index: acceptance never gathers with it.
PAD_TOKEN_ID = -1


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Result of accepting a batch of trees.

    path:         [B, D+1] accepted node ids from the root; entries past the
                  deepest accepted node repeat it (gather-safe)
    num_accepted: [B] accepted draft nodes a (0..D)
    tokens:       [B, D+1] emitted tokens: the a accepted draft tokens, then the
                  bonus token, then PAD_TOKEN_ID
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    tokens: torch.Tensor

    def put(self, rows: torch.Tensor, other: "Acceptance") -> "Acceptance":
        """This result with batch rows ``rows`` replaced by ``other`` (one row of
        ``other`` per entry of ``rows``, as from a ``TreeBatch.take``)."""
        return Acceptance(path=self.path.index_put((rows,), other.path),
                          num_accepted=self.num_accepted.index_put((rows,), other.num_accepted),
                          tokens=self.tokens.index_put((rows,), other.tokens))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a verified tree says about acceptance, for the adaptive budget.

    accepted:       [B] accepted draft nodes
    chain_accepted: [B] accepted nodes on the greedy chain (a leading part of the path)
    chain_censored: [B] the greedy chain ended there (it was accepted to its tip):
                    the tree, not the target, stopped it
    """

    accepted: list[int]
    chain_accepted: list[int]
    chain_censored: list[bool]

    @classmethod
    def of_chains(cls, accepted: Sequence[int]) -> "Outcome":
        """Accepted drafts of trees that are chains, none cut short by the tree."""
        return cls(list(accepted), list(accepted), [False] * len(accepted))

    @classmethod
    def of(cls, tree: TreeBatch, acc: Acceptance) -> "Outcome":
        if tree.is_chain:  # the chain is the tree; it ended where the tree did
            accepted, nodes = acc.num_accepted.tolist(), tree.node_counts.tolist()
            return cls(accepted, accepted, [a == n for a, n in zip(accepted, nodes)])
        a = acc.num_accepted
        chain = tree.greedy_chain
        D = acc.path.shape[1] - 1
        walked = torch.arange(1, D + 1, device=a.device).unsqueeze(0) <= a.unsqueeze(1)
        chain_accepted = (torch.gather(chain, 1, acc.path[:, 1:]) & walked).sum(1)
        chain_censored = chain_accepted == chain.sum(1) - 1
        return cls(a.tolist(), chain_accepted.tolist(), chain_censored.tolist())


def _emitted_tokens(tree: TreeBatch, path: torch.Tensor, num_accepted: torch.Tensor,
                    bonus: torch.Tensor) -> torch.Tensor:
    D1 = path.shape[1]
    tokens = torch.gather(tree.token, 1, path)  # token of path[d] at column d
    # Column d-1 holds the d-th accepted token; column a holds the bonus.
    out = torch.roll(tokens, shifts=-1, dims=1)
    k = torch.arange(D1, device=path.device).unsqueeze(0)
    a = num_accepted.unsqueeze(1)
    out = torch.where(k == a, bonus.unsqueeze(1), out)
    return torch.where(k > a, torch.full_like(out, PAD_TOKEN_ID), out)


def greedy_accept(tree: TreeBatch, target_argmax: torch.Tensor) -> Acceptance:
    """Longest matching path. target_argmax: [B, T] target argmax at each node."""
    if tree.is_chain:
        return _greedy_accept_chains(tree, target_argmax)
    return _greedy_accept_trees(tree, target_argmax)


def _greedy_accept_chains(tree: TreeBatch, target_argmax: torch.Tensor) -> Acceptance:
    """``greedy_accept`` where every tree is a chain: the matching prefix, without
    the ancestor table (a third of the ops; chain steps are common on the CPU)."""
    match = (tree.token[:, 1:] == target_argmax[:, :-1]) & tree.valid[:, 1:]
    num_accepted = match.long().cumprod(1).sum(1)
    d = torch.arange(tree.max_depth + 1, device=tree.device).unsqueeze(0)
    path = torch.minimum(d, num_accepted.unsqueeze(1))
    bonus = torch.gather(target_argmax, 1, num_accepted.unsqueeze(1)).squeeze(1)
    return Acceptance(path=path, num_accepted=num_accepted,
                      tokens=_emitted_tokens(tree, path, num_accepted, bonus))


def _greedy_accept_trees(tree: TreeBatch, target_argmax: torch.Tensor) -> Acceptance:
    parent_pred = torch.gather(target_argmax, 1, tree.parent)
    match = (tree.token == parent_pred) & tree.valid
    match[:, 0] = True
    B, T, D1 = tree.ancestors.shape
    path_ok = torch.gather(match, 1, tree.ancestors.reshape(B, T * D1)).view(B, T, D1).all(-1)
    # Deepest fully matching node (siblings carry distinct tokens, so it is unique).
    best = torch.argmax(torch.where(path_ok, tree.depth, -1), dim=1)
    path = torch.gather(tree.ancestors, 1,
                        best.view(B, 1, 1).expand(B, 1, D1)).squeeze(1)
    num_accepted = torch.gather(tree.depth, 1, best.unsqueeze(1)).squeeze(1)
    bonus = torch.gather(target_argmax, 1, best.unsqueeze(1)).squeeze(1)
    return Acceptance(path=path, num_accepted=num_accepted,
                      tokens=_emitted_tokens(tree, path, num_accepted, bonus))


# [B, T, V] distributions of every node, or rows, nodes -> [n, V] at those nodes.
NodeProbs = torch.Tensor | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def probs_at_nodes(
        target_probs: NodeProbs) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``NodeProbs`` as the (rows, nodes) -> [n, V] function the walks call."""
    if callable(target_probs):
        return target_probs
    return lambda rows, nodes: target_probs[rows, nodes]


def samples_on_path(tree: TreeBatch, draw: Callable[[torch.Tensor, torch.Tensor, int],
                                                    torch.Tensor],
                    max_depth: int | None = None) -> torch.Tensor:
    """[B, T] samples of the nodes on each tree's accepted path, which the samples
    themselves choose: ``draw(rows, nodes, d)`` gives trees ``rows``' samples at
    their ``nodes`` (depth ``d``, i.e. position root + 1 + d), asked for at most
    once per depth. Nodes off the path get -1, a token no child carries, so
    ``greedy_accept(tree, samples)`` is the same as with every node sampled."""
    B, T = tree.token.shape
    dev = tree.device
    samples = torch.full((B, T), -1, dtype=torch.long, device=dev)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    slots = torch.arange(tree.max_children, device=dev).unsqueeze(0)
    for d in range((tree.max_depth if max_depth is None else max_depth) + 1):
        node = cur[rows]
        drawn = draw(rows, node, d)
        samples[rows, node] = drawn
        kids = tree.children[rows, node]                                          # [n, C]
        match = (slots < tree.num_children[rows, node].unsqueeze(1)) & \
            (torch.gather(tree.token[rows], 1, kids) == drawn.unsqueeze(1))
        found = match.any(dim=1)
        moved = torch.gather(kids, 1, match.long().argmax(1, keepdim=True)).squeeze(1)
        cur[rows] = torch.where(found, moved, node)
        rows = rows[found]  # the walks that moved on
        if not rows.numel():
            break
    return samples


def stochastic_accept(tree: TreeBatch, target_probs: NodeProbs,
                      uniforms: torch.Tensor | None = None,
                      noise: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> Acceptance:
    """Lossless multi-draft rejection sampling (see module docstring).

    target_probs: [B, T, V] target next-token distribution at each node (after the
        request's temperature / top-k / top-p), or a function (rows [n], nodes
        [n]) -> [n, V] giving tree ``rows[i]``'s distribution at ``nodes[i]``: the
        walk reads at most D + 1 nodes per tree, so a caller whose distributions
        are costly (top-k / top-p sort the vocabulary) computes only those. Rows
        need not be normalised.
    uniforms: [B, D, C] U[0,1) draws, one per (depth, child slot); drawn if None.
    noise: [B, V] Exp(1) draws for the final residual sample (exponential race:
        argmax(r / E) is distributed as r / sum(r)); if None, the residual is
        sampled by inverse CDF from one uniform per tree (``sample_rows``: the
        same distribution without a draw per vocabulary entry, which costs
        about a millisecond a row on the CPU).
    """
    B, D, C = tree.batch_size, tree.max_depth, tree.max_children
    dev = tree.device
    rows = torch.arange(B, device=dev)
    probs_at = probs_at_nodes(target_probs)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    p_cur = probs_at(rows, cur).float()  # [B, V] at each walk's current node
    if uniforms is None:
        uniforms = torch.rand(B, D, C, device=dev, generator=generator)
    slots = torch.arange(C, device=dev).unsqueeze(0)
    children, num_children = tree.children, tree.num_children
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    path = [cur]
    for d in range(D):
        kids = children[rows, cur]                                   # [B, C]
        kid_ok = slots < num_children[rows, cur].unsqueeze(1)
        if not bool((kid_ok & walking.unsqueeze(1)).any()):
            break  # every walk has stopped: the rest of the path repeats cur
        kid_tok = torch.gather(tree.token, 1, kids)
        p_kid = torch.where(kid_ok, torch.gather(p_cur, 1, kid_tok), 0.0)
        mass_before = torch.cumsum(p_kid, dim=1) - p_kid
        # Accept x_j w.p. p(x_j) / (1 - mass of earlier siblings); written as a
        # product so a residual of 0 never divides. p(x_j) > 0 is required: a
        # zero-probability draft is never accepted, whatever the uniform draw.
        accept = (uniforms[:, d] * (1.0 - mass_before) < p_kid) & (p_kid > 0) & kid_ok
        accept &= walking.unsqueeze(1)
        took = accept.any(dim=1)
        first = torch.argmax(accept.to(torch.int8), dim=1)
        moved = torch.where(took, torch.gather(kids, 1, first.unsqueeze(1)).squeeze(1), cur)
        moved_rows = took.nonzero().squeeze(1)
        if moved_rows.numel():  # out of place: p_cur may be what probs_at returned
            p_cur = p_cur.index_put((moved_rows,), probs_at(moved_rows, moved[moved_rows]).float())
        cur = moved
        walking &= took
        path.append(cur)
    path += [cur] * (D + 1 - len(path))
    # Residual at the terminal node: its children (all rejected, or none) removed.
    kids = children[rows, cur]
    kid_ok = slots < num_children[rows, cur].unsqueeze(1)
    removed = torch.zeros_like(p_cur).scatter_add_(
        1, torch.gather(tree.token, 1, kids), kid_ok.float())
    residual = torch.where(removed > 0, 0.0, p_cur).clamp_min(0.0)
    # The residual only vanishes with probability 0 (rounding); fall back to p.
    residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, p_cur)
    if noise is None:
        bonus = sample_rows(residual, torch.rand(B, device=dev, generator=generator))
    else:
        bonus = torch.argmax(residual / noise, dim=1)
    path_t = torch.stack(path, dim=1)
    num_accepted = torch.gather(tree.depth, 1, cur.unsqueeze(1)).squeeze(1)
    return Acceptance(path=path_t, num_accepted=num_accepted,
                      tokens=_emitted_tokens(tree, path_t, num_accepted, bonus))


@dataclasses.dataclass(frozen=True)
class CompactionPlan:
    """KV copies that commit an accepted path, relative to each tree's root slot.

    src, dst: [B, D] slot offsets; copy ``prefix + src[b, k] -> prefix + dst[b, k]``.
        dst is 1..D; entries past the accepted length are identity copies (src ==
        dst), so the plan has a static shape and needs no masking.
    needs_copy: [B] bool, False when the accepted path already lies contiguously.
    """

    src: torch.Tensor
    dst: torch.Tensor
    needs_copy: torch.Tensor

    def slots(self, prefix_len: torch.Tensor, block_table: torch.Tensor,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flattened physical (block, offset) pairs of the real copies only.

        Returns ``(src, dst)`` each [N, 2] int64 (block id, offset in block).
        Host-synchronising (variable N): fine on the CPU, avoid in graphs.
        """
        moves = self.src != self.dst
        b, _ = moves.nonzero(as_tuple=True)
        pos_src = prefix_len.to(self.src)[b] + self.src[moves]
        pos_dst = prefix_len.to(self.src)[b] + self.dst[moves]

        def physical(pos: torch.Tensor) -> torch.Tensor:
            blk = block_table[b, torch.div(pos, block_size, rounding_mode="floor")]
            return torch.stack([blk.long(), pos % block_size], dim=1)

        return physical(pos_src), physical(pos_dst)


def compaction_plan(acc: Acceptance) -> CompactionPlan:
    D = acc.path.shape[1] - 1
    k = torch.arange(1, D + 1, device=acc.path.device).unsqueeze(0)
    dst = k.expand(acc.path.shape[0], D)
    src = torch.where(k <= acc.num_accepted.unsqueeze(1), acc.path[:, 1:], dst)
    return CompactionPlan(src=src, dst=dst, needs_copy=(src != dst).any(dim=1))


def apply_compaction(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                     block_dim: int = 0, slot_dim: int = 1) -> None:
    """Copy KV entries in place: ``cache[dst] = cache[src]`` for (block, offset) pairs.

    ``cache`` is any paged layout; ``block_dim``/``slot_dim`` say where the block
    index and the in-block offset live (CPU vLLM: 0 and 2; Ascend: 1 and 2 of a
    ``(2, blocks, block_size, heads, dim)`` cache). All sources are read before any
    destination is written, so overlapping plans are safe.
    """
    if src.numel() == 0:
        return
    view = cache.movedim((block_dim, slot_dim), (0, 1))
    view[dst[:, 0], dst[:, 1]] = view[src[:, 0], src[:, 1]]
