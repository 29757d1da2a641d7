"""Tree attention on vLLM's CPU backend.

vLLM's CPU kernel knows causal attention only. In tree mode this backend replaces
``CPU_ATTN`` (``register_backend``) and keeps the native kernel for every row.
When every tree of a step is a chain, the native causal result is already exact
(the adaptive budget often trims trees to chains on the CPU). Otherwise the tree
rows are verified as a batch of chains by the same native kernel
(``chain_split``: each chain gets the prefix's blocks through its block table and
private copies of the block its path occupies, in scratch blocks the runner
reserves), which costs about what a chain step of the same rows costs; a step
that needs more scratch blocks than reserved recomputes its tree rows with the
block-wise torch tree attention instead (``cpu_layout``, same function). While drafting a tree,
the drafter's frontier nodes attend to the paged prefix plus their ancestors in
a small per-layer side buffer (``draft_level``, ``prefix_side_attention``); nothing
of the draft tree is written to the paged cache. One-wide levels (chains) are the exception:
they run as stock EAGLE chain steps, native kernel and paged cache
(``paged_drafts.PagedForwards.chain_level``).

Outside tree mode nothing here runs: the runner only installs this backend when
the speculative method is ``eagle3_tree``, and without tree metadata every call
goes straight to the stock implementation.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_treespec.attention import DraftTreeLevelMetadata, TreeVerifyRows, cpu_layout
from vllm_treespec.attention.chain_split import ChainSplitPlan, split_into_chains
from vllm_treespec.attention.cpu_layout import kv_views
from vllm_treespec.vllm_glue import forget_resolved_backends, support, versions
from vllm_treespec.vllm_glue.draft_level import DraftLevelAttention


def probe_kv_layout(dtype: torch.dtype, block_size: int, head_size: int,
                    num_kv_heads: int = 2) -> None:
    """Write known K/V with vLLM's CPU cache kernel and read them back through
    ``kv_views``; raise at startup if this build lays the cache out differently."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    nb = 2
    cache = torch.zeros(nb, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(nb, num_kv_heads, 2 * block_size, head_size).chunk(2, 2)
    gen = torch.Generator().manual_seed(0)
    n = min(5, nb * block_size)
    key = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(nb * block_size, generator=gen)[:n]
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = kv_views(cache, head_size)
    blk, off = slots // block_size, slots % block_size
    if not (torch.equal(k[blk, off], key) and torch.equal(v[blk, off], value)):
        raise RuntimeError(
            f"eagle3_tree: the CPU attention kernel (ISA {isa!r}, dtype {dtype}, block "
            f"size {block_size}) stores its KV cache in a layout this version of "
            f"vllm-treespec cannot read; tree attention supports ISAs 'vec' and 'vec16'")


class TreeCPUAttentionImpl(DraftLevelAttention, CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None, *args, **kwargs):
        sinks = kwargs.get("sinks", args[2] if len(args) > 2 else None)
        support.check_attention_layer(sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                                      logits_soft_cap=logits_soft_cap, sinks=sinks,
                                      kv_cache_dtype=kv_cache_dtype)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, *args, **kwargs)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, DraftTreeLevelMetadata):
            return self._draft_level(query, key, value, kv_cache, attn_metadata, output)
        tree: TreeVerifyRows | None = getattr(attn_metadata, "tree_verify", None)
        if tree is None or tree.chain_only or not tree.covers_batch:
            # Native kernel (causal) for every row: exact for chains (positions and
            # slots are linear there); other tree rows are redone below.
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata,
                                     output, output_scale, output_block_scale)
        if tree is not None and not tree.chain_only:
            if "chains" not in tree.scratch:  # built by the first layer, reused by the others
                meta = tree.meta
                tree.scratch["chains"] = split_into_chains(
                    meta.tree_mask, meta.query_start_loc, meta.seq_lens, meta.block_table,
                    meta.block_size, tree.spare_blocks) if tree.spare_blocks else None
            chains = tree.scratch["chains"]
            if chains is not None:
                self._verify_chains(layer, query, kv_cache, tree, chains, output)
                return output
            plan = tree.scratch.get("cpu_plan")
            if plan is None:  # built by the first layer, reused by the others
                plan = tree.scratch["cpu_plan"] = cpu_layout.plan(tree.meta, query.dtype)
            q = query[tree.rows].view(-1, self.num_heads, self.head_size)
            out = cpu_layout.tree_attention(q, kv_cache, plan, self.scale)
            output[tree.rows] = out.reshape((out.shape[0],) + output.shape[1:]).to(output.dtype)
        return output

    def _verify_chains(self, layer, query, kv_cache, tree: TreeVerifyRows,
                       chains: ChainSplitPlan, output) -> None:
        """Tree rows as causal chain requests of the native kernel (see chain_split)."""
        step = chains.scratch.get(self.num_heads)
        if step is None:  # once per step: the same for every layer of this shape
            step = chains.scratch[self.num_heads] = self._chain_step(
                tree, chains, kv_cache, query.dtype, versions.attention_isa(self, layer))
        rows, span, read, write, scheduler_metadata = step
        for src, dst, count in chains.copies:  # the prefix's tail, into private blocks
            kv_cache[dst: dst + count].copy_(kv_cache[src].expand((count,) + kv_cache.shape[1:]))
        if read is not None:
            # The path's K/V at their logical offsets, cache to cache: the stock
            # KV update already put every row's K/V at its linear slot.
            flat = kv_cache.view(-1)
            flat.index_copy_(0, write, flat.index_select(0, read))
        key_cache, value_cache = self._split_cache(kv_cache)
        if span is not None:  # chain order is the rows' own order: no gather, no scatter
            q, out = query[span[0]:span[1]], output[span[0]:span[1]]
        else:
            q = query.index_select(0, rows)
            out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=chains.query_start_loc, seq_lens=chains.seq_lens,
            scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=chains.block_table, softcap=0.0,
            scheduler_metadata=scheduler_metadata, s_aux=None,
            k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        if span is None:
            output.index_copy_(0, rows, out.view((out.shape[0],) + output.shape[1:])
                               .to(output.dtype))

    def _split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's K and V views of this layer's cache (made once: same tensor
        every step)."""
        cached = getattr(self, "_kv_split", None)
        if cached is None or cached[0] is not kv_cache:
            nb, kvh, bs, _ = kv_cache.shape
            cached = self._kv_split = (kv_cache, *kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, 2))
        return cached[1], cached[2]

    def _chain_step(self, tree: TreeVerifyRows, chains: ChainSplitPlan, kv_cache, dtype,
                    isa: str):
        """Per-step inputs of ``_verify_chains``: query rows in chain order (and the
        span they form when contiguous and in order), the flat cache elements the
        path's K/V are copied from and to, and the kernel's scheduler metadata."""
        rows = tree.rows[chains.order]
        lo, n = int(rows[0]), rows.numel()
        span = (lo, lo + n) if torch.equal(rows, torch.arange(lo, lo + n)) else None
        read = write = None
        if chains.write_rows.numel():
            read = cpu_layout.slot_elements(kv_cache, chains.read_slots)
            write = cpu_layout.slot_elements(kv_cache, chains.write_slots)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=chains.num_chains, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_size, seq_lens=chains.seq_lens,
            dtype=dtype, query_start_loc=chains.query_start_loc, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False,
            kv_cache_dtype=self.kv_cache_dtype)
        return rows, span, read, write, metadata

    def _attend_level(self, q, side_key, side_value, kv_cache, md: DraftTreeLevelMetadata):
        prefix = md.scratch.get(id(self))
        if prefix is None:  # the committed prefix is the same for every level
            prefix = md.scratch[id(self)] = cpu_layout.gather_prefix(
                kv_cache, md.block_table, md.prefix_len, md.max_prefix_len, self.head_size,
                q.dtype)
        hi = md.side_offset + md.width
        return cpu_layout.prefix_side_attention(q, *prefix, side_key[:, :hi], side_value[:, :hi],
                                                md.side_mask, self.scale)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with tree rows; identical to the stock backend otherwise."""

    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl


def install() -> None:
    """Make ``CPU_ATTN`` resolve to the tree-aware backend in this process."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     f"{TreeCPUAttentionBackend.__module__}.{TreeCPUAttentionBackend.__qualname__}")
    forget_resolved_backends()
