"""Acceptance rules and the KV commit.

The stochastic rule is tested for losslessness statistically: the law of the
first L emitted tokens (continued by plain sampling when a step emits fewer)
must equal the target model's autoregressive law. The same harness must reject
deliberately wrong rules, so it is known to have the power to fail.
"""

import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from tests.unit.treegen import random_tree_batch, tree_batches
from vllm_treespec.bench.tree_reference import position_samples, position_samples_on_path
from vllm_treespec.tree import (
    Outcome,
    TreeBatch,
    apply_compaction,
    compaction_plan,
    greedy_accept,
    stochastic_accept,
)


def node_paths(tree, b):
    """token path (excluding the root) of every valid node of request b."""
    out = []
    for i in range(int(tree.node_counts[b]) + 1):
        d = int(tree.depth[b, i])
        out.append(tuple(tree.token[b, tree.ancestors[b, i, 1: d + 1]].tolist()))
    return out


# ---------------------------------------------------------------- greedy
@given(tree_batches(max_nodes=12, vocab=4, max_children=3), st.integers(0, 2**31))
def test_greedy_picks_the_longest_matching_path(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 4, (tree.batch_size, tree.tree_size), generator=gen)
    acc = greedy_accept(tree, argmax)
    for b in range(tree.batch_size):
        n = int(tree.node_counts[b]) + 1
        par, tok = tree.parent[b].tolist(), tree.token[b].tolist()

        def ok(i):
            while i != 0:
                if tok[i] != int(argmax[b, par[i]]):
                    return False
                i = par[i]
            return True

        best = max((i for i in range(n) if ok(i)), key=lambda i: int(tree.depth[b, i]))
        a = int(tree.depth[b, best])
        assert int(acc.num_accepted[b]) == a
        assert int(acc.path[b, a]) == best  # the deepest accepted node
        path = tree.ancestors[b, best, : a + 1].tolist()
        assert acc.path[b, : a + 1].tolist() == path
        expect = [tok[i] for i in path[1:]] + [int(argmax[b, best])]
        assert acc.tokens[b, : a + 1].tolist() == expect
        assert (acc.tokens[b, a + 1:] == -1).all()


@given(st.integers(0, 2**31))
def test_chain_fast_paths_equal_the_tree_paths(seed):
    """Chains take a shorter route through greedy acceptance and ``Outcome.of``;
    both must say what the general tree code says (padding included)."""
    import dataclasses

    from vllm_treespec.tree.accept import _greedy_accept_trees

    rng = random.Random(seed)
    tree = random_tree_batch(rng, rng.randint(1, 4), rng.randint(1, 6), vocab=3,
                             max_children=1)
    assert tree.is_chain
    argmax = torch.randint(0, 3, (tree.batch_size, tree.tree_size),
                           generator=torch.Generator().manual_seed(seed))
    fast, general = greedy_accept(tree, argmax), _greedy_accept_trees(tree, argmax)
    for field in ("path", "num_accepted", "tokens"):
        assert torch.equal(getattr(fast, field), getattr(general, field)), field
    as_tree = dataclasses.replace(tree)
    as_tree.__dict__["is_chain"] = False  # take Outcome.of's general route
    assert Outcome.of(tree, fast) == Outcome.of(as_tree, general)


@given(tree_batches(max_nodes=12, vocab=3, max_children=3), st.integers(0, 2**31))
def test_outcome_reads_the_greedy_chain_and_where_the_tree_stopped(tree, seed):
    """Checked against a walk: the greedy chain follows first children (builders
    lay siblings out best first); it accepts while its tokens are the target's
    argmax; a chain accepted to its tip was stopped by the tree, not the target."""
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 3, (tree.batch_size, tree.tree_size), generator=gen)
    acc = greedy_accept(tree, argmax)
    out = Outcome.of(tree, acc)
    assert out.accepted == acc.num_accepted.tolist()
    for b in range(tree.batch_size):
        n = int(tree.node_counts[b]) + 1
        par, tok = tree.parent[b].tolist()[:n], tree.token[b].tolist()
        kids = [[i for i in range(1, n) if par[i] == p] for p in range(n)]
        node, chain_acc = 0, 0
        while kids[node] and tok[kids[node][0]] == int(argmax[b, node]):
            node, chain_acc = kids[node][0], chain_acc + 1
        tip = 0
        while kids[tip]:
            tip = kids[tip][0]
        assert out.chain_accepted[b] == chain_acc
        assert out.chain_censored[b] == (node == tip)


def test_outcome_of_a_hand_tree():
    # root -> 1, 2; 1 -> 3, 4; 2 -> 5; 3 -> 6. Greedy chain: 0, 1, 3, 6.
    tree = TreeBatch.from_parents([[10, 1, 2, 3, 4, 5, 6]], [[0, 0, 0, 1, 1, 2, 3]],
                                  tree_size=7, max_children=2)
    assert tree.greedy_chain[0].tolist() == [True, True, False, True, False, False, True]
    left = Outcome.of(tree, greedy_accept(tree, torch.tensor([[1, 4, 0, 0, 99, 0, 0]])))
    assert left == Outcome([2], [1], [False])  # off the chain at node 4
    down = Outcome.of(tree, greedy_accept(tree, torch.tensor([[1, 3, 0, 6, 0, 0, 7]])))
    assert down == Outcome([3], [3], [True])   # the whole chain
    assert not tree.is_chain


def test_a_batch_of_chains_is_its_own_greedy_chain():
    """The shortcut for chain batches (every valid node on the chain) agrees
    with reading first children; padding stays off the chain."""
    tree = TreeBatch.from_parents([[10, 1, 2, 3], [11, 4]], [[0, 0, 1, 2], [0, 0]],
                                  tree_size=4, max_children=2)
    assert tree.is_chain
    assert tree.greedy_chain.tolist() == [[True] * 4, [True, True, False, False]]
    out = Outcome.of(tree, greedy_accept(tree, torch.tensor([[1, 2, 9, 0], [4, 0, 0, 0]])))
    assert out == Outcome([2, 1], [2, 1], [False, True])


@given(tree_batches(max_nodes=10, vocab=5, max_children=3), st.integers(0, 2**31))
def test_stochastic_with_one_hot_targets_equals_greedy(tree, seed):
    gen = torch.Generator().manual_seed(seed)
    argmax = torch.randint(0, 5, (tree.batch_size, tree.tree_size), generator=gen)
    probs = torch.nn.functional.one_hot(argmax, 5).float()
    g, s = greedy_accept(tree, argmax), stochastic_accept(tree, probs, generator=gen)
    assert torch.equal(g.tokens, s.tokens) and torch.equal(g.path, s.path)


@given(tree_batches(max_nodes=10, vocab=5, max_children=3), st.integers(0, 2**31))
def test_on_demand_distributions_equal_the_full_table(tree, seed):
    """Distributions asked for node by node give the same walk as the [B, T, V]
    table, and the walk asks for at most depth + 1 nodes per tree."""
    gen = torch.Generator().manual_seed(seed)
    B, T, D, C = tree.batch_size, tree.tree_size, tree.max_depth, tree.max_children
    probs = torch.rand(B, T, 5, generator=gen) ** 3  # unnormalised, some near 0
    uniforms, noise = torch.rand(B, D, C, generator=gen), torch.rand(B, 5, generator=gen) + 0.1
    asked = []

    def probs_at(rows, nodes):
        asked.extend(zip(rows.tolist(), nodes.tolist()))
        return probs[rows, nodes]

    full = stochastic_accept(tree, probs, uniforms, noise)
    lazy = stochastic_accept(tree, probs_at, uniforms, noise)
    assert torch.equal(full.path, lazy.path) and torch.equal(full.tokens, lazy.tokens)
    assert len(asked) == len(set(asked))  # no node twice
    for b in range(B):
        walked = {n for r, n in asked if r == b}
        assert walked == set(lazy.path[b].tolist())  # exactly the accepted path's nodes


@given(tree_batches(max_nodes=10, vocab=4, max_children=3), st.integers(0, 2**31))
def test_position_samples_on_the_path_accept_as_every_node_sampled(tree, seed):
    """Seeded requests sample only the nodes their path reaches: the same
    acceptance as sampling every node, with at most depth + 1 nodes asked for,
    exactly the accepted path's (small vocabulary: paths often run deep)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = tree.batch_size, tree.tree_size
    probs = torch.rand(B, T, 4, generator=gen) ** 2
    # Noise for the depths the trees use, under a looser static bound (as served).
    noise = torch.empty(B, int(tree.depth.max()) + 1, 4).exponential_(generator=gen)
    loose = TreeBatch(tree.token, tree.parent, tree.depth, tree.node_counts,
                      tree.max_depth + 2, tree.max_children)
    asked = []

    def probs_at(rows, nodes):
        asked.extend(zip(rows.tolist(), nodes.tolist()))
        return probs[rows, nodes]

    every = greedy_accept(tree, position_samples(probs, tree.depth, noise))
    on_path = greedy_accept(tree, position_samples_on_path(loose, probs_at, noise))
    assert torch.equal(every.path, on_path.path) and torch.equal(every.tokens, on_path.tokens)
    assert len(asked) == len(set(asked))
    for b in range(B):
        assert {n for r, n in asked if r == b} == set(on_path.path[b].tolist())
    table = greedy_accept(tree, position_samples_on_path(tree, probs, noise))  # a table too
    assert torch.equal(table.tokens, every.tokens)


def test_zero_probability_draft_is_never_accepted_even_at_u_zero():
    # Root with children 2 (p=0) then 1 (p=0); target mass entirely on token 0.
    tree = TreeBatch.from_parents([[0, 2, 1]], [[0, 0, 0]], tree_size=3)
    probs = torch.tensor([[[1.0, 0.0, 0.0]] * 3])
    acc = stochastic_accept(tree, probs, uniforms=torch.zeros(1, 1, 2),
                            noise=torch.ones(1, 3))
    assert acc.tokens[0].tolist() == [0, -1]


def test_rejected_children_are_removed_from_the_residual():
    # Children 0 and 1 both rejected (u ~ 1): the bonus must be token 2 even though
    # the noise favours token 0.
    tree = TreeBatch.from_parents([[5, 0, 1]], [[0, 0, 0]], tree_size=3)
    probs = torch.tensor([[[0.5, 0.3, 0.2, 0.0, 0.0, 0.0]] * 3])
    acc = stochastic_accept(tree, probs, uniforms=torch.full((1, 1, 2), 0.999999),
                            noise=torch.tensor([[1e-6, 1e-6, 1.0, 1.0, 1.0, 1.0]]))
    assert acc.tokens[0].tolist() == [2, -1]


# ---------------------------------------------------------------- lossless
V, L = 4, 3


def make_target(gen):
    """p(. | context) for every context of length < L; some exact zeros."""
    table = {}
    for n in range(L):
        for ctx in itertools.product(range(V), repeat=n):
            logits = torch.randn(V, generator=gen) * 1.5
            p = logits.softmax(-1)
            if torch.rand((), generator=gen) < 0.4:
                p[torch.randint(0, V, (), generator=gen)] = 0.0
            table[ctx] = p / p.sum()
    return table


def target_probs(tree, table):
    T = tree.tree_size
    uniform = torch.full((V,), 1.0 / V)
    probs = torch.empty(1, T, V)
    for i, path in enumerate(node_paths(tree, 0)):
        probs[0, i] = table.get(path, uniform)
    probs[0, len(node_paths(tree, 0)):] = uniform
    return probs


def exact_law(table):
    law = {}
    for seq in itertools.product(range(V), repeat=L):
        p = 1.0
        for k in range(L):
            p *= float(table[seq[:k]][seq[k]])
        law[seq] = p
    return law


def chi2_pvalue(samples, law):
    n = len(samples)
    counts = {seq: 0 for seq in law}
    for s in samples:
        counts[s] += 1
    assert all(law[s] > 0 or c == 0 for s, c in counts.items()), "impossible sequence"
    big = [s for s in law if law[s] * n >= 5]
    small = [s for s in law if 0 < law[s] * n < 5]
    obs = [counts[s] for s in big] + ([sum(counts[s] for s in small)] if small else [])
    exp = [law[s] * n for s in big] + ([sum(law[s] * n for s in small)] if small else [])
    scale = n / sum(exp)  # the law's float32 products sum to 1 only approximately
    return stats.chisquare(obs, [e * scale for e in exp]).pvalue


def complete(prefix, table, rng):
    """Continue a short emission by plain sampling from the target."""
    seq = list(prefix[:L])
    while len(seq) < L:
        p = table[tuple(seq)]
        seq.append(rng.choices(range(V), weights=p.tolist())[0])
    return tuple(seq)


def vectorised_rule(tree, probs, n, gen):
    big = TreeBatch(token=tree.token.expand(n, -1), parent=tree.parent.expand(n, -1),
                    depth=tree.depth.expand(n, -1), node_counts=tree.node_counts.expand(n),
                    max_depth=tree.max_depth, max_children=tree.max_children)
    acc = stochastic_accept(big, probs.expand(n, -1, -1), generator=gen)
    return [row[row >= 0].tolist() for row in acc.tokens]


def loop_rule(renormalise=True, remove_rejected=True):
    """Per-row reference walk; the flags switch off parts of the correct rule."""
    def rule(tree, probs, n, gen):
        rng = random.Random(int(torch.randint(0, 2**31, (), generator=gen)))
        kids = {}
        for i in range(1, int(tree.node_counts[0]) + 1):
            kids.setdefault(int(tree.parent[0, i]), []).append(i)
        out = []
        for _ in range(n):
            cur, emitted = 0, []
            while True:
                p = probs[0, cur].clone()
                moved = False
                for c in kids.get(cur, []):
                    x = int(tree.token[0, c])
                    q = p / p.sum() if renormalise else probs[0, cur]
                    if rng.random() < float(q[x]):
                        emitted.append(x)
                        cur, moved = c, True
                        break
                    if remove_rejected:
                        p[x] = 0.0
                if not moved:
                    emitted.append(rng.choices(range(V), weights=p.tolist())[0])
                    break
            out.append(emitted)
        return out
    return rule


def run_harness(rule, tree_seed, n=20000):
    gen = torch.Generator().manual_seed(tree_seed)
    rng = random.Random(tree_seed)
    table = make_target(gen)
    tree = random_tree_batch(rng, 1, max_nodes=10, vocab=V, max_children=3,
                             exact_nodes=True)
    # Make the draft tokens plausible: the root's children are the target's favourites.
    probs = target_probs(tree, table)
    samples = [complete(e, table, rng) for e in rule(tree, probs, n, gen)]
    return chi2_pvalue(samples, exact_law(table))


TREE_SEEDS = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("seed", TREE_SEEDS)
def test_stochastic_acceptance_is_lossless(seed):
    assert run_harness(vectorised_rule, seed) > 1e-4


def test_reference_walk_agrees_with_the_target_law():
    # The slow per-row walk is the textbook rule; it must pass the same harness.
    assert run_harness(loop_rule(), TREE_SEEDS[0], n=20000) > 1e-4


def positional_rule(shared_noise=False):
    """Per-position noise (seeded requests); ``shared_noise`` reuses one noise
    vector at every depth (a wrong rule: consecutive tokens become dependent)."""
    def rule(tree, probs, n, gen):
        big = TreeBatch(token=tree.token.expand(n, -1), parent=tree.parent.expand(n, -1),
                        depth=tree.depth.expand(n, -1), node_counts=tree.node_counts.expand(n),
                        max_depth=tree.max_depth, max_children=tree.max_children)
        depths = 1 if shared_noise else tree.max_depth + 1
        noise = torch.empty(n, depths, V).exponential_(generator=gen)
        noise = noise.expand(n, tree.max_depth + 1, V)
        acc = greedy_accept(big, position_samples(probs.expand(n, -1, -1), big.depth, noise))
        return [row[row >= 0].tolist() for row in acc.tokens]
    return rule


@pytest.mark.parametrize("seed", TREE_SEEDS)
def test_positional_acceptance_is_lossless(seed):
    assert run_harness(positional_rule(), seed) > 1e-4


@given(st.integers(0, 2**31))
def test_positional_acceptance_emits_plain_decoding_under_the_same_noise(seed):
    """Whatever the tree, the emitted tokens are the first tokens plain decoding
    draws with the same per-position noise: a seeded request reproduces."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    table = make_target(gen)
    uniform = torch.full((V,), 1.0 / V)  # past the table, as target_probs has it
    for _ in range(3):
        tree = random_tree_batch(rng, 1, max_nodes=6, vocab=V, max_children=3,
                                 exact_nodes=True)
        noise = torch.empty(1, tree.max_depth + 1, V).exponential_(generator=gen)
        ctx = ()
        for d in range(tree.max_depth + 1):
            ctx += (int(torch.argmax(table.get(ctx, uniform) / noise[0, d])),)
        acc = greedy_accept(tree, position_samples(target_probs(tree, table), tree.depth, noise))
        emitted = acc.tokens[0][acc.tokens[0] >= 0].tolist()
        assert emitted == list(ctx[: len(emitted)]), (emitted, ctx)


@pytest.mark.parametrize("wrong", [
    loop_rule(renormalise=False),      # accept x_j w.p. p(x_j), no renormalising
    loop_rule(remove_rejected=False),  # bonus from p, rejected children kept
    positional_rule(shared_noise=True),  # one noise vector for every position
])
def test_harness_rejects_wrong_rules(wrong):
    # Over several trees at least one must expose the bias decisively.
    pvals = [run_harness(wrong, seed) for seed in TREE_SEEDS[:3]]
    assert min(pvals) < 1e-6, pvals


# ---------------------------------------------------------------- commit
def kv_of(path_tokens, position, dim=4):
    """KV a model would produce for the last token of ``path_tokens`` at ``position``."""
    g = torch.Generator().manual_seed(hash((tuple(path_tokens), position)) % (2**31))
    return torch.randn(dim, generator=g)


@given(tree_batches(max_nodes=10, vocab=4, max_children=3), st.integers(0, 2**31),
       st.sampled_from(["plain", "cpu", "ascend"]))
def test_commit_equals_sequential_kv(tree, seed, layout):
    gen = torch.Generator().manual_seed(seed)
    B, T, bs, dim = tree.batch_size, tree.tree_size, 4, 4
    prefix = torch.randint(0, 9, (B,), generator=gen)
    max_blocks = (int(prefix.max()) + T + bs - 1) // bs
    num_blocks = B * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: B * max_blocks].view(B, -1)
    cache = torch.zeros(num_blocks, bs, dim)  # canonical [block, slot, dim]
    ctx_tokens = [[7] * int(prefix[b]) for b in range(B)]

    def write(b, pos, value):
        cache[block_table[b, pos // bs], pos % bs] = value

    def read(b, pos):
        return cache[block_table[b, pos // bs], pos % bs]

    # Verify step: node i's KV at linear slot prefix+i, rotated at prefix+depth(i).
    for b in range(B):
        for i, path in enumerate(node_paths(tree, b)):
            toks = ctx_tokens[b] + [int(tree.token[b, 0])] + list(path)
            write(b, int(prefix[b]) + i, kv_of(toks, int(prefix[b]) + len(path)))
    argmax = torch.randint(0, 4, (B, T), generator=gen)
    acc = greedy_accept(tree, argmax)
    plan = compaction_plan(acc)
    src, dst = plan.slots(prefix, block_table, bs)
    if layout == "plain":
        apply_compaction(cache, src, dst)
    elif layout == "cpu":  # vLLM CPU: [blocks, kv_heads, block_size, 2*head]
        view = cache.unsqueeze(1).clone()
        apply_compaction(view, src, dst, block_dim=0, slot_dim=2)
        cache.copy_(view.squeeze(1))
    else:  # Ascend: [2, blocks, block_size, kv_heads, head]
        view = torch.stack([cache, -cache]).unsqueeze(3).clone()
        apply_compaction(view, src, dst, block_dim=1, slot_dim=2)
        assert torch.equal(view[1], -view[0])
        cache.copy_(view[0].squeeze(2))
    for b in range(B):
        a = int(acc.num_accepted[b])
        accepted = acc.tokens[b, :a].tolist()
        assert bool(plan.needs_copy[b]) == (acc.path[b, 1: a + 1].tolist()
                                            != list(range(1, a + 1)))
        for k in range(a + 1):  # root + accepted tokens, as if decoded one by one
            toks = ctx_tokens[b] + [int(tree.token[b, 0])] + accepted[:k]
            assert torch.equal(read(b, int(prefix[b]) + k),
                               kv_of(toks, int(prefix[b]) + k)), (b, k)


def test_plan_is_empty_when_the_path_is_contiguous():
    tree = TreeBatch.from_parents([[0, 1, 2, 3]], [[0, 0, 1, 2]], tree_size=4)  # chain
    acc = greedy_accept(tree, torch.tensor([[1, 2, 3, 0]]))
    plan = compaction_plan(acc)
    assert int(acc.num_accepted[0]) == 3 and not bool(plan.needs_copy[0])
    src, dst = plan.slots(torch.tensor([5]), torch.arange(4).view(1, 4), 4)
    assert src.numel() == 0 and dst.numel() == 0


def test_cpu_kv_move_equals_compaction_of_each_view():
    """The CPU runner moves K and V of every head in two ops a layer on the flat
    cache; that must equal ``apply_compaction`` on each layer's K and V views, with
    a cache shared by two layers moved once (a destination here is also a source,
    so moving it twice would differ)."""
    pytest.importorskip("vllm")
    from vllm_treespec.attention.cpu_layout import kv_views
    from vllm_treespec.vllm_glue.cpu_runner import _CPUDevice

    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(4, 2, 8, 2 * 4, generator=gen) for _ in range(3)]
    src = torch.tensor([[1, 3], [1, 0], [0, 7]])
    dst = torch.tensor([[1, 0], [1, 1], [3, 5]])
    expect = [c.clone() for c in caches]
    for cache in expect:
        for view in kv_views(cache, 4):
            apply_compaction(view, src, dst, block_dim=0, slot_dim=1)
    runner = _CPUDevice.__new__(_CPUDevice)
    runner.kv_caches = caches + [caches[0], None]
    runner._move_kv(src, dst)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
