"""Random valid trees for property tests (hypothesis strategies + a seeded generator)."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from vllm_treespec.tree import TreeBatch


def _grow(pick, n: int, vocab: int, max_children: int, root_token: int):
    """Grow a BFS-ordered tree: ``pick(options)`` chooses among candidates."""
    tokens, parents, depths, kids = [root_token], [0], [0], {0: 0}
    for i in range(1, n + 1):
        cands = [p for p in range(i)
                 if depths[p] >= depths[i - 1] - 1 and kids.get(p, 0) < max_children]
        if not cands:
            break
        p = pick(cands)
        used = {tokens[j] for j in range(1, i) if parents[j] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            break
        tokens.append(pick(free))
        parents.append(p)
        depths.append(depths[p] + 1)
        kids[p] = kids.get(p, 0) + 1
    return tokens, parents


@st.composite
def tree_lists(draw, max_nodes: int = 12, vocab: int = 8, max_children: int = 3):
    n = draw(st.integers(0, max_nodes))
    root = draw(st.integers(0, vocab - 1))
    return _grow(lambda xs: draw(st.sampled_from(xs)), n, vocab, max_children, root)


@st.composite
def tree_batches(draw, max_batch: int = 4, max_nodes: int = 12, vocab: int = 8,
                 max_children: int = 3):
    B = draw(st.integers(1, max_batch))
    trees = [draw(tree_lists(max_nodes, vocab, max_children)) for _ in range(B)]
    return TreeBatch.from_parents([t for t, _ in trees], [p for _, p in trees],
                                  tree_size=max_nodes + 1, max_depth=max_nodes or 1,
                                  max_children=max_children)


def random_tree_batch(rng: random.Random, batch: int, max_nodes: int, vocab: int,
                      max_children: int, exact_nodes: bool = False) -> TreeBatch:
    trees = []
    for _ in range(batch):
        n = max_nodes if exact_nodes else rng.randint(0, max_nodes)
        trees.append(_grow(rng.choice, n, vocab, max_children, rng.randrange(vocab)))
    return TreeBatch.from_parents([t for t, _ in trees], [p for _, p in trees],
                                  tree_size=max_nodes + 1, max_depth=max(max_nodes, 1),
                                  max_children=max_children)
