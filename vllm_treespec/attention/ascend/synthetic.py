"""Synthetic verify batches: for the unit tests, ``npu-check`` and the startup probe.

Owns :class:`SyntheticBatch`, :func:`make_verify_batch`, :func:`buffers_for`,
:func:`verify_with` (the backend's mixed-batch path on a synthetic batch),
:func:`kv_boundary_batch` (contexts either side of kernel boundaries), and
the startup probe of ``tree_sparse`` (:class:`ProbeResult`,
:func:`probe_tree_sparse`). The top of the package: may import every other
module of it, plus :mod:`vllm_treespec.attention.metadata` / ``.reference`` and
(lazily) :mod:`vllm_treespec.tree`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.calls import causal_paged_call, compressed_causal_mask
from vllm_treespec.attention.ascend.constants import ASCEND_BLOCK_SIZE, FULL_MASK, TREE_SPARSE
from vllm_treespec.attention.ascend.documented import variant_gap
from vllm_treespec.attention.ascend.execute import HeadConfig, run_tree_verify
from vllm_treespec.attention.ascend.plans import TreeAttentionPlan, plan_tree_rows
from vllm_treespec.attention.metadata import PagedTreeAttentionMetadata, TreeVerifyRows
from vllm_treespec.attention.reference import paged_tree_attention


@dataclasses.dataclass
class SyntheticBatch:
    """A random verify batch with everything both sides need (probe, tests, kit).

    kinds[b]: "tree" (random BFS tree), "chain", "causal" (prefill/decode chunk)
    query/key/value: [N, H|KVH, D] flat; the new K/V are also in the caches
    tree_rows: the runner's ``TreeVerifyRows`` for the tree/chain requests
    reference: reference metadata over all rows (is_tree marks tree/chain rows)
    """

    kinds: list[str]
    q_lens: list[int]
    kv_lens: list[int]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    tree_rows: TreeVerifyRows
    reference: PagedTreeAttentionMetadata
    heads: HeadConfig

    @property
    def cu_q_lens(self) -> list[int]:
        return list(itertools.accumulate(self.q_lens))

    def request_rows(self, b: int) -> torch.Tensor:
        """Indices of request b's query rows in the flat batch."""
        start = sum(self.q_lens[:b])
        return torch.arange(start, start + self.q_lens[b], device=self.query.device)

    def reference_output(self) -> torch.Tensor:
        q32 = self.query.float()
        return paged_tree_attention(q32, self.key_cache.float(), self.value_cache.float(),
                                    self.reference, self.heads.scale)


def _random_tree_parents(rng: random.Random, n: int, chain: bool) -> list[int]:
    """Parents of n draft nodes (root 0 excluded). Non-decreasing parent indices
    give BFS order: every parent precedes its children."""
    parents, lo = [0], 0
    for i in range(1, n + 1):
        p = i - 1 if chain else rng.randint(lo, i - 1)
        parents.append(p)
        lo = p
    return parents


def _request_lengths(rng: random.Random, kinds: Sequence[str], T: int, max_ctx: int,
                     full_trees: bool, kv_lens: Sequence[int] | None):
    """Query lengths, committed-context lengths and tree parents per request."""
    q_lens, ctx, parents_of = [], [], {}
    for b, kind in enumerate(kinds):
        if kind in ("tree", "chain"):
            n = T - 1 if full_trees else rng.randint(0, T - 1)
            parents_of[b] = _random_tree_parents(rng, n, kind == "chain")
            q_lens.append(n + 1)
        elif kind == "causal":
            q_lens.append(rng.choice([1, rng.randint(2, 2 * T)]))
        else:
            raise ValueError(f"unknown request kind {kind!r}")
        if kv_lens is None:
            ctx.append(rng.randint(1, max_ctx))
        elif kv_lens[b] < q_lens[b]:
            raise ValueError(f"kv length {kv_lens[b]} < the request's {q_lens[b]} queries")
        else:
            ctx.append(kv_lens[b] - q_lens[b])
    return q_lens, ctx, parents_of


def make_verify_batch(seed: int, kinds: Sequence[str], tree_size: int, num_heads: int,
                      num_kv_heads: int, head_size: int, dtype: torch.dtype = torch.float32,
                      device="cpu", max_ctx: int = 300, block_size: int = ASCEND_BLOCK_SIZE,
                      full_trees: bool = False,
                      kv_lens: Sequence[int] | None = None) -> SyntheticBatch:
    """Build a random mixed verify batch (see :class:`SyntheticBatch`). Contexts are
    random up to ``max_ctx``, or, with ``kv_lens``, sized so that request b's KV
    length (context plus its queries) is exactly ``kv_lens[b]``."""
    from vllm_treespec.tree import TreeBatch, tree_mask  # pure torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    T = tree_size
    q_lens, ctx, parents_of = _request_lengths(rng, kinds, T, max_ctx, full_trees, kv_lens)
    kv_lens = [c + q for c, q in zip(ctx, q_lens)]
    need = [(kv + block_size - 1) // block_size for kv in kv_lens]
    max_blocks = max(need) + rng.randint(0, 2)
    num_blocks = sum(need) + rng.randint(1, 3)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(kinds), max_blocks, dtype=torch.int32)
    for b, k in enumerate(need):
        for i in range(k):
            table[b, i] = perm.pop()
    H, KVH, D = num_heads, num_kv_heads, head_size
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen)
    N = sum(q_lens)
    query = torch.randn(N, H, D, generator=gen)
    key = torch.randn(N, KVH, D, generator=gen)
    value = torch.randn(N, KVH, D, generator=gen)
    starts = [0] + list(itertools.accumulate(q_lens))
    for b in range(len(kinds)):  # the step's K/V are already in the cache
        for j in range(q_lens[b]):
            pos = ctx[b] + j
            blk, off = int(table[b, pos // block_size]), pos % block_size
            k_cache[blk, off] = key[starts[b] + j]
            v_cache[blk, off] = value[starts[b] + j]
    to = dict(dtype=dtype, device=device)
    query, key, value = query.to(**to), key.to(**to), value.to(**to)
    k_cache, v_cache = k_cache.to(**to), v_cache.to(**to)
    table = table.to(device)
    tree_reqs = sorted(parents_of)
    trees = TreeBatch.from_parents([[0] * len(parents_of[b]) for b in tree_reqs],
                                   [parents_of[b] for b in tree_reqs], tree_size=T,
                                   device=device) if tree_reqs else None
    tmask = tree_mask(trees) if trees is not None else torch.zeros(0, T, T, dtype=torch.bool)
    rows = [starts[b] + j for b in tree_reqs for j in range(q_lens[b])]
    t_qsl = [0] + list(itertools.accumulate(q_lens[b] for b in tree_reqs))
    tree_rows = TreeVerifyRows(
        covers_batch=len(rows) == N,
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        meta=PagedTreeAttentionMetadata(
            query_start_loc=torch.tensor(t_qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([kv_lens[b] for b in tree_reqs], dtype=torch.int32,
                                  device=device),
            block_table=table[tree_reqs] if tree_reqs else table[:0],
            block_size=block_size, tree_mask=tmask.to(device),
            max_query_len=max([q_lens[b] for b in tree_reqs], default=1),
            max_seq_len=max([kv_lens[b] for b in tree_reqs], default=1)))
    full_mask_all = torch.zeros(len(kinds), T, T, dtype=torch.bool, device=device)
    for i, b in enumerate(tree_reqs):
        full_mask_all[b] = tmask[i]
    reference = PagedTreeAttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device), block_table=table,
        block_size=block_size, tree_mask=full_mask_all,
        is_tree=torch.tensor([k in ("tree", "chain") for k in kinds], device=device))
    return SyntheticBatch(kinds=list(kinds), q_lens=q_lens, kv_lens=kv_lens, query=query,
                          key=key, value=value, key_cache=k_cache, value_cache=v_cache,
                          block_table=table, tree_rows=tree_rows, reference=reference,
                          heads=HeadConfig(H, KVH, D, 1.0 / math.sqrt(D)))


# KV lengths either side of positions where an FIA kernel is known, or may be
# expected, to change behaviour: 512 (vllm-ascend #15503: a sparse_mode=0 mask is
# ignored from KV position 512 on), 1024, 2048 (the compressed causal mask's size)
# and 4096. Most are not multiples of the 128-token block: the last block is partial.
KV_BOUNDARY_LENS = (511, 512, 513, 640, 1023, 1024, 1025, 2047, 2049, 4095, 4096, 4097)


def kv_boundary_batch(seed: int, tree_size: int, num_heads: int, num_kv_heads: int,
                      head_size: int, dtype: torch.dtype = torch.float32, device="cpu",
                      kv_lens: Sequence[int] = KV_BOUNDARY_LENS) -> SyntheticBatch:
    """One full random tree per KV length in ``kv_lens``. A tree fills the last
    ``tree_size`` KV positions, so at 513 its last node (a leaf) sits at position
    512, where the mask hides it from every other row: a mask misread from position
    512 on shows at 513 and beyond, not at 511 or 512. Random contexts of a few
    hundred tokens never get there."""
    return make_verify_batch(seed, ["tree"] * len(kv_lens), tree_size, num_heads,
                             num_kv_heads, head_size, dtype=dtype, device=device,
                             full_trees=True, kv_lens=kv_lens)


def buffers_for(batch: SyntheticBatch, plan: TreeAttentionPlan) -> TreeAttentionBuffers:
    h = batch.heads
    return TreeAttentionBuffers(max(plan.batch_size, 1), plan.tree_size, h.num_heads,
                                h.num_kv_heads, h.head_size, batch.query.dtype,
                                batch.query.device, batch.block_table.shape[1],
                                batch.key_cache.shape[1])


def verify_with(ops: Any, variant: str, batch: SyntheticBatch,
                buffers: TreeAttentionBuffers | None = None) -> torch.Tensor:
    """Stock causal call over every row, then ``variant`` over the tree rows: what
    the backend does for a mixed batch. Returns [N, H, D]."""
    out = torch.empty_like(batch.query)
    stock, _ = causal_paged_call(batch.query, batch.key_cache, batch.value_cache,
                                 batch.block_table, batch.cu_q_lens, batch.kv_lens,
                                 compressed_causal_mask(batch.query.device),
                                 batch.heads.num_heads, batch.heads.num_kv_heads,
                                 batch.heads.scale)(ops)
    out.copy_(stock)
    if batch.tree_rows.rows.numel():
        plan = plan_tree_rows(batch.tree_rows)
        buffers = buffers or buffers_for(batch, plan)
        run_tree_verify(ops, variant, plan, buffers, batch.query, batch.key, batch.value,
                        batch.key_cache, batch.value_cache, batch.heads, out)
    return out


# ----------------------------------------------------------------- startup probe
@dataclasses.dataclass
class ProbeResult:
    ok: bool
    reason: str
    max_abs_err: float | None = None


def probe_tree_sparse(ops: Any, device, dtype: torch.dtype, num_heads: int,
                      num_kv_heads: int, head_size: int, tree_size: int,
                      atol: float | None = None, seed: int = 0) -> ProbeResult:
    """Run ``tree_sparse`` (C) and ``full_mask`` (A) on the same random batches
    (trees with padding, chains, several requests) on ``ops``'s device and
    compare. C is used only when this returns ok; the reason is logged.

    Two layers of doubt, answered differently: C's TND call is documented only for
    some head sizes and dtypes (:mod:`.documented`), so outside them the probe
    declines without running anything; the tree-mask layout itself (sparse mode 9
    on v2 for GQA) is documented nowhere, which is what the comparison checks."""
    gap = variant_gap(TREE_SPARSE, head_size, dtype)
    if gap is not None:
        return ProbeResult(False, f"not probed: {gap}")
    if atol is None:
        atol = {torch.float32: 1e-4, torch.float16: 5e-3}.get(dtype, 3e-2)
    worst = 0.0
    for i, kinds in enumerate((["tree", "chain", "tree"], ["tree"] * 4)):
        batch = make_verify_batch(seed + i, kinds, tree_size, num_heads, num_kv_heads,
                                  head_size, dtype=dtype, device=device, max_ctx=260,
                                  full_trees=(i == 1))
        plan = plan_tree_rows(batch.tree_rows)
        outs = {}
        for variant in (FULL_MASK, TREE_SPARSE):
            out = torch.zeros_like(batch.query)
            try:
                run_tree_verify(ops, variant, plan, buffers_for(batch, plan), batch.query,
                                batch.key, batch.value, batch.key_cache, batch.value_cache,
                                batch.heads, out)
            except Exception as err:  # an unsupported combination is a verdict, not a crash
                return ProbeResult(False, f"{variant} raised {type(err).__name__}: {err}")
            outs[variant] = out[plan.rows].float()
        if not bool(torch.isfinite(outs[TREE_SPARSE]).all()):
            return ProbeResult(False, "sparse_mode=9 produced non-finite values")
        err = float((outs[TREE_SPARSE] - outs[FULL_MASK]).abs().max())
        worst = max(worst, err)
        if err > atol:
            return ProbeResult(False, f"sparse_mode=9 differs from the full-mask path by "
                                      f"{err:.3g} (> {atol:g})", err)
    return ProbeResult(True, f"sparse_mode=9 matches the full-mask path (max abs err "
                             f"{worst:.3g})", worst)
