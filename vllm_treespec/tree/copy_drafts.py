"""Copy drafts: branches taken from a request's own earlier tokens, grafted into its tree.

Where the text repeats itself (code that reuses identifiers, an edit of a given
text, quotes, JSON), the continuation that followed the last n tokens the last
time they occurred is often right for many tokens, and it costs no drafter
forward (prompt lookup; vLLM's ``ngram`` method drafts one such chain). A tree
can verify several of them beside the drafter's branches in the same forward.

``copy_continuations`` finds them: for n from ``max_ngram`` down to
``min_ngram``, every earlier occurrence of the history's last n tokens (the
``max_matches`` most recent of each n), most recent first, gives the tokens
after it; continuations that are a prefix of one
already kept add nothing and are dropped. The search runs every step for every
request, finding something or not, so it makes one numpy compare over the
history (the earlier occurrences of the last token) and extends only those
candidates backwards, ``max_ngram`` tokens at most: no Python loop over the
context, and no n-token window per position.

``graft`` merges them into a drafted tree (lists in BFS order, as the proposer
hands trees over): a copy token that equals an existing child of its parent
follows that child (one node, verified once), any other becomes a new node, so
siblings stay distinct. That is all stochastic acceptance needs to stay lossless
(``accept``: every draft is a point-mass proposal, whichever source proposed it).
Pure numpy / lists; no vLLM import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

# A node's sources (bit flags): the drafter, a copy from the request's own
# history, a copy from other requests' outputs (``shared_suffixes``).
EAGLE, COPY, OTHER = 1, 2, 4
BOTH = EAGLE | COPY


@dataclasses.dataclass(frozen=True)
class CopyDraft:
    tokens: tuple[int, ...]  # the continuation, first token after the root
    match: int               # how many history tokens before it matched
    source: int = COPY       # COPY (own history) or OTHER (other requests)
    tenant: Hashable = None  # OTHER: the tenant whose outputs it came from


def copy_continuations(history, max_ngram: int = 4, min_ngram: int = 2, length: int = 8,
                       max_branches: int = 2, max_matches: int = 32) -> list[CopyDraft]:
    """Up to ``max_branches`` distinct continuations of ``history`` (1-D token
    ids, the root last), longest match first, then most recent; of each match
    length, the ``max_matches`` most recent matches are read (text that repeats
    one passage over and over matches everywhere, and each match read is a
    Python step: the bound keeps a step's cost flat in the history's length)."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"copy drafts: min_ngram={min_ngram} and max_ngram={max_ngram} "
                         f"need 1 <= min_ngram <= max_ngram")
    h = np.asarray(history, dtype=np.int64)
    out: list[CopyDraft] = []
    if len(h) < 2:
        return out
    # Earlier positions holding the last token (the ends of candidate matches;
    # each has a known continuation), and how far each match reaches back.
    ends = np.flatnonzero(h[:-1] == h[-1])
    matched = np.ones(len(ends), dtype=np.int64)
    for k in range(1, max_ngram):
        live = (matched == k) & (ends >= k)
        if not live.any():
            break
        matched[live] += h[ends[live] - k] == h[-1 - k]
    ends, matched = ends[::-1], matched[::-1]  # most recent first
    for n in range(max_ngram, min_ngram - 1, -1):
        for e in ends[matched >= n][:max_matches]:
            cont = tuple(h[e + 1: e + 1 + length].tolist())
            if any(k.tokens[:len(cont)] == cont for k in out):
                continue
            out = [k for k in out if cont[:len(k.tokens)] != k.tokens]  # cont extends k
            out.append(CopyDraft(cont, n))
            if len(out) == max_branches:
                return out
    return out


@dataclasses.dataclass(frozen=True)
class Grafted:
    """A tree with copies grafted in (lists in BFS order, nodes 1..N)."""

    tokens: list[int]
    parents: list[int]          # parent node of each node (0 = the root)
    sources: list[int]          # EAGLE / COPY / OTHER flags of each node
    branches: list[list[int]]   # per copy: the nodes (1..N) its kept tokens are

    def __iter__(self):  # (tokens, parents, sources), as a tree's lists
        return iter((self.tokens, self.parents, self.sources))


def graft(tokens: list[int], parents: list[int], copies: list[CopyDraft], max_nodes: int,
          max_children: int, lengths: list[int] | None = None) -> Grafted:
    """``tokens`` / ``parents`` (draft nodes 1..N in BFS order, parent 0 = the
    root) with the copies grafted below the root, at most ``max_nodes`` nodes in
    all and ``max_children`` children a node (a copy stops where either would
    be exceeded), copy i cut to its first ``lengths[i]`` tokens if given.
    The drafted nodes keep their order; new nodes follow at each depth."""
    n = len(tokens)
    tok = [None] + list(tokens)
    par = [-1] + list(parents)
    depth = [0] * (n + 1)
    for i in range(1, n + 1):
        depth[i] = depth[par[i]] + 1
    src = [0] + [EAGLE] * n
    child: dict[tuple[int, int], int] = {(par[i], tok[i]): i for i in range(1, n + 1)}
    kids = [0] * (n + 1)
    for i in range(1, n + 1):
        kids[par[i]] += 1
    branches: list[list[int]] = []
    for c, copy in enumerate(copies):
        node, path = 0, []
        for t in copy.tokens[:None if lengths is None else lengths[c]]:
            nxt = child.get((node, t))
            if nxt is None:
                if len(tok) - 1 >= max_nodes or kids[node] >= max_children:
                    break
                kids[node] += 1
                kids.append(0)
                nxt = len(tok)
                tok.append(t)
                par.append(node)
                depth.append(depth[node] + 1)
                src.append(0)
                child[(node, t)] = nxt
            src[nxt] |= copy.source
            node = nxt
            path.append(nxt)
        branches.append(path)
    # BFS order: by depth, drafted nodes first at each depth, then in graft order;
    # a stable sort keeps every parent before its children.
    order = sorted(range(1, len(tok)), key=lambda i: depth[i])
    new_index = {0: 0, **{old: k + 1 for k, old in enumerate(order)}}
    return Grafted([tok[i] for i in order], [new_index[par[i]] for i in order],
                   [src[i] for i in order], [[new_index[i] for i in b] for b in branches])


def prune(g: Grafted, values: list[float], max_nodes: int) -> tuple[Grafted, list[int]]:
    """The ``max_nodes`` most valuable nodes of ``g`` (``values``: each node's
    estimated chance of acceptance) and their ids in ``g`` (1..N). A node's value
    is capped at its parent's, and ties go to the earlier node, so the kept nodes
    form a subtree (a parent is kept before its children) and keep BFS order."""
    n = len(g.tokens)
    if n <= max_nodes:
        return g, list(range(1, n + 1))
    v = [float("inf")] + list(values)
    for i in range(1, n + 1):
        v[i] = min(v[i], v[g.parents[i - 1]])
    keep = sorted(sorted(range(1, n + 1), key=lambda i: (-v[i], i))[:max_nodes])
    new = {0: 0, **{old: k + 1 for k, old in enumerate(keep)}}
    return Grafted([g.tokens[i - 1] for i in keep], [new[g.parents[i - 1]] for i in keep],
                   [g.sources[i - 1] for i in keep],
                   [[new[i] for i in b if i in new] for b in g.branches]), keep


def accepted_along(path: list[int], branch: list[int]) -> int:
    """How many of a copy's kept nodes ``branch`` the accepted ``path`` (node ids
    from the first accepted draft on) walked, from its first."""
    n = 0
    for node, want in zip(path, branch):
        if node != want:
            break
        n += 1
    return n
