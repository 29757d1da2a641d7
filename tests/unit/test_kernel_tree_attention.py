"""The Triton tree-attention kernel against the reference, on the CPU under
Triton's interpreter (small shapes: the interpreter runs every program in Python).

Without a CUDA device, ``tests/conftest.py`` turns the interpreter on before the
kernel module is imported (triton reads ``TRITON_INTERPRET`` at import time).
"""

import random
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.unit.test_reference_attention import Scenario  # noqa: E402
from tests.unit.treegen import _grow, tree_batches  # noqa: E402
from vllm_treespec.attention import PagedTreeAttentionMetadata, paged_tree_attention  # noqa: E402
from vllm_treespec.attention.cpu_layout import kv_views  # noqa: E402
from vllm_treespec.kernels import tree_attention as K  # noqa: E402
from vllm_treespec.tree import TreeBatch, tree_mask  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run_kernel(q, k_cache, v_cache, meta: PagedTreeAttentionMetadata, scale, **kw):
    rows = K.tree_row_metadata(meta.query_start_loc.to(DEV), meta.seq_lens.to(DEV),
                               None if meta.tree_mask is None else meta.tree_mask.to(DEV),
                               None if meta.is_tree is None else meta.is_tree.to(DEV))
    return K.tree_attention(q.to(DEV), k_cache.to(DEV), v_cache.to(DEV),
                            meta.block_table.to(DEV), meta.block_size, rows, scale, **kw)


def rows_of(s: Scenario) -> torch.Tensor:
    """Flat rows whose output means something (padding tree nodes excluded)."""
    return torch.tensor([row for _, _, row, _ in s.valid_rows()], dtype=torch.long)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pad_trees", [False, True])
def test_kernel_matches_reference_on_mixed_batches(seed, pad_trees):
    """Prefill chunks, decode rows and trees of different shapes in one launch; GQA,
    block sizes 2/4/16 (rows crossing block boundaries), prefixes ending mid-block."""
    s = Scenario(seed, pad_trees=pad_trees)
    ref = s.run()
    got = run_kernel(s.q, s.k_cache, s.v_cache, s.meta(), s.scale).cpu()
    rows = rows_of(s)
    assert (got[rows] - ref[rows]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_kernel_split_prefix_merges_to_the_reference(seed, splits):
    """Flash-decoding: the committed prefix shared by several programs (some with
    no keys at all: prefixes shorter than the splits' key tiles), merged by
    log-sum-exp, gives the one-program result; the log-sum-exp too."""
    s = Scenario(seed, pad_trees=bool(seed % 2))
    ref = s.run()
    rows = rows_of(s)
    got, lse = run_kernel(s.q, s.k_cache, s.v_cache, s.meta(), s.scale, num_splits=splits,
                          return_lse=True)
    assert (got.cpu()[rows] - ref[rows]).abs().max().item() <= 1e-5
    _, lse_one = run_kernel(s.q, s.k_cache, s.v_cache, s.meta(), s.scale, num_splits=1,
                            return_lse=True)
    assert (lse.cpu()[rows] - lse_one.cpu()[rows]).abs().max().item() <= 1e-5


def _tree_case(tokens, parents, ctx, bs=4, KVH=2, group=2, Dh=16, seed=0,
               dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    tree = TreeBatch.from_parents([tokens], [parents], tree_size=len(tokens),
                                  max_depth=max(len(tokens) - 1, 1),
                                  max_children=max(len(tokens) - 1, 1))
    T = len(tokens)
    seq = ctx + T
    nblk = (seq + bs - 1) // bs
    perm = torch.randperm(nblk + 3, generator=gen)[:nblk]
    k_cache = torch.randn(nblk + 3, bs, KVH, Dh, generator=gen).to(dtype)
    v_cache = torch.randn(nblk + 3, bs, KVH, Dh, generator=gen).to(dtype)
    q = torch.randn(T, KVH * group, Dh, generator=gen).to(dtype)
    meta = PagedTreeAttentionMetadata(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([seq], dtype=torch.int32),
        block_table=perm.view(1, -1).to(torch.int32), block_size=bs,
        tree_mask=tree_mask(tree), is_tree=torch.tensor([True]))
    return q, k_cache, v_cache, meta, Dh ** -0.5


def test_kernel_single_node_tree():
    case = _tree_case([5], [0], ctx=6)
    ref = paged_tree_attention(*case)
    assert (run_kernel(*case).cpu() - ref).abs().max().item() <= 1e-5


def test_kernel_largest_tree_uses_every_bitmask_word():
    """256 draft nodes (the largest num_nodes): 257 rows, 9 words per row, bit 31
    set in some (a negative int32 word); prefix ending mid-block."""
    tokens, parents = _grow(random.Random(3).choice, 256, vocab=300, max_children=4,
                            root_token=0)
    assert len(tokens) == 257
    q, kc, vc, meta, scale = _tree_case(tokens, parents, ctx=5, bs=16, KVH=1, group=2, Dh=8)
    rows = K.tree_row_metadata(meta.query_start_loc, meta.seq_lens, meta.tree_mask,
                               meta.is_tree)
    assert rows.num_words == 9 and bool((rows.bits < 0).any())
    ref = paged_tree_attention(q, kc, vc, meta, scale)
    assert (run_kernel(q, kc, vc, meta, scale).cpu() - ref).abs().max().item() <= 1e-5


def test_kernel_chain_equals_causal_attention():
    """A chain under its tree mask is causal attention: same output as the same
    rows marked non-tree (the kernel's causal path) and as the reference."""
    n = 9
    q, kc, vc, meta, scale = _tree_case(list(range(n)), [0] + list(range(n - 1)), ctx=13)
    tree_out = run_kernel(q, kc, vc, meta, scale).cpu()
    causal = PagedTreeAttentionMetadata(meta.query_start_loc, meta.seq_lens,
                                        meta.block_table, meta.block_size)
    causal_out = run_kernel(q, kc, vc, causal, scale).cpu()
    assert torch.equal(tree_out, causal_out)
    ref = paged_tree_attention(q, kc, vc, causal, scale)
    assert (causal_out - ref).abs().max().item() <= 1e-5


def test_kernel_branching_tree_differs_from_causal():
    """Negative control: a branching tree must not come out as causal attention
    (the mask is really applied)."""
    q, kc, vc, meta, scale = _tree_case([1, 2, 3, 4, 5], [0, 0, 0, 1, 2], ctx=7)
    causal = PagedTreeAttentionMetadata(meta.query_start_loc, meta.seq_lens,
                                        meta.block_table, meta.block_size)
    tree_out = run_kernel(q, kc, vc, meta, scale).cpu()
    causal_out = run_kernel(q, kc, vc, causal, scale).cpu()
    assert (tree_out[0] - causal_out[0]).abs().max() == 0  # the root sees the same keys
    assert (tree_out[2:] - causal_out[2:]).abs().max() > 1e-3


def test_kernel_bf16():
    q, kc, vc, meta, scale = _tree_case([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 0], ctx=11,
                                        dtype=torch.bfloat16)
    ref = paged_tree_attention(q.float(), kc.float(), vc.float(), meta, scale)
    got = run_kernel(q, kc, vc, meta, scale).cpu()
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max().item() <= 2e-2


def test_kernel_lse_merges_like_a_softmax():
    """The returned log-sum-exp is that of the scaled scores over the visible keys."""
    q, kc, vc, meta, scale = _tree_case([1, 2, 3, 4], [0, 0, 1, 0], ctx=5, KVH=1, group=3)
    out, lse = run_kernel(q, kc, vc, meta, scale, return_lse=True)
    mask = tree_mask(TreeBatch.from_parents([[1, 2, 3, 4]], [[0, 0, 1, 0]], tree_size=4,
                                            max_depth=3, max_children=3))[0]
    blocks = meta.block_table[0].long()
    keys = kc[blocks].reshape(-1, 1, kc.shape[-1])[: 5 + 4]           # [L, 1, Dh]
    for j in range(4):
        visible = list(range(5)) + [5 + i for i in range(4) if mask[j, i]]
        scores = torch.einsum("hd,ld->hl", q[j].double(), keys[visible, 0].double()) * scale
        assert torch.allclose(lse[j].cpu().double(), torch.logsumexp(scores, -1), atol=1e-5)


def test_kernel_reads_the_cpu_cache_layout_views():
    """vLLM's CPU cache ([blocks, KVH, 2 * block_size * Dh], K transposed per block)
    through the strided views the CPU backend uses: no copy needed."""
    s = Scenario(5)
    nb, bs, KVH, Dh = s.k_cache.shape
    raw = torch.empty(nb, KVH, 2 * bs * Dh)
    k_view, v_view = kv_views(raw.view(nb, KVH, bs, 2 * Dh), Dh)
    k_view.copy_(s.k_cache)
    v_view.copy_(s.v_cache)
    assert not k_view.is_contiguous()
    got = run_kernel(s.q, k_view, v_view, s.meta(), s.scale).cpu()
    rows = rows_of(s)
    assert (got[rows] - s.run()[rows]).abs().max().item() <= 1e-5


@settings(max_examples=8, deadline=None)
@given(tree_batches(max_batch=3, max_nodes=10), st.integers(0, 20), st.integers(0, 2**16))
def test_kernel_property_random_tree_shapes(tree, ctx, seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = tree.batch_size, tree.tree_size
    bs, KVH, H, Dh = 4, 1, 2, 8
    q_lens = [int(n) + 1 for n in tree.node_counts]
    seq = [ctx + n for n in q_lens]
    nblk = [(x + bs - 1) // bs for x in seq]
    total = sum(nblk)
    perm = torch.randperm(total, generator=gen)
    bt = torch.zeros(B, max(nblk), dtype=torch.int32)
    off = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[off: off + n]
        off += n
    kc = torch.randn(total, bs, KVH, Dh, generator=gen)
    vc = torch.randn(total, bs, KVH, Dh, generator=gen)
    q = torch.randn(sum(q_lens), H, Dh, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = PagedTreeAttentionMetadata(qsl, torch.tensor(seq, dtype=torch.int32), bt, bs,
                                      tree_mask=tree_mask(tree),
                                      is_tree=torch.ones(B, dtype=torch.bool))
    ref = paged_tree_attention(q, kc, vc, meta, Dh ** -0.5)
    got = run_kernel(q, kc, vc, meta, Dh ** -0.5).cpu()
    assert (got - ref).abs().max().item() <= 1e-5
    assert T >= max(q_lens)


def test_kernel_bitmask_metadata_packs_the_tree_mask():
    """O(T * ceil(T/32)) words; unpacking gives back the mask, rows past a tree's
    mask and non-tree rows carry no bits."""
    s = Scenario(7)
    meta = s.meta()
    rows = K.tree_row_metadata(meta.query_start_loc, meta.seq_lens, meta.tree_mask,
                               meta.is_tree)
    T = meta.tree_mask.shape[-1]
    assert rows.bits.shape == (sum(s.q_lens), (T + 31) // 32)
    shifts = torch.arange(32)
    unpacked = ((rows.bits.long().unsqueeze(-1) >> shifts) & 1).view(rows.bits.shape[0], -1)
    for b, j, row, _ in s.valid_rows():
        want = meta.tree_mask[b, j].long() if s.is_tree[b] else torch.zeros(T, dtype=torch.long)
        assert torch.equal(unpacked[row, :T], want)
        assert int(rows.tree[row]) == int(bool(s.is_tree[b]))
        assert (int(rows.ctx[row]), int(rows.node[row])) == (s.ctx[b], j)


def test_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(K, "interpreter_enabled", lambda: False)
    case = _tree_case([1, 2], [0, 0], ctx=2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.tree_attention(case[0], case[1], case[2], case[3].block_table, 4,
                         K.tree_row_metadata(case[3].query_start_loc, case[3].seq_lens),
                         case[4])


def test_kernel_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['torch_npu'] = None\n"
            "import vllm_treespec, vllm_treespec.kernels.tree_attention as k\n"
            "assert k.triton is None and not k.interpreter_enabled()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prefix_splits_only_where_a_gpu_would_idle_and_the_prefix_is_long(monkeypatch):
    """The split rule on an H200-sized GPU (132 multiprocessors): batch 1 over a
    long prefix splits, a short prefix, a busy GPU, eager callers (no max_seq_len)
    and non-CUDA devices do not."""
    monkeypatch.setitem(K._SM_COUNT, 0, 132)
    gpu = torch.device("cuda", 0)
    assert K.prefix_splits(gpu, 8, 4096) == 8        # 1 tile x 8 KV heads
    assert K.prefix_splits(gpu, 8, 64 * 1024) == 16  # capped
    assert K.prefix_splits(gpu, 8, 512 + 8) == 1    # 8 tree rows after 512 keys
    assert K.prefix_splits(gpu, 8, 1023) == 1
    assert K.prefix_splits(gpu, 128, 4096) == 3
    assert K.prefix_splits(gpu, 256, 4096) == 1
    assert K.prefix_splits(gpu, 8, None) == 1
    assert K.prefix_splits(torch.device("cpu"), 8, 4096) == 1
