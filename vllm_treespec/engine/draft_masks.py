"""Drafting under a grammar: the drafter's scores masked per tree node.

A structured-output request's drafts are cut by its grammar before the target
sees them (``engine.grammar.walk_tree``, in vLLM's scheduler); the drafter
itself knows nothing of the grammar, so at a JSON key or a closing brace most
of its top-k children are tokens the grammar rejects, and the tree loses them.
Masked drafting asks the grammar first: the drafter's log-probabilities after
each forwarded node are restricted to the tokens the grammar allows after the
node's path, and renormalised over them (the target's distribution at that node
is masked the same way, so the renormalised draft predicts acceptance better).
Every kept node is then one the grammar allows, and where it allows a single
token, that token is drafted with probability 1.

Acceptance does not read draft probabilities (drafts are deterministic top-k
proposals, accepted by the target's own masked distribution), so masking
changes which trees are drafted, never what is emitted.

The matcher (``engine.grammar.Matcher``: an xgrammar ``GrammarMatcher``) is in
the request's state after its last emitted token, the step's root; a node's
mask is filled after accepting its path, then rolled back. Nothing here
imports vLLM or xgrammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_treespec.engine.grammar import Matcher, bitmask_width, disallowed


def fill_after(matcher: Matcher, path: Sequence[int], masks: torch.Tensor, row: int) -> None:
    """``masks[row]``: the tokens the grammar allows after ``path`` (none where it
    rejects the path or has terminated); the matcher ends as it started."""
    accepted = 0
    try:
        for token in path:
            if not matcher.accept_token(int(token)):
                masks[row] = 0
                return
            accepted += 1
        if matcher.is_terminated():
            masks[row] = 0
        else:
            matcher.fill_next_token_bitmask(masks, row)
    finally:
        if accepted:
            matcher.rollback(accepted)


def path_to(tokens: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """The tokens from the root's child down to candidate ``node`` (a builder's
    per-request ``tokens`` / ``parents`` rows; candidate 0 is the root)."""
    path = []
    while node != 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def masked_logprobs(logprobs: torch.Tensor, masks: torch.Tensor, vocab_size: int,
                    token_map: torch.Tensor | None) -> torch.Tensor:
    """``logprobs`` [n, V'] over the drafter's vocabulary restricted to what
    ``masks`` [n, W] (over the target's ``vocab_size`` tokens) allows, and
    renormalised; ``token_map`` [V']: each draft token's target id (None: the
    same ids). A row that allows no draft token is all -inf (its children rank
    last; the scheduler's walk cuts them)."""
    # Draft ids past the target's vocabulary (a padded head) are forbidden too.
    forbidden = disallowed(masks, max(vocab_size, logprobs.shape[-1])).to(logprobs.device)
    forbidden = forbidden[:, token_map] if token_map is not None \
        else forbidden[:, :logprobs.shape[-1]]
    out = logprobs.float().masked_fill(forbidden, float("-inf"))
    norm = torch.logsumexp(out, dim=-1, keepdim=True)
    return out.sub_(norm.masked_fill_(~torch.isfinite(norm), 0.0))


class DraftMasks:
    """One drafting step's grammar masks for the builder rows that have a
    matcher (``matchers[b]``; None: that row drafts unmasked)."""

    def __init__(self, matchers: Sequence[Matcher | None], vocab_size: int,
                 token_map: torch.Tensor | None):
        self.matchers = list(matchers)
        self.rows = [b for b, m in enumerate(self.matchers) if m is not None]
        self.vocab_size = vocab_size
        self.token_map = token_map
        self.masked_nodes = 0  # nodes whose children were drafted under a mask

    def _mask(self, logprobs: torch.Tensor, paths: list[list[list[int]]]) -> torch.Tensor:
        """``logprobs`` [B, F, V'] with row ``rows[i]``'s F nodes masked after
        ``paths[i]``."""
        F = logprobs.shape[1]
        masks = torch.full((len(self.rows) * F, bitmask_width(self.vocab_size)), -1,
                           dtype=torch.int32)
        for i, (b, row_paths) in enumerate(zip(self.rows, paths)):
            for f, path in enumerate(row_paths):
                fill_after(self.matchers[b], path, masks, i * F + f)
        self.masked_nodes += len(self.rows) * F
        every = len(self.rows) == logprobs.shape[0]  # no copy of the batch needed
        rows = None if every else torch.tensor(self.rows, device=logprobs.device)
        part = logprobs if every else logprobs[rows]
        masked = masked_logprobs(part.reshape(len(self.rows) * F, -1), masks, self.vocab_size,
                                 self.token_map).view(part.shape).to(logprobs.dtype)
        if every:
            return masked
        out = logprobs.clone()
        out[rows] = masked
        return out

    def root(self, logprobs: torch.Tensor) -> torch.Tensor:
        """[B, V'] drafter log-probs after each request's root."""
        if not self.rows:
            return logprobs
        return self._mask(logprobs.unsqueeze(1), [[[]] for _ in self.rows]).squeeze(1)

    def level(self, builder, node_ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """[B, F, V'] drafter log-probs after the forwarded frontier nodes
        ``node_ids`` [B, F] (candidate ids of ``builder``: a
        ``DynamicTreeBuilder``, whose ``tokens`` / ``parents`` give the paths)."""
        if not self.rows:
            return logprobs
        idx = torch.tensor(self.rows)
        tokens = builder.tokens[idx].tolist()
        parents = builder.parents[idx].tolist()
        nodes = node_ids[idx].tolist()
        paths = [[path_to(tokens[i], parents[i], n) for n in nodes[i]]
                 for i in range(len(self.rows))]
        return self._mask(logprobs, paths)
