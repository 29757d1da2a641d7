"""Executors: one tree-verify step or one drafting level, issued as torch_npu calls.

Drafting levels (prefix in the paged cache + a dense side buffer of earlier-level
draft nodes) use the two-pass form: :func:`run_draft_level`.

Owns :class:`HeadConfig`, :func:`run_tree_verify`, :func:`run_draft_level` and
their layout helpers. Imports :mod:`.constants`, :mod:`.plans`, :mod:`.buffers`,
:mod:`.calls` and :mod:`vllm_treespec.attention.metadata`; the ``triton`` variant
imports :mod:`vllm_treespec.kernels.tree_attention` when it first runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.calls import (
    dense_masked_call,
    draft_prefix_call,
    eager_issue,
    full_mask_call,
    merge_call,
    prefix_call,
    tree_sparse_call,
)
from vllm_treespec.attention.ascend.constants import (
    FULL_MASK,
    TREE_SPARSE,
    TRITON,
    TWO_PASS,
    VARIANTS,
)
from vllm_treespec.attention.ascend.plans import TreeAttentionPlan
from vllm_treespec.attention.metadata import DraftTreeLevelMetadata


@dataclasses.dataclass
class HeadConfig:
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float


def _bsnd(plan: TreeAttentionPlan, flat: torch.Tensor, buffers: TreeAttentionBuffers,
          name: str) -> torch.Tensor:
    """[N, heads, D] flat tokens -> [B, T, heads, D] (a view when uniform)."""
    B, T = plan.batch_size, plan.tree_size
    heads = flat.shape[1]
    if plan.uniform:
        return flat[: B * T].view(B, T, heads, flat.shape[2])
    pad = buffers.padded(name, heads)[:B]
    torch.index_select(flat, 0, plan.token_index.reshape(-1), out=pad.view(B * T, heads, -1))
    return pad


def _packed(plan: TreeAttentionPlan, flat: torch.Tensor) -> torch.Tensor:
    """[N_all, heads, D] -> the plan's rows, contiguous TND."""
    if plan.uniform:
        return flat[: plan.num_rows]
    return flat.index_select(0, plan.rows)


def _valid_rows(plan: TreeAttentionPlan, bsnd: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [N, ...] valid positions, request-major (= plan.rows order)."""
    if plan.uniform:
        return bsnd.reshape((plan.num_rows,) + tuple(bsnd.shape[2:]))
    return bsnd[plan.valid]


def _write_rows(plan: TreeAttentionPlan, output: torch.Tensor, rows_out: torch.Tensor,
                heads: HeadConfig) -> None:
    out = output.view(output.shape[0], heads.num_heads, heads.head_size)
    if plan.uniform:
        out[: plan.num_rows].copy_(rows_out)
    else:
        out[plan.rows] = rows_out.to(out.dtype)


def run_tree_verify(ops: Any, variant: str, plan: TreeAttentionPlan,
                    buffers: TreeAttentionBuffers, query: torch.Tensor,
                    key: torch.Tensor | None, value: torch.Tensor | None,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    heads: HeadConfig, output: torch.Tensor,
                    issue: Callable | None = None) -> None:
    """Tree attention of the plan's rows, written into ``output`` at those rows.

    query:  [N_all, H, D] flat (the layer's whole batch)
    key/value: [N_all, KVH, D] this step's new K/V (``two_pass`` reads the tree
               tokens' K/V from them instead of the cache); may be None otherwise
    key_cache/value_cache: [blocks, block_size, KVH, D], already holding this
               step's K/V
    ops:    torch_npu, or the CPU emulation
    issue:  how a call is issued (default: eagerly); graph capture passes its own
    """
    issue = issue or eager_issue(ops)
    H, KVH, s = heads.num_heads, heads.num_kv_heads, heads.scale
    B, T = plan.batch_size, plan.tree_size
    if variant == FULL_MASK:
        q = _bsnd(plan, query, buffers, "q_pad")
        out_buf = buffers.padded("out_pad", H)[:B]
        out, _ = issue(full_mask_call(plan, buffers, q, key_cache, value_cache, H, KVH, s),
                       [out_buf, buffers.lse("lse_unused", (1,))])
        _write_rows(plan, output, _valid_rows(plan, out), heads)
    elif variant == TWO_PASS:
        if key is None or value is None:
            raise ValueError("two_pass needs this step's key/value tensors")
        N = plan.num_rows
        q_tnd = _packed(plan, query)
        p_out, p_lse = issue(
            prefix_call(q_tnd, key_cache, value_cache, plan.block_table, plan.cu_q_lens,
                        plan.ctx_lens, H, KVH, s),
            [buffers.padded("prefix_out", H).view(-1, H, heads.head_size)[:N],
             buffers.lse("prefix_lse", (buffers.max_reqs * T, H, 1))[:N]])
        q = _bsnd(plan, query, buffers, "q_pad")
        k = _bsnd(plan, key, buffers, "k_pad")
        v = _bsnd(plan, value, buffers, "v_pad")
        t_out, t_lse = issue(
            dense_masked_call(q, k, v, buffers.pair_mask(plan), plan.q_lens, plan.q_lens,
                              H, KVH, s),
            [buffers.padded("out_pad", H)[:B],
             buffers.lse("tree_lse", (buffers.max_reqs, H, T, 1))[:B]])
        D = heads.head_size
        # FIA's BSND lse is (B, N, S, 1); bring it to the rows' (token, head) order.
        t_lse_rows = _valid_rows(plan, t_lse.view(B, H, T).permute(0, 2, 1)).reshape(N * H)
        merged, _ = issue(merge_call(
            [p_lse.reshape(N * H).contiguous(), t_lse_rows.contiguous()],
            [p_out.reshape(N * H, D).float(),
             _valid_rows(plan, t_out).reshape(N * H, D).float()]), None)
        _write_rows(plan, output, merged.view(N, H, D).to(query.dtype), heads)
    elif variant == TREE_SPARSE:
        q_tnd = _packed(plan, query)
        rows_out = buffers.padded("prefix_out", H).view(-1, H, heads.head_size)[: plan.num_rows]
        out, _ = issue(tree_sparse_call(plan, buffers, q_tnd, key_cache, value_cache, H, KVH, s),
                       [rows_out, buffers.lse("lse_unused", (1,))])
        _write_rows(plan, output, out[: plan.num_rows], heads)
    elif variant == TRITON:
        # Our kernel reads the paged cache once with the tree as a bitmask: no
        # context-sized mask, one call. Launched eagerly (not ACL-graph captured).
        from vllm_treespec.kernels.tree_attention import tree_attention, tree_row_metadata

        if plan.kernel_rows is None:  # once per step, shared by every layer
            cu = torch.tensor([0] + plan.cu_q_lens, dtype=torch.int32)
            plan.kernel_rows = tree_row_metadata(
                cu.to(plan.intra_mask.device),
                torch.tensor(plan.kv_lens, dtype=torch.int32, device=plan.intra_mask.device),
                plan.intra_mask)
        out = tree_attention(_packed(plan, query), key_cache, value_cache, plan.block_table,
                             plan.block_size, plan.kernel_rows, s)
        _write_rows(plan, output, out, heads)
    else:
        raise ValueError(f"unknown Ascend tree-attention variant {variant!r}; "
                         f"expected one of {VARIANTS}")


def run_draft_level(ops: Any, md: DraftTreeLevelMetadata, query: torch.Tensor,
                    side_key: torch.Tensor, side_value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    heads: HeadConfig) -> torch.Tensor:
    """One tree-drafting level: the B*F frontier queries (query [B, F, H, D];
    returns the same shape, in float32) see their paged prefix
    (``prefix_len`` entries) and, in the dense side buffer, the entries their
    ``side_mask`` allows (ancestors and themselves). Two passes + LSE merge, both
    BSND (see :func:`.calls.draft_prefix_call` for why not TND).

    side_key/side_value: [B, capacity, KVH, D] contiguous, columns
    ``[0, side_offset + width)`` filled. The host prefix lengths (one sync per
    drafting step) and each level's int8 side mask are kept in ``md.scratch``,
    which every drafter layer and level of the step shares.
    """
    B, F = md.batch_size, md.width
    H, KVH, D, s = heads.num_heads, heads.num_kv_heads, heads.head_size, heads.scale
    hi, cap = md.side_offset + F, side_key.shape[1]
    prefix = md.scratch.get("ascend_prefix")
    if prefix is None:
        prefix = md.scratch["ascend_prefix"] = [int(x) for x in md.prefix_len[:B].tolist()]
    key = ("ascend_side_mask", md.side_offset, F, cap)
    side_mask = md.scratch.get(key)
    if side_mask is None:
        side_mask = torch.ones(B, 1, F, cap, dtype=torch.int8, device=query.device)
        side_mask[:, 0, :, :hi] = (~md.side_mask.bool()).to(torch.int8)
        md.scratch[key] = side_mask
    table = md.block_table[:B].to(torch.int32).contiguous()
    p_out, p_lse = draft_prefix_call(query, key_cache, value_cache, table, prefix,
                                     H, KVH, s)(ops)
    t_out, t_lse = dense_masked_call(query, side_key, side_value, side_mask,
                                     [F] * B, [hi] * B, H, KVH, s)(ops)
    M = B * F * H
    # Both BSND log-sum-exps are (B, N, S, 1); the merge takes (token, head) rows.
    merged, _ = merge_call(
        [p_lse.view(B, H, F).permute(0, 2, 1).reshape(M).contiguous(),
         t_lse.view(B, H, F).permute(0, 2, 1).reshape(M).contiguous()],
        [p_out.reshape(M, D).float(), t_out.reshape(M, D).float()])(ops)
    return merged.view(B, F, H, D)
