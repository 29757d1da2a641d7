"""Draft trees under a grammar (structured output: JSON schema, regex, choice, EBNF).

vLLM serves such a request by masking each position's logits with the grammar's
token bitmask; with chain speculation its scheduler cuts the drafts at the first
one the grammar rejects, and fills one mask per position, the bonus position
included (``StructuredOutputManager.grammar_bitmask``). A tree needs the same per
node: the tokens the grammar allows after the path root..node, which is the mask
acceptance applies to that node's target distribution.

Every function takes the request's grammar matcher (an ``xgrammar.GrammarMatcher``,
the object vLLM's xgrammar backend holds; only the methods ``Matcher`` lists are
called, so nothing here imports xgrammar or vLLM) in the request's current state:
the root, the last token the target emitted, already accepted. The root's mask
therefore constrains the first drafts.

* ``walk_tree``: the grammar walked depth-first down a tree, each node accepted
  once and rolled back once (no copy of the matcher): a bitmask row per node, which
  drafts the grammar allows (a draft below a rejected one is rejected too), and,
  if asked, the runs the grammar forces at each allowed node.
* ``graft_forced``: the rejected drafts cut and the forced runs grafted as chains
  where the drafter did not propose their first token.
* ``advance``: after a step, the matcher moved by exactly the emitted tokens.
* ``disallowed`` / ``apply_masks``: the rows in vLLM's ``[N, V]`` layout.

Trees are the proposer's lists (``tree.proposed.ProposedTree``): ``tokens[i]`` and
``parents[i]`` describe node ``i + 1``, node 0 is the root, and ``parents[i] <= i``:
BFS order, so a parent precedes its children and every prefix is a tree. Rows and
flags are indexed by node, the root first.

Bitmask layout (xgrammar's): int32 ``[N, ceil(V / 32)]``, bit ``j`` of word ``w``
set where token ``32 w + j`` is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

BITS = 32  # tokens per bitmask word


class Matcher(Protocol):
    """The calls made on a grammar matcher (``xgrammar.GrammarMatcher``)."""

    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> bool: ...
    def find_jump_forward_string(self) -> str: ...


class GrammarError(RuntimeError):
    """The grammar rejects a token the engine emitted: a bug, since acceptance
    applied the grammar's own mask to every emitted token."""


def bitmask_width(vocab_size: int) -> int:
    """Words of a bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + BITS - 1) // BITS


def full_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, W] int32 with every token allowed (what vLLM fills where no grammar
    constrains a position). Made by numpy: a torch fill of a few hundred kB goes
    to torch's thread pool, which on a busy machine costs more than the whole walk."""
    return torch.from_numpy(np.full((rows, bitmask_width(vocab_size)), -1, dtype=np.int32))


def disallowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, vocab_size] bool, True where a row's bitmask forbids the token: the
    convention of ``TreeSampling.allowed_mask``. Tokens past the bitmask's
    32 W are forbidden: no grammar emits them."""
    if masks.device.type == "cpu" and sys.byteorder == "little":
        # numpy unpacks a little-endian word's bytes in token order, some hundred
        # times faster than the shifts below (a drafting step unpacks every node).
        bits = np.unpackbits(masks.contiguous().numpy().view(np.uint8), axis=-1,
                             bitorder="little")
        out = torch.ones(masks.shape[0], vocab_size, dtype=torch.bool)
        width = min(vocab_size, bits.shape[1])
        out[:, :width] = torch.from_numpy(bits[:, :width] == 0)
        return out
    return _disallowed_by_shifts(masks, vocab_size)


def _disallowed_by_shifts(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``disallowed`` on any device."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=masks.device)
    # Arithmetic shift of an int32: bit 31 comes out as -1, and & 1 still reads it.
    bits = ((masks.unsqueeze(-1) >> shifts) & 1).view(masks.shape[0], -1)
    out = torch.ones(masks.shape[0], vocab_size, dtype=torch.bool, device=masks.device)
    width = min(vocab_size, bits.shape[1])
    out[:, :width] = bits[:, :width] == 0
    return out


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, V] with -inf where ``masks`` [N, W] forbids the token, in
    place (xgrammar's ``apply_token_bitmask_inplace`` does the same, but leaves
    logits past the bitmask's width unmasked, and xgrammar is vLLM's dependency,
    not ours)."""
    return logits.masked_fill_(disallowed(masks.to(logits.device), logits.shape[-1]),
                               float("-inf"))


def _check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
    for i, p in enumerate(parents):
        if not 0 <= p <= i:
            raise ValueError(f"node {i + 1}'s parent {p} does not precede it "
                             f"(BFS order: 0 <= parents[i] <= i)")


def _children(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p].append(i + 1)
    return kids


def _accepted_nodes(matcher: Matcher, tokens: Sequence[int],
                    parents: Sequence[int]) -> Iterator[int]:
    """The draft nodes whose path the grammar accepts, depth-first, each yielded
    with the matcher in its state (its path accepted). A rejected node's subtree
    is skipped. Every accepted token is rolled back exactly once, and the matcher
    is back in its starting state when the iteration ends or is abandoned."""
    kids = _children(parents)
    depth = 0  # tokens accepted beyond the starting state: the current path's length
    stack = [(child, 1) for child in reversed(kids[0])]
    try:
        while stack:
            node, d = stack.pop()
            # Depth-first, the node's parent lies on the current path: roll back to it.
            if depth >= d:
                matcher.rollback(depth - d + 1)
                depth = d - 1
            # Nothing follows an accepted stop token (xgrammar refuses it too; vLLM's
            # validate_tokens cuts a chain's drafts there).
            if matcher.is_terminated() or not matcher.accept_token(tokens[node - 1]):
                continue
            depth = d
            yield node
            stack.extend((child, d + 1) for child in reversed(kids[node]))
    finally:
        if depth:
            matcher.rollback(depth)


def _fill(matcher: Matcher, masks: torch.Tensor, row: int) -> None:
    # xgrammar raises on a terminated matcher; vLLM leaves such a row unconstrained
    # (the request ends with the stop token, so the row is never sampled).
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(masks, row)


def _bit(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // BITS]) >> (token % BITS)) & 1)


def only_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The token a bitmask row allows if it allows exactly one, else None."""
    words = np.flatnonzero(row.numpy())
    if len(words) != 1:
        return None
    w = int(words[0])
    word = int(row[w]) & 0xFFFFFFFF
    if word & (word - 1):  # more than one bit set
        return None
    token = w * BITS + word.bit_length() - 1
    return token if token < vocab_size else None


@dataclasses.dataclass(frozen=True)
class ForcedText:
    """Token texts, for the runs a grammar forces as text but not as tokens.

    Byte-level vocabularies rarely force a token: after ``{"`` a JSON schema with
    one key forces the text ``name": "``, yet ``n``, ``na``, ``nam`` and ``name``
    are all allowed tokens. Such text is taken as the longest allowed token it
    starts with, repeatedly (for that key: ``name``, ``":``, `` "``, the
    tokenizer's own split). The target may still pick another split, so these
    tokens are priced ``prob`` each, not certain."""

    ids_by_bytes: dict[bytes, list[int]]
    longest: int  # bytes of the longest token
    prob: float   # the price of each token taken from forced text

    @classmethod
    def from_vocab(cls, decoded_vocab: Sequence[bytes], prob: float) -> "ForcedText":
        """``decoded_vocab``: each token id's bytes (``xgrammar.TokenizerInfo
        .decoded_vocab``)."""
        if not 0.0 < prob <= 1.0:
            raise ValueError(f"forced text: prob {prob} outside (0, 1]")
        ids: dict[bytes, list[int]] = {}
        for token, text in enumerate(decoded_vocab):
            if text:
                ids.setdefault(bytes(text), []).append(token)
        return cls(ids, max(map(len, ids), default=0), prob)

    def longest_allowed(self, text: str, row: torch.Tensor) -> int | None:
        """The allowed token (``row``) that is the longest prefix of ``text``."""
        data = text.encode("utf-8")
        for length in range(min(len(data), self.longest), 0, -1):
            for token in self.ids_by_bytes.get(data[:length], ()):
                if _bit(row, token):
                    return token
        return None


@dataclasses.dataclass(frozen=True)
class ForcedRun:
    """Tokens the grammar forces from a state, and the price of each given the
    ones before it: 1.0 where it was the only token allowed (the target's masked
    distribution is a point mass there), ``ForcedText.prob`` where it splits
    forced text."""

    tokens: list[int]
    probs: list[float]


def forced_run(matcher: Matcher, cap: int, vocab_size: int, text: ForcedText | None = None,
               first_row: torch.Tensor | None = None) -> ForcedRun:
    """Up to ``cap`` tokens the grammar forces from the matcher's state, which
    is restored afterwards. ``first_row``: that state's bitmask row if already
    filled (``walk_tree`` has it)."""
    row = full_masks(1, vocab_size)
    tokens: list[int] = []
    probs: list[float] = []
    try:
        while len(tokens) < cap and not matcher.is_terminated():
            if first_row is not None and not tokens:
                row[0] = first_row
            else:
                matcher.fill_next_token_bitmask(row, 0)
            token, price = only_token(row[0], vocab_size), 1.0
            if token is None and text is not None:
                token = text.longest_allowed(matcher.find_jump_forward_string(), row[0])
                price = text.prob
            if token is None:
                break
            if not matcher.accept_token(token):
                raise GrammarError(f"the grammar rejects token {token}, which its own "
                                   f"mask allows")
            tokens.append(token)
            probs.append(price)
    finally:
        if tokens:
            matcher.rollback(len(tokens))
    return ForcedRun(tokens, probs)


@dataclasses.dataclass(frozen=True)
class GrammarWalk:
    """A tree walked under its request's grammar (nodes 0..N, the root first).

    masks: [N + 1, W] int32, row i: the tokens allowed after the path root..i.
        A rejected node's row is its nearest allowed ancestor's, as vLLM's chain
        fill reuses the last valid state's row after a rejected draft (never read
        by acceptance: the parent's mask gives the node's token no probability).
        The row after an accepted stop token allows everything (vLLM's fill).
    valid: whether the grammar accepts each node's path (the root: True).
    runs: node -> the run the grammar forces after it (``walk_tree``'s
        ``forced_cap``), at allowed nodes with a non-empty run only.
    """

    masks: torch.Tensor
    valid: list[bool]
    runs: dict[int, ForcedRun] = dataclasses.field(default_factory=dict)


def walk_tree(matcher: Matcher, tokens: Sequence[int], parents: Sequence[int],
              vocab_size: int, forced_cap: int = 0,
              text: ForcedText | None = None) -> GrammarWalk:
    """The grammar walked down a draft tree (``tokens``, ``parents``: BFS lists,
    see the module docstring). The matcher is back in its starting state after
    the walk, also when it raises. ``forced_cap`` > 0: the run each allowed node
    forces (``forced_run``), found on the way."""
    _check_tree(tokens, parents)
    n = len(tokens)
    masks = full_masks(n + 1, vocab_size)
    valid = [True] + [False] * n
    runs: dict[int, ForcedRun] = {}

    def visit(node: int) -> None:
        _fill(matcher, masks, node)
        if forced_cap > 0:
            run = forced_run(matcher, forced_cap, vocab_size, text, first_row=masks[node])
            if run.tokens:
                runs[node] = run

    visit(0)
    # closing: a raise inside the loop still rolls the matcher back at once.
    with contextlib.closing(_accepted_nodes(matcher, tokens, parents)) as nodes:
        for node in nodes:
            valid[node] = True
            visit(node)
    # Parents precede children, so in index order each source row is final.
    src = list(range(n + 1))
    for i in range(1, n + 1):
        if not valid[i]:
            src[i] = src[parents[i - 1]]
    if src != list(range(n + 1)):
        masks = torch.from_numpy(masks.numpy()[src])  # numpy: see full_masks
    return GrammarWalk(masks, valid, runs)


@dataclasses.dataclass(frozen=True)
class GraftedTree:
    """A tree cut to its grammar-valid drafts, forced runs grafted (BFS lists).

    index: old node id (0..N, the root 0) -> its id here, None where cut.
    forced: per node here (0..M, the root False): grafted from a forced run."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    forced: list[bool]
    index: list[int | None]


def graft_forced(tokens: Sequence[int], parents: Sequence[int], probs: Sequence[float],
                 walk: GrammarWalk, max_nodes: int, max_children: int,
                 max_depth: int) -> GraftedTree:
    """The drafts ``walk`` found valid, with each of its runs grafted as a chain
    below its node where no valid child holds the run's first token (where one
    does, that child carries its own run). A grafted node's probability is its
    parent's times the token's price. Runs of more probable nodes go first;
    a run stops at ``max_nodes`` nodes in all, ``max_children`` children of its
    node, or depth ``max_depth``. The result is in BFS order again: sorted by
    depth, stably, so drafted nodes keep their order and grafted ones follow
    them at each depth (a parent still precedes its children)."""
    _check_tree(tokens, parents)
    if len(walk.valid) != len(tokens) + 1:
        raise ValueError(f"a walk of {len(walk.valid)} nodes for a tree of "
                         f"{len(tokens) + 1}")
    tok = [-1] + list(tokens)
    par = [0] + list(parents)
    prob = [1.0] + [float(p) for p in probs]
    keep = [i for i in range(len(tok)) if walk.valid[i]]
    depth = [0] * len(tok)
    for i in keep[1:]:
        depth[i] = depth[par[i]] + 1
    kids = [0] * len(tok)
    child_tokens: dict[int, set[int]] = {i: set() for i in keep}
    for i in keep[1:]:
        kids[par[i]] += 1
        child_tokens[par[i]].add(tok[i])
    forced = [False] * len(tok)
    nodes = len(keep) - 1
    for v in sorted(walk.runs, key=lambda v: (-prob[v], v)):
        run = walk.runs[v]
        if run.tokens[0] in child_tokens[v] or kids[v] >= max_children:
            continue
        node = v
        for token, price in zip(run.tokens, run.probs):
            if nodes >= max_nodes or depth[node] >= max_depth:
                break
            kids[node] += 1
            tok.append(token)
            par.append(node)
            prob.append(prob[node] * price)
            depth.append(depth[node] + 1)
            kids.append(0)
            forced.append(True)
            keep.append(len(tok) - 1)
            node = len(tok) - 1
            nodes += 1
    order = sorted(keep[1:], key=depth.__getitem__)
    new: list[int | None] = [None] * len(tok)
    new[0] = 0
    for k, old in enumerate(order):
        new[old] = k + 1
    return GraftedTree([tok[i] for i in order], [new[par[i]] for i in order],
                       [prob[i] for i in order], [False] + [forced[i] for i in order],
                       new[:len(tokens) + 1])


def advance(matcher: Matcher, emitted: Sequence[int]) -> int:
    """Moves the matcher by a step's emitted tokens (the accepted drafts and the
    bonus token) and returns how many it took: all of them, unless the grammar
    terminated on the way (a stop token; what follows it is ignored, as vLLM's
    xgrammar backend ignores it, e.g. under ``ignore_eos``). Raises
    ``GrammarError`` on a token the grammar rejects, the matcher unmoved."""
    taken = 0
    for token in emitted:
        if matcher.is_terminated():
            break
        if not matcher.accept_token(int(token)):
            if taken:
                matcher.rollback(taken)
            raise GrammarError(
                f"the grammar rejects emitted token {int(token)} (position {taken} of "
                f"{[int(t) for t in emitted]}): acceptance must apply each node's "
                f"grammar mask (walk_tree) and cut the drafts the grammar rejects")
        taken += 1
    return taken
