"""Tree verify as causal chain requests equals tree attention (reference and vLLM's CPU kernel)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.treegen import random_tree_batch
from vllm_treespec.attention import PagedTreeAttentionMetadata, cpu_layout, paged_tree_attention
from vllm_treespec.attention.chain_split import split_into_chains
from vllm_treespec.tree import tree_mask


class TreeStep:
    """A verify step of tree rows only (as the runner packs them), scratch blocks at the end."""

    def __init__(self, seed: int, spare: int = 64, block_sizes=(2, 4, 16)):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.B = rng.randint(1, 4)
        self.KVH = rng.choice([1, 2])
        self.H = self.KVH * rng.choice([1, 3])
        self.Dh, self.bs = 8, rng.choice(block_sizes)
        self.tree = random_tree_batch(rng, self.B, rng.randint(1, 9), vocab=6, max_children=3)
        self.q_lens = [int(n) + 1 for n in self.tree.node_counts]
        self.seq_lens = [rng.randint(0, 40) + q for q in self.q_lens]
        per = [-(-s // self.bs) for s in self.seq_lens]
        self.num_blocks = sum(per) + rng.randint(0, 3)
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.block_table = torch.zeros(self.B, max(per) + 1, dtype=torch.int32)
        for b in range(self.B):
            self.block_table[b, : per[b]] = torch.tensor([perm.pop() for _ in range(per[b])])
        self.spare = list(range(self.num_blocks, self.num_blocks + spare))
        total = self.num_blocks + spare
        self.k = torch.randn(total, self.bs, self.KVH, self.Dh, generator=gen)
        self.v = torch.randn(total, self.bs, self.KVH, self.Dh, generator=gen)
        self.qsl = torch.tensor([0] + torch.tensor(self.q_lens).cumsum(0).tolist(),
                                dtype=torch.int32)
        self.q = torch.randn(int(self.qsl[-1]), self.H, self.Dh, generator=gen)
        self.scale = self.Dh ** -0.5

    def meta(self, **kw) -> PagedTreeAttentionMetadata:
        return PagedTreeAttentionMetadata(
            query_start_loc=self.qsl, seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_table=self.block_table, block_size=self.bs, tree_mask=tree_mask(self.tree),
            **kw)

    def plan(self):
        return split_into_chains(tree_mask(self.tree), self.qsl,
                                 torch.tensor(self.seq_lens, dtype=torch.int32),
                                 self.block_table, self.bs, self.spare)

    def node_kv(self, rows: torch.Tensor):
        """K/V of packed tree rows, read at their real (linear) slots."""
        out_k, out_v = [], []
        for r in rows.tolist():
            b = max(i for i in range(self.B) if int(self.qsl[i]) <= r)
            pos = self.seq_lens[b] - self.q_lens[b] + r - int(self.qsl[b])
            blk = int(self.block_table[b, pos // self.bs])
            out_k.append(self.k[blk, pos % self.bs])
            out_v.append(self.v[blk, pos % self.bs])
        return torch.stack(out_k), torch.stack(out_v)


def apply_reference(step: TreeStep, plan, k, v):
    """Fill the scratch blocks in [blocks, bs, KVH, Dh] views, as the CPU backend does."""
    for src, dst, count in plan.copies:
        k[dst: dst + count] = k[src]
        v[dst: dst + count] = v[src]
    if plan.write_rows.numel():
        nk, nv = step.node_kv(plan.write_rows)
        # read_slots hold the same K/V (the backend copies cache to cache from there).
        rblk, roff = plan.read_slots // step.bs, plan.read_slots % step.bs
        assert torch.equal(k[rblk, roff], nk) and torch.equal(v[rblk, roff], nv)
        blk, off = plan.write_slots // step.bs, plan.write_slots % step.bs
        k[blk, off] = nk
        v[blk, off] = nv


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31))
def test_causal_chains_equal_tree_attention(seed):
    step = TreeStep(seed)
    expect = paged_tree_attention(step.q, step.k, step.v, step.meta(), step.scale)
    plan = step.plan()
    assert sorted(plan.order.tolist()) == list(range(step.q.shape[0]))  # each row once
    k, v = step.k.clone(), step.v.clone()
    apply_reference(step, plan, k, v)
    chains = PagedTreeAttentionMetadata(query_start_loc=plan.query_start_loc,
                                        seq_lens=plan.seq_lens, block_table=plan.block_table,
                                        block_size=step.bs)  # no tree mask: causal
    out = paged_tree_attention(step.q[plan.order], k, v, chains, step.scale)
    torch.testing.assert_close(out, expect[plan.order], rtol=1e-5, atol=1e-6)
    # The scheduler's blocks are untouched.
    assert torch.equal(k[: step.num_blocks], step.k[: step.num_blocks])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31))
def test_without_the_scratch_fill_the_chains_are_wrong(seed):
    """Negative control: chains whose path is not the linear layout need their copies."""
    step = TreeStep(seed)
    plan = step.plan()
    if plan.write_rows.numel() == 0:
        return  # every tree is a chain: nothing to fill
    expect = paged_tree_attention(step.q, step.k, step.v, step.meta(), step.scale)
    chains = PagedTreeAttentionMetadata(query_start_loc=plan.query_start_loc,
                                        seq_lens=plan.seq_lens, block_table=plan.block_table,
                                        block_size=step.bs)
    out = paged_tree_attention(step.q[plan.order], step.k, step.v, chains, step.scale)
    assert not torch.allclose(out, expect[plan.order], rtol=1e-3, atol=1e-4)


def test_chains_share_prefix_blocks_and_copy_only_the_tail():
    # One request: prefix 5 (block size 4: one full block + 1 tail position), tree
    # root -> {a, b}, a -> c. Chains: [root, a, c] (not linear: c is node 3 at depth
    # 2) and [b]. Both need copies of logical block 1; block 0 is shared.
    from vllm_treespec.tree import TreeBatch
    tree = TreeBatch.from_parents([[9, 1, 2, 3]], [[0, 0, 0, 1]], tree_size=4, max_children=2)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    plan = split_into_chains(tree_mask(tree), qsl, torch.tensor([9], dtype=torch.int32),
                             torch.tensor([[7, 3, 0]], dtype=torch.int32), 4, [20, 21])
    assert plan.order.tolist() == [0, 1, 3, 2]
    assert plan.query_start_loc.tolist() == [0, 3, 4]
    assert plan.seq_lens.tolist() == [5 + 3, 5 + 2]
    assert plan.block_table[:, 0].tolist() == [7, 7]
    assert sorted(plan.block_table[:, 1].tolist()) == [20, 21]
    assert plan.copies == [(3, 20, 2)]  # one copy of the tail block, into both
    # Chain [root, a, c] writes root, a, c at offsets 1, 2, 3 of its block.
    assert plan.write_rows.tolist()[:3] == [0, 1, 3]
    assert split_into_chains(tree_mask(tree), qsl, torch.tensor([9], dtype=torch.int32),
                             torch.tensor([[7, 3, 0]], dtype=torch.int32), 4, [20]) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31))
def test_vllm_cpu_kernel_on_chains_equals_tree_attention(seed):
    """The same plan run by vLLM's own CPU kernel, on its cache layout."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    step = TreeStep(seed, block_sizes=(16, 32))
    Dh = 32  # the kernel's smallest head size
    gen = torch.Generator().manual_seed(seed)
    step.k = torch.randn(step.k.shape[:-1] + (Dh,), generator=gen)
    step.v = torch.randn(step.v.shape[:-1] + (Dh,), generator=gen)
    step.q = torch.randn(step.q.shape[0], step.H, Dh, generator=gen)
    step.Dh, step.scale = Dh, Dh ** -0.5
    cache = torch.zeros(step.k.shape[0], step.KVH, step.bs, 2 * Dh)
    kv, vv = cpu_layout.kv_views(cache, Dh)
    kv.copy_(step.k)
    vv.copy_(step.v)
    expect = paged_tree_attention(step.q, step.k, step.v, step.meta(), step.scale)
    plan = step.plan()
    isa = _get_attn_isa(torch.float32, step.bs, Dh, "auto")
    for src, dst, count in plan.copies:
        cache[dst: dst + count] = cache[src]
    key_cache, value_cache = cache.view(cache.shape[0], step.KVH, 2 * step.bs, Dh).chunk(2, 2)
    if plan.write_rows.numel():  # as the backend does: slot elements, cache to cache
        flat = cache.view(-1)
        flat.index_copy_(0, cpu_layout.slot_elements(cache, plan.write_slots),
                         flat.index_select(0, cpu_layout.slot_elements(cache, plan.read_slots)))
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=plan.num_chains, num_heads=step.H, num_kv_heads=step.KVH, head_dim=Dh,
        seq_lens=plan.seq_lens, dtype=torch.float32, query_start_loc=plan.query_start_loc,
        causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    q = step.q[plan.order].contiguous()
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens, scale=step.scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=plan.block_table,
        softcap=0.0, scheduler_metadata=sched, s_aux=None)
    torch.testing.assert_close(out, expect[plan.order], rtol=1e-4, atol=1e-5)


def test_slot_elements_address_what_the_cpu_cache_writer_wrote():
    """``slot_elements`` reads back exactly the K/V vLLM's CPU kernel stored at
    those slots (K transposed per block and head, V after it)."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    nb, kvh, bs, dh = 3, 2, 32, 32
    cache = torch.zeros(nb, kvh, bs, 2 * dh)
    key_cache, value_cache = cache.view(nb, kvh, 2 * bs, dh).chunk(2, 2)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 5, 37, 94])
    k = torch.randn(4, kvh, dh, generator=gen)
    v = torch.randn(4, kvh, dh, generator=gen)
    isa = _get_attn_isa(torch.float32, bs, dh, "auto")
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    got = cache.view(-1)[cpu_layout.slot_elements(cache, slots)].view(4, kvh, 2, dh)
    assert torch.equal(got[:, :, 0], k) and torch.equal(got[:, :, 1], v)
    wrong = cache.view(-1)[cpu_layout.slot_elements(cache, slots + 1)].view(4, kvh, 2, dh)
    assert not torch.equal(wrong[:, :, 0], k)  # control: a slot off reads other data


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31))
def test_scratch_prefix_bounds_what_the_split_takes(seed):
    """The blocks ``scratch_prefix`` counts for a batch's trees always suffice for
    ``split_into_chains`` (wherever each root sits in its block), and a capacity
    cut keeps a BFS prefix within it."""
    from vllm_treespec.attention.chain_split import scratch_prefix

    step = TreeStep(seed, block_sizes=(2, 4, 16, 128))
    parents = [step.tree.parent[b, 1: int(n) + 1].tolist()
               for b, n in enumerate(step.tree.node_counts)]
    roots = [s - q for s, q in zip(step.seq_lens, step.q_lens)]
    counted = [scratch_prefix(p, step.bs, 10**9) for p in parents]
    exact = [scratch_prefix(p, step.bs, 10**9, r) for p, r in zip(parents, roots)]
    assert all(n == len(p) for (n, _), p in zip(counted + exact, parents + parents))
    need = sum(blocks for _, blocks in exact)
    assert need <= sum(blocks for _, blocks in counted)
    spare = step.spare
    step.spare = spare[:need]
    assert step.plan() is not None
    if need:  # exact: one block fewer is too few
        step.spare = spare[:need - 1]
        assert step.plan() is None
    cap = random.Random(seed).randint(0, need)
    n, blocks = scratch_prefix(parents[0], step.bs, cap)
    assert blocks <= cap and scratch_prefix(parents[0][:n], step.bs, 10**9) == (n, blocks)
    if n < len(parents[0]):
        assert scratch_prefix(parents[0][:n + 1], step.bs, 10**9)[1] > cap
