"""The block-wise CPU-layout tree attention equals the reference on random batches."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_reference_attention import Scenario
from vllm_treespec.attention import cpu_layout
from vllm_treespec.attention.reference import paged_tree_attention
from vllm_treespec.attention.reference import prefix_side_attention as reference_side


def cpu_cache(sc: Scenario) -> torch.Tensor:
    """The scenario's K/V written into vLLM's CPU layout (K transposed, then V)."""
    cache = torch.zeros(sc.num_blocks, sc.KVH, sc.bs, 2 * sc.Dh)
    k, v = cpu_layout.kv_views(cache, sc.Dh)
    k.copy_(sc.k_cache)
    v.copy_(sc.v_cache)
    return cache


def test_kv_views_layout_is_k_transposed_then_v():
    cache = torch.arange(2 * 3 * 4 * 2 * 5, dtype=torch.float32).view(2, 3, 4, 10)
    k, v = cpu_layout.kv_views(cache, 5)
    flat = cache.view(2, 3, 40)
    # K element (block 1, slot 2, head 0, dim 3) lives at d * block_size + slot.
    assert k[1, 2, 0, 3] == flat[1, 0, 3 * 4 + 2]
    assert v[1, 2, 0, 3] == flat[1, 0, 20 + 2 * 5 + 3]


@given(st.integers(0, 2**31), st.booleans())
def test_tree_attention_matches_reference(seed, pad_trees):
    sc = Scenario(seed, pad_trees)
    cache = cpu_cache(sc)
    meta = sc.meta()
    plan = cpu_layout.plan(meta, torch.float32)
    rows = torch.cat([torch.arange(int(sc.qsl[b]), int(sc.qsl[b + 1])) for b in range(sc.B)])
    out = cpu_layout.tree_attention(sc.q, cache, plan, sc.scale)
    expect = paged_tree_attention(sc.q, sc.k_cache, sc.v_cache, meta, sc.scale)
    torch.testing.assert_close(out, expect[plan.out_rows], rtol=1e-4, atol=1e-5)
    assert torch.equal(plan.out_rows, rows)


@given(st.integers(0, 2**31))
def test_garbage_outside_requests_does_not_leak(seed):
    sc = Scenario(seed, pad_trees=True)
    cache = cpu_cache(sc)
    plan = cpu_layout.plan(sc.meta(), torch.float32)
    before = cpu_layout.tree_attention(sc.q, cache, plan, sc.scale)
    used = {int(sc.block_table[b, j]) for b in range(sc.B)
            for j in range(-(-sc.seq_lens[b] // sc.bs))}
    for blk in set(range(sc.num_blocks)) - used:
        cache[blk] = float("nan")
    # Slots past each request's length inside its own last block, too.
    for b in range(sc.B):
        k, v = cpu_layout.kv_views(cache, sc.Dh)
        for pos in range(sc.seq_lens[b], -(-sc.seq_lens[b] // sc.bs) * sc.bs):
            blk = int(sc.block_table[b, pos // sc.bs])
            k[blk, pos % sc.bs] = float("inf")
            v[blk, pos % sc.bs] = float("nan")
    after = cpu_layout.tree_attention(sc.q, cache, plan, sc.scale)
    assert torch.equal(before, after)


@given(st.integers(0, 2**31))
def test_drafting_level_attention_matches_reference(seed):
    sc = Scenario(seed)
    cache = cpu_cache(sc)
    gen = torch.Generator().manual_seed(seed)
    F_, W = 3, 7
    prefix_len = torch.tensor([min(s, 20) for s in sc.seq_lens])
    q = torch.randn(sc.B, F_, sc.H, sc.Dh, generator=gen)
    side_k = torch.randn(sc.B, W, sc.KVH, sc.Dh, generator=gen)
    side_v = torch.randn(sc.B, W, sc.KVH, sc.Dh, generator=gen)
    side_mask = torch.rand(sc.B, F_, W, generator=gen) < 0.5
    side_mask[..., -1] = True
    prefix = cpu_layout.gather_prefix(cache, sc.block_table, prefix_len, int(prefix_len.max()),
                                      sc.Dh, torch.float32)
    out = cpu_layout.prefix_side_attention(q, *prefix, side_k, side_v, side_mask, sc.scale)
    expect = reference_side(q, sc.k_cache, sc.v_cache, sc.block_table, sc.bs, prefix_len,
                            side_k, side_v, side_mask, sc.scale)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-5)
