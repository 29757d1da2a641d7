"""A request's proposed draft tree as plain lists: what the proposer hands the
scheduler (its tokens, BFS order) and keeps until the runner verifies it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ProposedTree:
    """A request's draft tree, as handed to the scheduler and later verified."""

    tokens: list[int]   # draft tokens, BFS order (root excluded)
    parents: list[int]  # parent node index of each draft node (root = 0)
    probs: list[float]  # draft probability of reaching each node (exp of its score)
    # With copy branches (``copy_source``): each node's sources (copy_drafts
    # flags) and, per copy, (its match length, the nodes its tokens are, its
    # source: own history or other requests).
    sources: list[int] | None = None
    branches: list[tuple[int, list[int], int]] = dataclasses.field(default_factory=list)
    # Under a grammar (``vllm_glue.grammar_trees``): per node, whether the
    # grammar's forced run grafted it (no drafter proposed it).
    forced: list[bool] | None = None

    @classmethod
    def chain(cls, tokens) -> "ProposedTree":
        """Drafts verified as a chain, each the child of the one before, with no
        draft probabilities: correct whatever the tokens (each is verified as a
        deterministic proposal), for drafts whose tree is unknown here."""
        tokens = list(tokens)
        return cls(tokens, list(range(len(tokens))), [0.0] * len(tokens))

    def prefix(self, n: int) -> "ProposedTree":
        """The first ``n`` nodes (BFS order keeps any prefix a tree)."""
        return ProposedTree(self.tokens[:n], self.parents[:n], self.probs[:n],
                            None if self.sources is None else self.sources[:n],
                            [(m, [i for i in nodes if i <= n], src)
                             for m, nodes, src in self.branches],
                            None if self.forced is None else self.forced[:n])


def kept_by_grammar(proposed: ProposedTree | None, tokens: list[int], parents: list[int],
                    probs: list[float], origin: list[int]) -> ProposedTree:
    """The tree a grammar walk kept of ``proposed`` (``vllm_glue.grammar_trees``):
    node ``i`` is ``proposed``'s node ``origin[i]`` (1-based), or a forced token
    grafted there (0). Copy sources and branches follow their nodes; without
    the proposed tree (another rank's drafts), or where its tokens differ, they
    are left out (the copy estimates learn nothing of the step)."""
    forced = [o == 0 for o in origin]
    if proposed is None or proposed.sources is None or any(
            o and (o > len(proposed.tokens) or proposed.tokens[o - 1] != t)
            for o, t in zip(origin, tokens)):
        return ProposedTree(tokens, parents, probs, forced=forced)
    new = {o: i + 1 for i, o in enumerate(origin) if o}
    sources = [proposed.sources[o - 1] if o else 0 for o in origin]
    branches = [(m, [new[i] for i in nodes if i in new], src)
                for m, nodes, src in proposed.branches]
    return ProposedTree(tokens, parents, probs, sources, branches, forced)


class ProposedTrees(dict):
    """req_id -> the ``ProposedTree`` a drafter proposed, kept until verified."""

    def tree_for(self, req_id: str, scheduled: list[int], shape=None) -> ProposedTree:
        """The tree of the scheduled drafts (a node's draft probability: the
        product of its path's; their sum is the drafts the proposer expects to be
        accepted).

        The scheduler may have truncated the drafts (token budget, max length): BFS
        order keeps any prefix a valid tree. ``shape``: the tree its grammar walk
        kept (``vllm_glue.grammar_trees.GrammarTree``; every rank gets the same).
        Drafts that do not match what was proposed (e.g. placeholders after a
        fallback) are verified as a chain, which is always correct.
        """
        if shape is not None:
            n = len(scheduled)
            return kept_by_grammar(self.get(req_id), list(scheduled), shape.parents[:n],
                                   shape.probs[:n], shape.origin[:n])
        if self.proposed_here(req_id, scheduled):
            return self[req_id].prefix(len(scheduled))
        return ProposedTree.chain(scheduled)

    def proposed_here(self, req_id: str, scheduled: list[int]) -> bool:
        """Whether the scheduled drafts are (a prefix of) what was proposed."""
        tree = self.get(req_id)
        n = len(scheduled)
        return tree is not None and len(tree.tokens) >= n and tree.tokens[:n] == list(scheduled)
