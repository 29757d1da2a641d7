"""Dynamic (EAGLE-2/3) and static tree building."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_treespec.tree import DynamicTreeBuilder, StaticTopology, StaticTreeBuilder


def run_dynamic(B, K, D, M, V, gen, budget=None, logprob_fn=None, depth_weight=1.0):
    logprob_fn = logprob_fn or (lambda *shape: torch.randn(*shape, V, generator=gen)
                                .log_softmax(-1))
    builder = DynamicTreeBuilder(B, K, D, M, budget=budget, depth_weight=depth_weight)
    draws = [logprob_fn(B)]
    builder.first_level(draws[0])
    while not builder.done:
        draws.append(logprob_fn(B, K))
        builder.next_level(draws[-1])
    return builder.finish(torch.arange(B)), draws


def naive_candidates(draws, b, K, D, w=1.0):
    """EAGLE-2's expansion, one request: (score, token, parent index or None, depth)
    per candidate and each candidate's worth (its score plus depth * log w, capped
    by its parent's worth); each level's frontier the K best of its candidates by
    worth, then score (then order: Python's sort is stable)."""
    cands, worth = [], []
    lp = draws[0][b]
    top = torch.topk(lp, K)
    frontier = []
    for s, t in zip(top.values.tolist(), top.indices.tolist()):
        cands.append((s, t, None, 1))
        worth.append(s + math.log(w))
        frontier.append(len(cands) - 1)
    for d in range(1, D):
        level = []
        for slot, f in enumerate(frontier):
            top = torch.topk(draws[d][b, slot], K)
            for s, t in zip(top.values.tolist(), top.indices.tolist()):
                cands.append((cands[f][0] + s, t, f, d + 1))
                worth.append(min(cands[-1][0] + (d + 1) * math.log(w), worth[f]))
                level.append(len(cands) - 1)
        level.sort(key=lambda c: (-worth[c], -cands[c][0]))
        frontier = level[:K]
    return cands, worth


def candidate_path(cands, c):
    path = []
    while c is not None:
        path.append(cands[c][1])
        c = cands[c][2]
    return tuple(path[::-1])


def naive_dynamic(draws, b, K, D, M):
    """Straight transcription of EAGLE-2's expand + rerank, one request."""
    cands, _ = naive_candidates(draws, b, K, D)
    keep = sorted(range(len(cands)), key=lambda c: -cands[c][0])[:M]
    return {candidate_path(cands, c) for c in keep}


def tree_paths(tree, b):
    out = set()
    n = int(tree.node_counts[b])
    for i in range(1, n + 1):
        path = tree.ancestors[b, i, 1: int(tree.depth[b, i]) + 1]
        out.add(tuple(tree.token[b, path].tolist()))
    return out


@given(K=st.integers(1, 4), D=st.integers(1, 5), data=st.data())
def test_dynamic_tree_matches_eagle_expand_and_rerank(K, D, data):
    max_m = K + (D - 1) * K * K
    M = data.draw(st.integers(max(D, 1) if D <= max_m else 1, max_m))
    seed = data.draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    B, V = 3, 11
    tree, draws = run_dynamic(B, K, D, M, V, gen)
    tree.validate(vocab_size=V)
    for b in range(B):
        assert int(tree.node_counts[b]) == M
        assert tree_paths(tree, b) == naive_dynamic(draws, b, K, D, M)
        # Scores: root 0, strictly decreasing along every path.
        s = tree.score[b]
        for i in range(1, M + 1):
            assert s[i] < s[int(tree.parent[b, i])]


@given(K=st.integers(1, 4), D=st.integers(1, 5), w=st.sampled_from([0.5, 0.8, 1.2, 1.5, 3.0]),
       sharp=st.sampled_from([1.0, 3.0]), data=st.data())
def test_a_depth_weight_selects_the_best_ancestor_closed_nodes_by_weighted_score(K, D, w, sharp,
                                                                                 data):
    """With ``depth_weight`` w a node's worth is its path probability times w per
    level, capped by its ancestors' (a node is verified only with its parent).
    Frontiers are the K best by worth; the kept nodes are the M best by worth and
    form a tree: every kept node is worth at least every candidate left out
    (within float rounding). ``sharp`` drafts are often sure of a token, which a
    weight above 1 lifts to its parent's cap."""
    max_m = K + (D - 1) * K * K
    M = data.draw(st.integers(1, max_m))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    B, V = 2, 11
    tree, draws = run_dynamic(
        B, K, D, M, V, gen, depth_weight=w,
        logprob_fn=lambda *shape: (sharp * torch.randn(*shape, V, generator=gen)).log_softmax(-1))
    tree.validate(vocab_size=V)
    for b in range(B):
        cands, worth = naive_candidates(draws, b, K, D, w)
        paths = {candidate_path(cands, c): c for c in range(len(cands))}
        kept = tree_paths(tree, b)
        assert int(tree.node_counts[b]) == M == len(kept)
        least_kept = min(worth[paths[p]] for p in kept)
        best_left = max((worth[c] for p, c in paths.items() if p not in kept), default=-math.inf)
        assert least_kept >= best_left - 1e-4
        # The tree reports the draft's own scores, not the weighted ones.
        for i in range(1, M + 1):
            path = tree.ancestors[b, i, 1: int(tree.depth[b, i]) + 1]
            assert math.isclose(float(tree.score[b, i]),
                                cands[paths[tuple(tree.token[b, path].tolist())]][0],
                                rel_tol=1e-5, abs_tol=1e-5)


def test_a_depth_weight_above_one_trades_a_root_child_for_a_deeper_node():
    """Root children p = 0.5, 0.45; after the first, a child of p = 0.88 (path
    0.44). EAGLE-2's two best nodes are the root's children; at w = 1.2 the path
    0.44 is worth 0.44 * 1.44 = 0.63 against 0.45 * 1.2 = 0.54: the chain."""
    V = 4
    root = torch.tensor([[0.5, 0.45, 0.03, 0.02]]).log()
    after = torch.tensor([[[0.88, 0.06, 0.03, 0.03], [0.25, 0.25, 0.25, 0.25]]]).log()
    chosen = {}
    for w in (1.0, 1.2):
        builder = DynamicTreeBuilder(1, 2, 2, 2, depth_weight=w)
        builder.first_level(root)
        builder.next_level(after)
        tree = builder.finish(torch.tensor([3]))
        tree.validate(vocab_size=V)
        chosen[w] = tree_paths(tree, 0)
        # Candidates keep their draft scores whatever the weight.
        assert torch.allclose(builder.candidate_scores()[0, :2], root[0, :2])
    assert chosen[1.0] == {(0,), (1,)}
    assert chosen[1.2] == {(0,), (0, 0)}


@given(K=st.integers(1, 4), D=st.integers(1, 5), data=st.data())
def test_a_tree_from_per_depth_marginals_is_eagle_with_the_marginal_at_every_node(K, D, data):
    """Parallel drafting: every node of depth d expands with depth d + 1's marginal;
    the result is EAGLE's expand + rerank on those draws, a path scores the sum of
    its marginals, and width 1 keeps the greedy chain of argmaxes."""
    max_m = K + (D - 1) * K * K
    M = data.draw(st.integers(max(D, 1) if D <= max_m else 1, max_m))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    B, V = 3, 11
    root = torch.randn(B, V, generator=gen).log_softmax(-1)
    marginals = torch.randn(B, max(D - 1, 1), V, generator=gen).log_softmax(-1)
    builder = DynamicTreeBuilder(B, K, D, M)
    builder.grow_from_marginals(builder.first_level(root), marginals)
    tree = builder.finish(torch.arange(B))
    tree.validate(vocab_size=V)
    draws = [root] + [marginals[:, d:d + 1].expand(-1, K, -1) for d in range(D - 1)]
    for b in range(B):
        assert tree_paths(tree, b) == naive_dynamic(draws, b, K, D, M)
        for i in range(1, M + 1):
            depth = int(tree.depth[b, i])
            path = tree.token[b, tree.ancestors[b, i, 1:depth + 1]]
            expected = root[b, path[0]] + sum(marginals[b, d - 1, path[d]] for d in range(1, depth))
            assert math.isclose(float(tree.score[b, i]), float(expected), abs_tol=1e-4)
    chain = DynamicTreeBuilder(B, K, D, D)
    chain.grow_from_marginals(chain.first_level(root), marginals, width=1)
    greedy = chain.finish(torch.arange(B), chain_only=True)
    for b in range(B):
        argmaxes = [int(root[b].argmax())] + [int(marginals[b, d].argmax()) for d in range(D - 1)]
        assert greedy.token[b, 1:D + 1].tolist() == argmaxes


def naive_greedy_chain(draws, b, K, D):
    """Best child of the chain's tip at each level, while the tip is expanded."""
    frontier = [(s, (t,)) for s, t in zip(*torch.topk(draws[0][b], K))]
    chain = [max(frontier)[1]]
    for d in range(1, D):
        level = []
        for slot, (fs, fpath) in enumerate(frontier):
            for s, t in zip(*torch.topk(draws[d][b, slot], K)):
                level.append((fs + s, fpath + (int(t),)))
        tip = [slot for slot, (_, p) in enumerate(frontier) if p == chain[-1]]
        if tip:
            chain.append(chain[-1] + (int(torch.argmax(draws[d][b, tip[0]])),))
        frontier = sorted(level, key=lambda x: -x[0])[:K]
        if not tip:
            break
    return [tuple(int(t) for t in p) for p in chain]


@given(K=st.integers(1, 4), D=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_chain_only_keeps_the_greedy_chain(K, D, seed):
    gen = torch.Generator().manual_seed(seed)
    B, V = 3, 11
    M = K + (D - 1) * K * K
    builder = DynamicTreeBuilder(B, K, D, M)
    draws = [torch.randn(B, V, generator=gen).log_softmax(-1)]
    builder.first_level(draws[0])
    while not builder.done:
        draws.append(torch.randn(B, K, V, generator=gen).log_softmax(-1))
        builder.next_level(draws[-1])
    chain_mask = builder.chain_candidates()
    tree = builder.finish(torch.arange(B), chain_only=True)
    tree.validate(vocab_size=V)
    assert torch.equal(tree.causal_exact, tree.valid)  # every tree is a chain
    for b in range(B):
        expected = naive_greedy_chain(draws, b, K, D)
        n = int(tree.node_counts[b])
        assert n == len(expected) == int(chain_mask[b].sum())
        assert tuple(tree.token[b, 1: n + 1].tolist()) == expected[-1]
    # A smaller budget keeps the chain's first nodes.
    short = builder.finish(torch.arange(B), budget=torch.tensor([1, 0, 2]), chain_only=True)
    assert torch.equal(short.causal_exact, short.valid)
    assert short.node_counts.tolist() == [1, 0, min(2, int(chain_mask[2].sum()))]


@given(seed=st.integers(0, 2**31), tie_kind=st.sampled_from(["one_hot", "uniform", "two"]))
def test_ties_keep_the_tree_ancestor_closed(seed, tie_kind):
    """Exact ties (prob 1 tokens, uniform drafts, -inf) must not break closure."""
    gen = torch.Generator().manual_seed(seed)
    V, K, D, M = 6, 3, 4, 20

    def logprob_fn(*shape):
        if tie_kind == "one_hot":  # one token with log-prob 0, all others -inf
            idx = torch.randint(0, V, shape, generator=gen)
            return torch.where(torch.nn.functional.one_hot(idx, V).bool(), 0.0,
                               float("-inf"))
        if tie_kind == "uniform":
            return torch.full((*shape, V), -math.log(V))
        lp = torch.full((*shape, V), float("-inf"))  # two equal tokens, nan elsewhere
        lp[..., :2] = math.log(0.5)
        lp[..., 2] = float("nan")
        return lp

    tree, _ = run_dynamic(2, K, D, M, V, gen, logprob_fn=logprob_fn)
    tree.validate(vocab_size=V)
    assert (tree.node_counts == M).all()
    assert torch.isfinite(tree.score[:, : M + 1]).all()


def test_per_request_budgets_and_bfs_prefix():
    gen = torch.Generator().manual_seed(0)
    budget = torch.tensor([16, 5, 0, 1])
    tree, _ = run_dynamic(4, 4, 4, 16, 30, gen, budget=budget)
    tree.validate()
    assert tree.node_counts.tolist() == [16, 5, 0, 1]
    full, _ = run_dynamic(4, 4, 4, 16, 30, torch.Generator().manual_seed(0))
    # A budget of n keeps the best n candidates: the same set as the top-n of the
    # full tree's scores (not merely its first n nodes).
    for b in range(4):
        n = int(budget[b])
        best = set(torch.topk(full.score[b, 1:], n).values.tolist()) if n else set()
        assert set(tree.score[b, 1: n + 1].tolist()) == best


def test_depth_one_tree_is_the_root_top_k():
    lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]), -1)
    b = DynamicTreeBuilder(1, 3, 1, 3)
    level = b.first_level(lp)
    assert b.done and level.tokens.tolist() == [[1, 3, 2]]
    tree = b.finish(torch.tensor([4]))
    assert tree.token[0].tolist() == [4, 1, 3, 2]
    assert tree.parent[0].tolist() == [0, 0, 0, 0]


def test_frontier_parent_slots_point_into_the_previous_frontier():
    gen = torch.Generator().manual_seed(1)
    K, V = 3, 9
    b = DynamicTreeBuilder(2, K, 3, 12)
    prev = b.first_level(torch.randn(2, V, generator=gen).log_softmax(-1))
    while not b.done:
        lp = torch.randn(2, K, V, generator=gen).log_softmax(-1)
        level = b.next_level(lp)
        # Each new frontier token is among its parent's top-K draft tokens.
        for r in range(2):
            for j in range(K):
                slot = int(level.parent_slot[r, j])
                assert int(level.tokens[r, j]) in torch.topk(lp[r, slot], K).indices.tolist()
        prev = level
    assert prev.depth == 3


def test_too_large_budget_is_refused():
    with pytest.raises(ValueError, match="exceeds the 4 candidates"):
        DynamicTreeBuilder(1, 4, 1, 5)


CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]


def test_static_topology_from_choices_is_bfs():
    topo = StaticTopology.from_choices(CHOICES)
    assert topo.num_nodes == 9 and topo.max_depth == 4 and topo.max_children == 3
    assert list(topo.parent) == [0, 0, 0, 0, 1, 1, 2, 4, 5, 7]
    assert list(topo.depth) == [0, 1, 1, 1, 2, 2, 2, 3, 3, 4]


def test_static_tree_fills_tokens_by_rank():
    topo = StaticTopology.from_choices(CHOICES)
    gen = torch.Generator().manual_seed(3)
    V, B = 20, 2
    builder = StaticTreeBuilder(B, topo, budget=torch.tensor([9, 4]))
    scores = {}
    level = builder.first_level(root := torch.randn(B, V, generator=gen).log_softmax(-1))
    scores[0] = root
    frontier_nodes = [[0]]
    while not builder.done:
        lp = torch.randn(B, level.tokens.shape[1], V, generator=gen).log_softmax(-1)
        frontier_nodes.append(level.node_id[0].tolist())
        scores[len(scores)] = lp
        level = builder.next_level(lp)
    tree = builder.finish(torch.tensor([7, 8]))
    tree.validate(vocab_size=V)
    assert tree.node_counts.tolist() == [9, 4]
    # Node with path (r_1..r_d) carries the r_d-th best draft token of its parent.
    for b in range(B):
        for i in range(1, int(tree.node_counts[b]) + 1):
            p, d, r = topo.parent[i], topo.depth[i], topo.rank[i]
            slot = frontier_nodes[d - 1].index(p)
            lp = scores[d - 1][b] if d == 1 else scores[d - 1][b, slot]
            assert int(tree.token[b, i]) == int(torch.topk(lp, r + 1).indices[r])


def test_static_choices_need_parents():
    with pytest.raises(ValueError, match="has no parent"):
        StaticTopology.from_choices([[0], [1, 0]])


def _expand(builder, root, levels, width_fn):
    """Run a builder, forwarding ``width_fn(builder, F)`` frontier nodes per level.
    ``levels[d]`` holds the draft log-probs after every node of frontier slot f."""
    builder.first_level(root)
    forwarded, d = [], 0
    while not builder.done:
        w = width_fn(builder, levels[d].shape[1])
        forwarded.append(w)
        builder.next_level(levels[d][:, :w])
        d += 1
    return forwarded


def assert_pruned_tree_is_full_tree(seed, B, K, D, M, w, sharp):
    """Build one batch twice, forwarding every frontier node and only the
    selectable ones; the trees must be equal. Returns the pruned run's widths."""
    gen = torch.Generator().manual_seed(seed)
    V = 13
    root = (sharp * torch.randn(B, V, generator=gen)).log_softmax(-1)
    # The drafter's output after a node depends only on that node: frontier slot f
    # of the pruned run is slot f of the full run (both sorted by key).
    levels = [(sharp * torch.randn(B, K, V, generator=gen)).log_softmax(-1)
              for _ in range(D - 1)]
    full, pruned = (DynamicTreeBuilder(B, K, D, M, depth_weight=w),
                    DynamicTreeBuilder(B, K, D, M, depth_weight=w))
    _expand(full, root, levels, lambda b, F: F)
    widths = _expand(pruned, root, levels, lambda b, F: min(F, b.selectable_width()))
    a, b = full.finish(torch.arange(B)), pruned.finish(torch.arange(B))
    for name in ("token", "parent", "depth", "node_counts"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (seed, name)
    return widths


@given(K=st.integers(1, 5), D=st.integers(2, 5), M_frac=st.floats(0.05, 1.0),
       seed=st.integers(0, 2**31), w=st.sampled_from([1.0, 0.7, 1.2, 2.0]),
       sharp=st.sampled_from([1.0, 3.0]))
def test_forwarding_only_selectable_nodes_keeps_the_same_tree(K, D, M_frac, seed, w, sharp):
    """Exact pruning: frontier nodes whose children cannot enter the top-M are not
    forwarded, and the final tree is exactly the one of a full-width expansion
    (whatever the depth weight; ``sharp`` drafts are often sure of a token, which
    a weight above 1 lifts above its parent)."""
    M = max(1, int(M_frac * (K + (D - 1) * K * K)))
    widths = assert_pruned_tree_is_full_tree(seed, 3, K, D, M, w, sharp)
    if M <= K and w <= 1:  # nothing below depth 1 can beat the root's M best children
        assert all(w <= M for w in widths)


@given(K=st.integers(1, 5), D=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_one_wide_levels_draft_the_greedy_chain(K, D, seed):
    """Forwarding one node per level (the chain's tip) drafts exactly the chain a
    stock EAGLE drafter of depth D proposes (argmax after each token)."""
    gen = torch.Generator().manual_seed(seed)
    B, V = 2, 17
    root = torch.randn(B, V, generator=gen).log_softmax(-1)
    levels = [torch.randn(B, 1, V, generator=gen).log_softmax(-1) for _ in range(D - 1)]
    builder = DynamicTreeBuilder(B, K, D, K + (D - 1) * K * K)
    assert _expand(builder, root, levels, lambda b, F: 1) == [1] * (D - 1)
    tree = builder.finish(torch.arange(B), chain_only=True)
    expect = torch.stack([root.argmax(-1)] + [lp[:, 0].argmax(-1) for lp in levels], 1)
    assert tree.node_counts.tolist() == [D] * B
    assert torch.equal(tree.token[:, 1:D + 1], expect)
    assert torch.equal(tree.parent[:, 1:D + 1], torch.arange(D).expand(B, D))


def test_pruning_stays_exact_when_a_depth_weight_lifts_sure_children():
    """Sure drafts (sharp distributions) under a depth weight above 1: children
    clamped just below their parents, ties among them, frontiers that differ from
    a by-score order. Many seeds, because any one case trips a wrong rule rarely
    (ranking the frontier, or pruning, by the draft scores instead of the keys, or
    leaving clamped ties to ``topk`` each break a few of these 300)."""
    for seed in range(300):
        K = 2 + seed % 3
        assert_pruned_tree_is_full_tree(seed, 4, K, 4, 2 + seed % (K * K),
                                        (1.2, 2.0)[seed % 2], 3.0)


def test_a_nan_draft_row_leaves_the_first_frontier_sorted():
    """topk ranks NaN first, and sanitising then scores it last: the root's
    children must still come best first (``selectable_width`` forwards a prefix)."""
    root = torch.tensor([[float("nan"), -1.0, -0.5, float("nan"), -2.0]])
    builder = DynamicTreeBuilder(1, 4, 3, 6)
    level = builder.first_level(root)
    scores = builder.frontier_scores(4)[0]
    assert torch.all(scores[:-1] >= scores[1:]), scores
    assert level.tokens[0, :2].tolist() == [2, 1]
