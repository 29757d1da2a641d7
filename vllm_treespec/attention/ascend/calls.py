"""The torch_npu calls, built as data: op names, :class:`OpCall` and its builders.

Every builder returns the exact argument tuple of one torch_npu attention call
(FIA, FIA v2 or ``npu_attention_update``); :class:`OpCall` issues it on an
``ops`` namespace (torch_npu or the CPU emulation). Owns the op-name, sparse-mode
and precision constants, :class:`OpCall`, :func:`eager_issue` and the call
builders. Imports :mod:`.constants`, :mod:`.plans` and :mod:`.buffers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE
from vllm_treespec.attention.ascend.plans import TreeAttentionPlan

CAUSAL_MASK_SIZE = 2048          # sparse modes 2/3/4 take a compressed 2048x2048 mask

FIA = "npu_fused_infer_attention_score"
FIA_V2 = "npu_fused_infer_attention_score_v2"
ATTENTION_UPDATE = "npu_attention_update"

SPARSE_DEFAULT_MASK = 0
SPARSE_RIGHT_DOWN_CAUSAL = 3
SPARSE_TREE_MASK = 9
# bit0 = 0: high precision; bit1 = 1: "invalid row" correction. The docs advise
# the correction whenever Q_S > 1 with a user mask under sparse 0/1.
INNER_PRECISE_HIGH_ROW_FIX = 2
MASKED = 1                       # FIA masks: 1 = do not attend


@dataclasses.dataclass
class OpCall:
    """One torch_npu call exactly as issued: ``getattr(ops, op)(*args, **kwargs)``."""

    op: str
    args: tuple
    kwargs: dict[str, Any]
    role: str = ""   # which builder made it (graph replay refreshes by role)

    def __call__(self, ops: Any):
        return getattr(ops, self.op)(*self.args, **self.kwargs)

    def with_kwargs(self, **changes: Any) -> "OpCall":
        return OpCall(self.op, self.args, {**self.kwargs, **changes}, self.role)

    def step_kwargs(self, plan: "TreeAttentionPlan") -> dict[str, Any]:
        """The kwargs with this step's host lengths (ACL graph replay re-issues a
        captured call with them; tensors stay the captured ones)."""
        if self.role == FULL_MASK:
            return {**self.kwargs, "actual_seq_lengths": list(plan.q_lens),
                    "actual_seq_lengths_kv": list(plan.kv_lens)}
        if self.role == TREE_SPARSE:
            return {**self.kwargs, "actual_seq_qlen": plan.cu_q_lens,
                    "actual_seq_kvlen": list(plan.kv_lens)}
        if self.role == "prefix":
            return {**self.kwargs, "actual_seq_lengths": plan.cu_q_lens,
                    "actual_seq_lengths_kv": plan.ctx_lens}
        return dict(self.kwargs)


def eager_issue(ops: Any) -> Callable[[OpCall, Sequence[torch.Tensor] | None], Any]:
    """The default issuer: run the call and return its outputs.

    ``outs`` (the persistent buffers graph capture writes into) is ignored here;
    the glue's capture issuer runs the ``.out`` variant into them instead.
    """

    def issue(call: OpCall, outs: Sequence[torch.Tensor] | None = None):
        return call(ops)

    return issue


def paged_kv(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, block, KVH, D] -> the (blocknum, blocksize, H) paged layout FIA reads."""
    nb, bs = cache.shape[:2]
    return cache.view(nb, bs, -1)


def causal_paged_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, cu_q_lens: Sequence[int],
                      kv_lens: Sequence[int], causal_mask: torch.Tensor, num_heads: int,
                      num_kv_heads: int, scale: float) -> OpCall:
    """vllm-ascend's own chunked-prefill / spec-decode call (TND, ``sparse_mode=3``
    with the compressed 2048x2048 causal mask): every row causal. Used to check
    that a chain-shaped tree reproduces it, and by the hardware kit."""
    return OpCall(FIA, (query, paged_kv(key_cache), paged_kv(value_cache)), dict(
        atten_mask=causal_mask, block_table=block_table, input_layout="TND",
        block_size=key_cache.shape[1], actual_seq_lengths=list(cu_q_lens),
        actual_seq_lengths_kv=list(kv_lens), num_key_value_heads=num_kv_heads,
        num_heads=num_heads, scale=scale, sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL), "causal")


def compressed_causal_mask(device, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """The 2048x2048 upper-triangular mask sparse modes 2/3/4 expect (1 = masked)."""
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=dtype, device=device).triu(1)


def full_mask_call(plan: TreeAttentionPlan, buffers: TreeAttentionBuffers,
                   query_bsnd: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   scale: float) -> OpCall:
    """A: one BSND FIA call over the paged cache with the persistent full mask."""
    return OpCall(FIA, (query_bsnd, paged_kv(key_cache), paged_kv(value_cache)), dict(
        atten_mask=buffers.full_mask(plan), block_table=plan.block_table,
        actual_seq_lengths=list(plan.q_lens), actual_seq_lengths_kv=list(plan.kv_lens),
        num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        input_layout="BSND", sparse_mode=SPARSE_DEFAULT_MASK,
        inner_precise=INNER_PRECISE_HIGH_ROW_FIX, block_size=key_cache.shape[1]), FULL_MASK)


def prefix_call(query_tnd: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_table: torch.Tensor, cu_q_lens: Sequence[int],
                prefix_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                scale: float) -> OpCall:
    """B, first pass: every query sees its whole committed prefix (no mask),
    with the log-sum-exp the merge needs. TND without rope: documented for head
    size 128/192 and bfloat16 only (:mod:`.documented`)."""
    return _prefix_lse_call(query_tnd, "TND", list(cu_q_lens), key_cache, value_cache,
                            block_table, prefix_lens, num_heads, num_kv_heads, scale, "prefix")


def draft_prefix_call(query_bsnd: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_table: torch.Tensor,
                      prefix_lens: Sequence[int], num_heads: int, num_kv_heads: int,
                      scale: float) -> OpCall:
    """A drafting level's first pass: each request's ``F`` frontier queries see its
    paged prefix (no mask), with the log-sum-exp. BSND rather than TND: every request
    has the same ``F`` queries, so nothing is padded, and BSND with page attention is
    documented for float16 and bfloat16 at any head size the op takes, where TND
    without rope is documented for bfloat16 at head size 128/192 only."""
    B, F = query_bsnd.shape[:2]
    return _prefix_lse_call(query_bsnd, "BSND", [F] * B, key_cache, value_cache, block_table,
                            prefix_lens, num_heads, num_kv_heads, scale, "draft_prefix")


def _prefix_lse_call(query: torch.Tensor, layout: str, q_lens: list[int],
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, prefix_lens: Sequence[int], num_heads: int,
                     num_kv_heads: int, scale: float, label: str) -> OpCall:
    """Queries over their paged prefix, no mask, with the log-sum-exp (the first
    pass of both two-pass forms; ``q_lens`` in ``layout``'s convention)."""
    return OpCall(FIA, (query, paged_kv(key_cache), paged_kv(value_cache)), dict(
        block_table=block_table, input_layout=layout, block_size=key_cache.shape[1],
        actual_seq_lengths=q_lens, actual_seq_lengths_kv=list(prefix_lens),
        num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        sparse_mode=SPARSE_DEFAULT_MASK, softmax_lse_flag=True), label)


def dense_masked_call(query_bsnd: torch.Tensor, key_bsnd: torch.Tensor,
                      value_bsnd: torch.Tensor, mask: torch.Tensor,
                      q_lens: Sequence[int], kv_lens: Sequence[int], num_heads: int,
                      num_kv_heads: int, scale: float) -> OpCall:
    """B, second pass: queries against a small dense K/V block under a mask."""
    return OpCall(FIA, (query_bsnd, key_bsnd, value_bsnd), dict(
        atten_mask=mask, input_layout="BSND", actual_seq_lengths=list(q_lens),
        actual_seq_lengths_kv=list(kv_lens), num_heads=num_heads,
        num_key_value_heads=num_kv_heads, scale=scale, sparse_mode=SPARSE_DEFAULT_MASK,
        inner_precise=INNER_PRECISE_HIGH_ROW_FIX, softmax_lse_flag=True), "dense")


def tree_sparse_call(plan: TreeAttentionPlan, buffers: TreeAttentionBuffers,
                     query_tnd: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                     scale: float) -> OpCall:
    """C: one FIA v2 call, TND, ``sparse_mode=9`` with the flat tree mask. With a
    paged cache the KV lengths are per request (not cumulative).

    Not a documented call: v2's docs list sparse modes 0-4 only, and v1 documents
    mode 9 ("treeMask") only for MLA (``query_rope`` and ``key_rope`` given). The
    mask layout used here is our assumption, which the startup probe
    (:func:`.synthetic.probe_tree_sparse`) checks against ``full_mask`` on the
    device before the backend uses it."""
    return OpCall(FIA_V2, (query_tnd, paged_kv(key_cache), paged_kv(value_cache)), dict(
        atten_mask=buffers.flat_tree_mask(plan), block_table=plan.block_table,
        input_layout="TND", block_size=key_cache.shape[1],
        actual_seq_qlen=plan.cu_q_lens, actual_seq_kvlen=list(plan.kv_lens),
        num_query_heads=num_heads, num_key_value_heads=num_kv_heads,
        softmax_scale=scale, sparse_mode=SPARSE_TREE_MASK), TREE_SPARSE)


def merge_call(lses: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> OpCall:
    """``npu_attention_update``: O = sum_i O_i * exp(lse_i - logsumexp_i lse_i).

    lses: [M] float32 each; outs: [M, D] each (same row order)."""
    return OpCall(ATTENTION_UPDATE, (list(lses), list(outs), 0), {}, "merge")
