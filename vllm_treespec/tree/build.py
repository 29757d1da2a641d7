"""Growing draft trees depth by depth, batched over requests.

The drafter and the builder alternate: the drafter scores the current *frontier*
(the nodes it just forwarded), the builder picks the next frontier, and so on for
``depth`` levels; ``finish`` turns everything into a :class:`TreeBatch`.

Dynamic trees (EAGLE-2/3): the root expands its top-k tokens; at every deeper
level each of the k frontier nodes proposes its own top-k children, scored by
cumulative draft log-probability, and the best k of those k*k candidates form the
next frontier. At the end the best ``num_nodes`` of *all* candidates are kept and
laid out in BFS order. ``depth_weight`` w != 1 ranks both the frontiers and that
final selection by path probability times w per level (w > 1 favours deeper
trees); the scores the builder reports stay the draft's own.

Static trees (Medusa/OpenPangu style, ``static``) fix the topology up front from
a list of child-rank paths; the drafter only fills in tokens.

Both builders share one interface, so the proposer does not care which it has:

    level = builder.first_level(root_logprobs)          # [B, V]
    while not builder.done:
        w = builder.selectable_width()                  # dynamic trees: skip hopeless nodes
        frontier_logprobs = drafter(level.tokens[:, :w], level.parent_slot[:, :w], ...)
        level = builder.next_level(frontier_logprobs)   # [B, w, V]
    tree = builder.finish(root_tokens)

Everything is tensor code without host synchronisation.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from vllm_treespec.tree.tensorize import TreeBatch

# Draft log-probabilities below this are treated as this value. Keeps sums finite
# (no -inf - -inf = nan) while ranking such tokens last.
MIN_LOGPROB = -1.0e4


def top_k_sanitized(logprobs: torch.Tensor, k: int, token_map: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the draft vocabulary, with NaN / -inf scores made finite.

    Only the k winners are sanitised (cheap): NaN sorts first in ``topk`` but then
    scores MIN_LOGPROB, so a broken draft row yields unlikely, never invalid, nodes.
    ``token_map`` translates draft-vocabulary ids to target ids (EAGLE-3 drafters
    score a reduced vocabulary; the map is injective, so siblings stay distinct:
    the glue refuses a drafter whose map is not, ``support.check_token_map``).
    """
    logp, tok = torch.topk(logprobs, k, dim=-1)
    if token_map is not None:
        tok = token_map[tok]
    logp = torch.nan_to_num(logp.float(), nan=MIN_LOGPROB, neginf=MIN_LOGPROB, posinf=0.0)
    return logp.clamp(MIN_LOGPROB, 0.0), tok


def strictly_below(parent_score: torch.Tensor, child_score: torch.Tensor) -> torch.Tensor:
    """Clamp a child's cumulative score strictly below its parent's.

    Cumulative log-probabilities never increase along a path, but they can tie
    (a draft probability that rounds to 1). With a strict order, the top-n of all
    candidates is ancestor-closed whatever order ``topk`` breaks ties in: a
    selected child's parent scores strictly higher, so it is selected too.
    """
    return torch.minimum(child_score, torch.nextafter(parent_score,
                                                      torch.full_like(parent_score,
                                                                      float("-inf"))))


def top_by_key(key: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [B, k] of the k best entries by ``key``, ties by ``score``, then by
    index (all along the last dim, best first).

    A depth weight above 1 clamps several children to just below one parent's
    key; among those, the draft's own preference (their scores) decides, not
    ``topk``'s unspecified order. (Without a weight the builder calls ``topk``.)
    """
    by_score = torch.argsort(score, dim=-1, descending=True, stable=True)
    by_key = torch.argsort(torch.gather(key, -1, by_score), dim=-1, descending=True, stable=True)
    return torch.gather(by_score, -1, by_key[..., :k])


@dataclasses.dataclass(frozen=True)
class Level:
    """Nodes just added, which the drafter forwards next.

    tokens:      [B, F] token ids
    parent_slot: [B, F] index of each node's parent in the *previous* level's
                 frontier (0 for children of the root at the first level)
    depth:       depth of these nodes (1 for the first level)
    node_id:     [B, F] candidate ids (stable ids used by ``finish``)
    """

    tokens: torch.Tensor
    parent_slot: torch.Tensor
    depth: int
    node_id: torch.Tensor


class DynamicTreeBuilder:
    """EAGLE-2/3 dynamic tree: expand top-k per level, rerank to the node budget.

    Candidate ids: 0 is the root; level 1 holds ids 1..k; level d >= 2 holds k*k
    ids, the children of frontier slot f being ``f*k .. f*k+k-1`` within the level.
    Ids therefore grow with depth, which gives BFS order for free.
    """

    def __init__(self, batch_size: int, top_k: int, depth: int, num_nodes: int,
                 device: torch.device | str = "cpu", budget: torch.Tensor | None = None,
                 token_map: torch.Tensor | None = None, depth_weight: float = 1.0):
        self.B, self.k, self.depth, self.M = batch_size, top_k, depth, num_nodes
        self.log_depth_weight = math.log(depth_weight)
        self.device = torch.device(device)
        self.token_map = token_map
        n_cand = 1 + top_k + (depth - 1) * top_k * top_k
        if num_nodes > n_cand - 1:
            raise ValueError(f"num_nodes={num_nodes} exceeds the {n_cand - 1} candidates of "
                             f"a depth-{depth}, top_k-{top_k} tree")
        self.budget = (torch.full((batch_size,), num_nodes, dtype=torch.long,
                                  device=self.device)
                       if budget is None else budget.to(self.device, torch.long).clamp(0, num_nodes))
        self.tokens = torch.zeros(batch_size, n_cand, dtype=torch.long, device=self.device)
        self.parents = torch.zeros_like(self.tokens)
        self.depths = torch.zeros_like(self.tokens)
        self.scores = torch.full((batch_size, n_cand), float("-inf"), device=self.device)
        self.scores[:, 0] = 0.0
        # What frontiers and the final selection rank by: the score plus
        # depth * log(depth_weight), clamped strictly below the parent's key so that
        # the top-n stays closed under ancestors even when the weight lifts a child
        # above its parent. Equal to ``scores`` (bit for bit) when the weight is 1.
        self.keys = self.scores.clone()
        # The greedy chain (best child of the previous chain node, while expanded):
        # selecting only these keeps every tree a chain, which a device's causal
        # kernel verifies without tree attention.
        self.on_chain = torch.zeros(batch_size, n_cand, dtype=torch.bool, device=self.device)
        self._chain_tip = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._frontier_id: torch.Tensor | None = None  # [B, k] candidate ids
        self._frontier_score: torch.Tensor | None = None  # their draft scores
        self._frontier_key: torch.Tensor | None = None  # their keys, descending
        self._level = 0
        self._next_free = 1

    @property
    def done(self) -> bool:
        return self._level >= self.depth

    def first_level(self, root_logprobs: torch.Tensor) -> Level:
        """Root's top-k children. root_logprobs: [B, V] draft log-probs after the root."""
        assert self._level == 0
        logp, tok = top_k_sanitized(root_logprobs, self.k, self.token_map)
        # A NaN row's winners come first from topk but score MIN_LOGPROB once
        # sanitised: re-sort, as the frontier must be (``selectable_width``).
        logp, order = torch.sort(logp, dim=-1, descending=True)
        tok = torch.gather(tok, 1, order)
        score = strictly_below(torch.zeros_like(logp), logp)
        ids = torch.arange(1, 1 + self.k, device=self.device).expand(self.B, -1)
        self.tokens[:, 1:1 + self.k] = tok
        self.scores[:, 1:1 + self.k] = score
        key = score + self.log_depth_weight
        self.keys[:, 1:1 + self.k] = key
        self.depths[:, 1:1 + self.k] = 1
        self._frontier_id, self._frontier_score, self._frontier_key = ids, score, key
        self._level, self._next_free = 1, 1 + self.k
        rows = torch.arange(self.B, device=self.device)
        self._chain_tip = 1 + score.argmax(1)
        self.on_chain[rows, self._chain_tip] = True
        return Level(tokens=tok, parent_slot=torch.zeros_like(tok), depth=1, node_id=ids)

    def selectable_width(self) -> int:
        """How many of the frontier's best nodes can still have a child in the
        final top-``num_nodes`` (the largest such count over the batch).

        A child ranks strictly below its parent (``keys``), so when ``num_nodes``
        candidates already rank at least as high as a frontier node, none of its
        descendants can be selected: forwarding it would be wasted drafter work.
        The frontier is sorted by key, so the nodes worth forwarding are a
        prefix of it. One host sync.
        """
        assert self._frontier_key is not None and self._frontier_id is not None
        cand = self.keys[:, 1:self._next_free]                                    # [B, N]
        ahead = (cand.unsqueeze(1) >= self._frontier_key.unsqueeze(-1)).sum(-1)   # [B, k]
        width = int((ahead < self.M).sum(1).max())
        # The greedy chain's tip too: a chain-only selection may keep chain nodes
        # outside the top-M, and it must not be cut short.
        tip = self._frontier_id == self._chain_tip.unsqueeze(1)                   # [B, k]
        if bool(tip.any()):
            slots = torch.arange(tip.shape[1], device=self.device).expand_as(tip)
            width = max(width, int(slots[tip].max()) + 1)
        return max(width, 1)

    def frontier_scores(self, width: int) -> torch.Tensor:
        """[B, width] cumulative draft log-probs of the frontier's ``width`` best
        nodes by key (the ones the next level would forward)."""
        assert self._frontier_score is not None
        return self._frontier_score[:, :width]

    def next_level(self, frontier_logprobs: torch.Tensor) -> Level:
        """Expand the frontier. frontier_logprobs: [B, w, V] draft log-probs after the
        first ``w <= k`` frontier nodes (in the order of the previous Level; the
        frontier is sorted by key, so these are its w best). Nodes beyond w are
        not expanded: their would-be children stay non-candidates."""
        assert 1 <= self._level < self.depth and self._frontier_id is not None
        k = self.k
        w = frontier_logprobs.shape[1]
        assert 1 <= w <= k, (w, k)
        logp, tok = top_k_sanitized(frontier_logprobs, k, self.token_map)  # [B, w, k]
        parent_score = self._frontier_score[:, :w].unsqueeze(-1).expand(-1, -1, k)
        cum = strictly_below(parent_score, parent_score + logp).reshape(self.B, w * k)
        start = self._next_free
        self.tokens[:, start:start + w * k] = tok.reshape(self.B, w * k)
        self.scores[:, start:start + w * k] = cum
        parent_key = self._frontier_key[:, :w].unsqueeze(-1).expand(-1, -1, k)
        key = strictly_below(parent_key.reshape(self.B, w * k),
                             cum + (self._level + 1) * self.log_depth_weight)
        self.keys[:, start:start + w * k] = key
        self.depths[:, start:start + k * k] = self._level + 1
        self.parents[:, start:start + w * k] = (
            self._frontier_id[:, :w].unsqueeze(-1).expand(-1, -1, k).reshape(self.B, w * k))
        # Extend the greedy chain where its tip was expanded (is in the forwarded
        # frontier; with w = 1 the tip is always slot 0).
        tip_slot = self._frontier_id[:, :w] == self._chain_tip.unsqueeze(1)       # [B, w]
        extended = tip_slot.any(1)
        f = tip_slot.int().argmax(1)
        rows = torch.arange(self.B, device=self.device)
        child = cum.view(self.B, w, k)[rows, f].argmax(1)
        tip = start + f * k + child
        self.on_chain[rows[extended], tip[extended]] = True
        # A chain that ended stays ended (the sentinel matches no candidate id).
        self._chain_tip = torch.where(extended, tip, torch.full_like(tip, self.tokens.shape[1]))
        best = self._best(key, cum, k)  # next frontier among w*k
        self._frontier_id = start + best
        self._frontier_key = torch.gather(key, 1, best)
        self._frontier_score = torch.gather(cum, 1, best)
        self._level += 1
        self._next_free = start + k * k  # ids keep the k*k layout whatever w was
        return Level(tokens=torch.gather(tok.reshape(self.B, w * k), 1, best),
                     parent_slot=torch.div(best, k, rounding_mode="floor"),
                     depth=self._level, node_id=self._frontier_id)

    def grow_from_marginals(self, level: Level, marginals: torch.Tensor,
                            width: int | None = None) -> Level:
        """Expand every remaining level from per-depth marginals (parallel drafting):
        ``marginals`` [B, >= depth - 1, V] holds the draft log-probs of depths 2, 3, ..
        (after ``first_level``), one distribution per depth whatever the parent, so
        a path scores the sum of its tokens' marginals. At most ``width`` frontier
        nodes are expanded per level (1 keeps the greedy chain). Returns the last
        level (the builder is then ``done``)."""
        d = 0
        while not self.done and level.tokens.shape[1] > 0:
            w = min(level.tokens.shape[1], width or self.k)
            level = self.next_level(marginals[:, d:d + 1].expand(-1, w, -1))
            d += 1
        return level

    def _best(self, key: torch.Tensor, score: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k best by key (``top_by_key``); without a depth weight
        keys are the scores, and plain ``topk`` is what it always was."""
        if self.log_depth_weight == 0.0:
            return torch.topk(key, k, dim=-1).indices
        return top_by_key(key, score, k)

    def candidate_scores(self) -> torch.Tensor:
        """[B, N] cumulative draft log-probs of all candidates so far (root excluded)."""
        return self.scores[:, 1:self._next_free]

    def chain_candidates(self) -> torch.Tensor:
        """[B, N] bool, aligned with ``candidate_scores``: the greedy chain's nodes."""
        return self.on_chain[:, 1:self._next_free]

    def finish(self, root_tokens: torch.Tensor, budget: torch.Tensor | None = None,
               chain_only: bool = False) -> TreeBatch:
        """Rerank all candidates to each request's budget, in BFS order.

        ``budget`` overrides the per-request budgets given at construction;
        ``chain_only`` keeps only the greedy chain's nodes (each tree a chain).
        """
        if budget is not None:
            self.budget = budget.to(self.device, torch.long).clamp(0, self.M)
        used = self._next_free
        scores, keys, tokens, parents = (self.scores[:, :used], self.keys[:, :used],
                                         self.tokens[:, :used], self.parents[:, :used])
        if chain_only:
            # Ancestor-closed too: a chain node's parent is on the chain.
            keys = torch.where(self.on_chain[:, :used], keys,
                               torch.full_like(keys, float("-inf")))
            self.budget = torch.minimum(self.budget, self.on_chain[:, :used].sum(1))
        M = min(self.M, used - 1)
        # Best M draft candidates (root excluded), then keep each request's budget;
        # never more than the real candidates (levels that forwarded fewer than k
        # nodes leave unused ids at -inf).
        top_id = self._best(keys[:, 1:], scores[:, 1:], M)
        top_key = torch.gather(keys[:, 1:], 1, top_id)
        top_id = top_id + 1
        rank = torch.arange(M, device=self.device).unsqueeze(0)
        budget = torch.minimum(self.budget.clamp(max=M), torch.isfinite(top_key).sum(1))
        # Sort the kept ids ascending (= BFS); dropped ones sort last.
        sentinel = torch.full_like(top_id, used)
        order_key = torch.where(rank < budget.unsqueeze(1), top_id, sentinel)
        chosen, _ = torch.sort(order_key, dim=-1)
        kept = chosen < used
        chosen_safe = torch.where(kept, chosen, torch.zeros_like(chosen))
        # Candidate id -> node index (root 0 -> 0). The top-n is ancestor-closed.
        node_of = torch.zeros(self.B, used + 1, dtype=torch.long, device=self.device)
        node_of.scatter_(1, torch.where(kept, chosen, sentinel),
                         torch.where(kept, rank + 1, torch.zeros_like(rank)))
        node_of[:, used] = 0
        cand_parent = torch.gather(parents, 1, chosen_safe)
        node_parent = torch.where(kept, torch.gather(node_of, 1, cand_parent),
                                  torch.zeros_like(cand_parent))
        node_token = torch.where(kept, torch.gather(tokens, 1, chosen_safe),
                                 torch.zeros_like(chosen))
        node_score = torch.where(kept, torch.gather(scores, 1, chosen_safe),
                                 torch.full_like(top_key, float("-inf")))
        node_depth = torch.where(kept, torch.gather(self.depths, 1, chosen_safe),
                                 torch.ones_like(chosen))
        T = 1 + self.M
        token = torch.zeros(self.B, T, dtype=torch.long, device=self.device)
        parent = torch.zeros_like(token)
        score = torch.full((self.B, T), float("-inf"), device=self.device)
        token[:, 0] = root_tokens
        token[:, 1:1 + M] = node_token
        parent[:, 1:1 + M] = node_parent
        depth = torch.ones_like(token)
        depth[:, 0] = 0
        depth[:, 1:1 + M] = node_depth
        score[:, 0] = 0.0
        score[:, 1:1 + M] = node_score
        return TreeBatch(token=token, parent=parent, depth=depth, node_counts=budget,
                         max_depth=self.depth, max_children=self.k, score=score)
