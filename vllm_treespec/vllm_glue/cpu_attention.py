"""Tree attention on vLLM's CPU backend.

vLLM's CPU kernel knows causal attention only. In tree mode this backend replaces
``CPU_ATTN`` (``register_backend``) and keeps the native kernel for every row,
then recomputes the rows of tree-verify requests with a block-wise paged tree
attention (same function as the reference). When every tree of a step is a
chain, the native causal result is already exact and nothing is redone (the
adaptive budget often trims trees to chains on the CPU). While drafting a tree,
the drafter's frontier nodes attend to the paged prefix plus their ancestors in
a small per-layer side buffer (``prefix_side_attention``); nothing of the draft
tree is written to the paged cache.

Outside tree mode nothing here runs: the runner only installs this backend when
the speculative method is ``eagle3_tree``, and without tree metadata every call
goes straight to the stock implementation.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

from vllm_treespec.attention import DraftTreeLevelMetadata, TreeVerifyRows, cpu_layout
from vllm_treespec.attention.cpu_layout import kv_views
from vllm_treespec.vllm_glue import support


def probe_kv_layout(dtype: torch.dtype, block_size: int, head_size: int,
                    num_kv_heads: int = 2) -> None:
    """Write known K/V with vLLM's CPU cache kernel and read them back through
    ``kv_views``; raise at startup if this build lays the cache out differently."""
    from vllm import _custom_ops as ops
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


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
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
            plan = tree.scratch.get("cpu_plan")
            if plan is None:  # built by the first layer, reused by the others
                plan = tree.scratch["cpu_plan"] = cpu_layout.plan(tree.meta, query.dtype)
            q = query[tree.rows].view(-1, self.num_heads, self.head_size)
            out = cpu_layout.tree_attention(q, kv_cache, plan, self.scale)
            output[tree.rows] = out.reshape((out.shape[0],) + output.shape[1:]).to(output.dtype)
        return output

    def _draft_level(self, query, key, value, kv_cache, md: DraftTreeLevelMetadata, output):
        B, F, D = md.batch_size, md.width, self.head_size
        side = getattr(self, "_side_kv", None)
        if (side is None or side.shape[1] < B or side.shape[2] < md.side_capacity
                or side.dtype != key.dtype):
            side = torch.zeros(2, B, md.side_capacity, self.num_kv_heads, D,
                               dtype=key.dtype, device=key.device)
            self._side_kv = side
        lo, hi = md.side_offset, md.side_offset + F
        side[0, :B, lo:hi] = key[: B * F].view(B, F, self.num_kv_heads, D)
        side[1, :B, lo:hi] = value[: B * F].view(B, F, self.num_kv_heads, D)
        prefix = md.scratch.get(id(self))
        if prefix is None:  # the committed prefix is the same for every level
            prefix = md.scratch[id(self)] = cpu_layout.gather_prefix(
                kv_cache, md.block_table, md.prefix_len, md.max_prefix_len, D, query.dtype)
        q = query[: B * F].view(B, F, self.num_heads, D)
        out = cpu_layout.prefix_side_attention(q, *prefix, side[0, :B, :hi], side[1, :B, :hi],
                                               md.side_mask, self.scale)
        output[: B * F] = out.reshape((B * F,) + output.shape[1:]).to(output.dtype)
        return output


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
    try:  # a backend resolved earlier in this process must not stay cached
        from vllm.v1.attention import selector
        selector._cached_get_attn_backend.cache_clear()
    except AttributeError:
        pass
