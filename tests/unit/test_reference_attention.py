"""Reference paged tree attention: sequential equivalence and no leakage."""

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.treegen import random_tree_batch
from vllm_treespec.attention import PagedTreeAttentionMetadata, paged_tree_attention
from vllm_treespec.tree import tree_mask


def softmax_attend(q, k, v, scale):
    """q [H, Dh], k/v [L, KVH, Dh] -> [H, Dh], plain causal-free attention."""
    H, KVH = q.shape[0], k.shape[1]
    kk = k.repeat_interleave(H // KVH, dim=1)  # [L, H, Dh]
    vv = v.repeat_interleave(H // KVH, dim=1)
    w = torch.einsum("hd,lhd->hl", q.double(), kk.double()) * scale
    return torch.einsum("hl,lhd->hd", w.softmax(-1), vv.double())


class Scenario:
    """A random mixed batch: tree rows (possibly padded to T) and causal rows."""

    def __init__(self, seed, pad_trees=False):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.B = rng.randint(1, 5)
        self.KVH = rng.choice([1, 2, 3])
        self.H = self.KVH * rng.choice([1, 2, 3])
        self.Dh = 8
        self.bs = rng.choice([2, 4, 16])
        M = rng.randint(1, 9)
        self.tree = random_tree_batch(rng, self.B, M, vocab=6, max_children=3)
        self.is_tree = torch.tensor([rng.random() < 0.7 for _ in range(self.B)])
        T = self.tree.tree_size
        self.ctx = [rng.randint(0, 23) for _ in range(self.B)]
        self.q_lens = []
        for b in range(self.B):
            if self.is_tree[b]:
                self.q_lens.append(T if pad_trees else int(self.tree.node_counts[b]) + 1)
            else:
                self.q_lens.append(rng.randint(1, 12))
        self.seq_lens = [c + q for c, q in zip(self.ctx, self.q_lens)]
        blocks_per = [(s + self.bs - 1) // self.bs for s in self.seq_lens]
        self.max_blocks = max(blocks_per) + rng.randint(0, 2)
        self.num_blocks = sum(blocks_per) + rng.randint(1, 4)
        perm = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.block_table = torch.zeros(self.B, self.max_blocks, dtype=torch.int32)
        for b in range(self.B):
            for j in range(blocks_per[b]):
                self.block_table[b, j] = perm.pop()
        self.k_cache = torch.randn(self.num_blocks, self.bs, self.KVH, self.Dh, generator=gen)
        self.v_cache = torch.randn(self.num_blocks, self.bs, self.KVH, self.Dh, generator=gen)
        N = sum(self.q_lens)
        self.q = torch.randn(N, self.H, self.Dh, generator=gen)
        self.qsl = torch.tensor([0] + list(torch.tensor(self.q_lens).cumsum(0)),
                                dtype=torch.int32)
        self.scale = self.Dh ** -0.5

    def meta(self):
        return PagedTreeAttentionMetadata(
            query_start_loc=self.qsl, seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_table=self.block_table, block_size=self.bs,
            tree_mask=tree_mask(self.tree), is_tree=self.is_tree)

    def kv_at(self, b, pos):
        blk = int(self.block_table[b, pos // self.bs])
        return self.k_cache[blk, pos % self.bs], self.v_cache[blk, pos % self.bs]

    def run(self):
        return paged_tree_attention(self.q, self.k_cache, self.v_cache, self.meta(),
                                    self.scale)

    def valid_rows(self):
        """(b, j, flat row, kv positions it must see) for every meaningful query."""
        for b in range(self.B):
            c, start = self.ctx[b], int(self.qsl[b])
            for j in range(self.q_lens[b]):
                if self.is_tree[b]:
                    if j > int(self.tree.node_counts[b]):
                        continue  # padding node
                    d = int(self.tree.depth[b, j])
                    path = self.tree.ancestors[b, j, : d + 1].tolist()
                    kv = list(range(c)) + [c + i for i in path]
                else:
                    kv = list(range(c + j + 1))
                yield b, j, start + j, kv


@given(st.integers(0, 2**31), st.booleans())
def test_tree_rows_equal_causal_attention_over_prefix_and_path(seed, pad_trees):
    sc = Scenario(seed, pad_trees)
    out = sc.run()
    assert out.shape == sc.q.shape
    for b, j, row, kv in sc.valid_rows():
        k = torch.stack([sc.kv_at(b, p)[0] for p in kv])
        v = torch.stack([sc.kv_at(b, p)[1] for p in kv])
        expect = softmax_attend(sc.q[row], k, v, sc.scale)
        torch.testing.assert_close(out[row].double(), expect, rtol=1e-4, atol=1e-5)


@given(st.integers(0, 2**31))
def test_padding_and_foreign_slots_do_not_leak(seed):
    sc = Scenario(seed, pad_trees=True)
    before = sc.run()
    gen = torch.Generator().manual_seed(seed + 1)
    rows = list(sc.valid_rows())
    # Poison every cache entry no valid row may read, and every padding query.
    readable = {(int(sc.block_table[b, p // sc.bs]), p % sc.bs)
                for b, _, _, kv in rows for p in kv}
    # Slots inside some request's length hold real (finite) KV, e.g. padding nodes
    # or sibling branches; anything else may be garbage, NaN included.
    written = {(int(sc.block_table[b, p // sc.bs]), p % sc.bs)
               for b in range(sc.B) for p in range(sc.seq_lens[b])}
    for blk in range(sc.num_blocks):
        for off in range(sc.bs):
            if (blk, off) not in readable:
                sc.k_cache[blk, off] = 1e3 * torch.randn(sc.KVH, sc.Dh, generator=gen)
                if (blk, off) in written:
                    sc.v_cache[blk, off] = 1e6 * torch.randn(sc.KVH, sc.Dh, generator=gen)
                else:
                    sc.v_cache[blk, off] = float("nan")
    valid = torch.zeros(sc.q.shape[0], dtype=torch.bool)
    for _, _, row, _ in rows:
        valid[row] = True
    sc.q[~valid] = 1e4
    after = sc.run()
    assert torch.equal(before[valid], after[valid])


def test_half_precision_inputs_keep_their_dtype():
    sc = Scenario(7)
    out = paged_tree_attention(sc.q.half(), sc.k_cache.half(), sc.v_cache.half(),
                               sc.meta(), sc.scale)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), sc.run(), rtol=2e-2, atol=2e-2)
