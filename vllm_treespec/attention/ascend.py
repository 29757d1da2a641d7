"""Tree-verify attention on Ascend NPUs, expressed as torch_npu calls.

Pure torch: this module builds the exact argument tuples of the torch_npu
attention ops and runs them through an ``ops`` namespace that is either the real
``torch_npu`` module or the CPU emulation of its documented contract
(:mod:`vllm_treespec.attention.emulation`). Nothing here imports torch_npu, so it
imports and is tested on any machine; the vLLM-Ascend glue lives in
``vllm_treespec.vllm_glue.ascend``.

The function computed is the reference's (``reference.paged_tree_attention``):
each query token of a request sees the request's committed context ``[0, ctx)``
plus, among the request's own query tokens, exactly those allowed by its
intra-request mask (ancestor-or-self for a draft tree, causal otherwise). The KV
cache is vllm-ascend's: per layer a K and a V tensor ``[blocks, 128, KVH, D]``.

Three ways to express it with torch_npu (documented contracts, see the op docs
of ``npu_fused_infer_attention_score`` (FIA), ``npu_fused_infer_attention_score_v2``
and ``npu_attention_update``, and CANN's sparse-mode table):

* ``full_mask`` (A, default): one FIA call, ``input_layout="BSND"``, queries padded
  to ``T`` per request, ``atten_mask`` int8 ``(B, 1, T, max_blocks*128)`` (1 =
  masked) over the paged KV, ``sparse_mode=0``, ``inner_precise=2``. The mask
  lives in a persistent buffer that stays all-zero except for each request's
  ``T`` tree columns ``[ctx, ctx+T)``; a step rewrites only those windows.
  TND cannot carry a user mask (TND allows only sparse 0 without a mask or
  sparse 3 with the compressed causal mask), hence BSND.
* ``two_pass`` (B): prefix attention without a mask (TND, KV length ``ctx``,
  ``softmax_lse_flag=True``) plus dense attention among the ``T`` tree tokens
  (BSND over the step's own K/V, mask ``(B, 1, T, T)``), merged through their
  log-sum-exps by ``npu_attention_update``. Its mask does not grow with context.
* ``tree_sparse`` (C): one FIA v2 call with ``sparse_mode=9`` ("treeMask": per
  request a ``q x q`` mask over the last ``q`` KV positions, TND flat layout
  ``(sum q_i^2,)``). CANN documents it for GQA without quantisation, but no
  vllm-ascend path uses it yet; the backend enables it only after
  :func:`probe_tree_sparse` agreed with ``full_mask`` on the live device.

Drafting levels (prefix in the paged cache + a dense side buffer of earlier-level
draft nodes) use the two-pass form: :func:`run_draft_level`.

Static shapes: a uniform verify batch (every request has ``T`` query tokens laid
out back to back, the case ACL graphs capture) is viewed as BSND without any
copy; masks, padded queries and outputs live in :class:`TreeAttentionBuffers`,
allocated once.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_treespec.attention.metadata import DraftTreeLevelMetadata, TreeVerifyRows
from vllm_treespec.attention.reference import (
    PagedTreeAttentionMetadata,
    paged_tree_attention,
)

ASCEND_BLOCK_SIZE = 128          # vllm-ascend's only kernel block size
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

FULL_MASK = "full_mask"
TWO_PASS = "two_pass"
TREE_SPARSE = "tree_sparse"
VARIANTS = (FULL_MASK, TWO_PASS, TREE_SPARSE)


# --------------------------------------------------------------------- op calls
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


# --------------------------------------------------------------------- the plan
_plan_serial = itertools.count(1)


@dataclasses.dataclass
class TreeAttentionPlan:
    """Host and device facts of one verify step, shared by every layer.

    q_lens / kv_lens: per request, host ints (FIA takes host lists)
    tree_size:   T, the padded per-request query length
    block_table: [B, max_blocks] int32, contiguous
    intra_mask:  [B, T, T] bool, True = query i may see the request's query token j;
                 rows past ``q_lens[b]`` see only token 0 (never an empty row)
    token_index: [B, T] flat query row of (b, j); padding repeats the last valid row
    rows:        [N] flat query rows covered, request-major (N = sum q_lens)
    valid:       [B, T] bool, j < q_lens[b]
    uniform:     rows are exactly 0..B*T-1 and every q_len == T, so the flat
                 token layout *is* BSND and nothing is copied
    """

    q_lens: list[int]
    kv_lens: list[int]
    tree_size: int
    block_table: torch.Tensor
    block_size: int
    intra_mask: torch.Tensor
    token_index: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    uniform: bool
    serial: int = dataclasses.field(default_factory=lambda: next(_plan_serial))

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_rows(self) -> int:
        return sum(self.q_lens)

    @property
    def ctx_lens(self) -> list[int]:
        return [kv - q for kv, q in zip(self.kv_lens, self.q_lens)]

    @property
    def cu_q_lens(self) -> list[int]:
        return list(itertools.accumulate(self.q_lens))


def _pad_mask(mask: torch.Tensor, q_lens: torch.Tensor) -> torch.Tensor:
    """Restrict [B, T, T] may-attend masks to each request's q tokens; padding
    rows see token 0 only (a finite softmax whose result is discarded)."""
    T = mask.shape[-1]
    j = torch.arange(T, device=mask.device)
    valid = j.unsqueeze(0) < q_lens.unsqueeze(1)                           # [B, T]
    inside = valid.unsqueeze(2) & valid.unsqueeze(1)
    root_only = (j == 0).view(1, 1, T).expand_as(mask)
    return torch.where(valid.unsqueeze(2), mask & inside, root_only)


def _causal(B: int, T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T).clone()


def plan_tree_rows(tree: TreeVerifyRows) -> TreeAttentionPlan:
    """Plan of the tree requests of a verify step (the rows the runner attached).

    One host synchronisation (query/KV lengths and rows to host lists), done once
    per step: the glue keeps the plan in the rows' ``scratch``, shared by all layers.
    """
    meta = tree.meta
    qsl = [int(x) for x in meta.query_start_loc.tolist()]
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    kv_lens = [int(x) for x in meta.seq_lens.tolist()]
    if meta.tree_mask is None:
        raise ValueError("tree-verify rows carry no tree mask")
    T = int(meta.tree_mask.shape[-1])
    B = len(q_lens)
    if max(q_lens) > T:
        raise ValueError(f"a request has {max(q_lens)} query tokens but the tree "
                         f"mask is only {T} wide")
    dev = meta.tree_mask.device
    q_t = torch.tensor(q_lens, device=dev)
    mask = meta.tree_mask.bool()
    if meta.is_tree is not None:  # non-tree rows are causal
        mask = torch.where(meta.is_tree.bool().view(-1, 1, 1), mask, _causal(B, T, dev))
    intra = _pad_mask(mask, q_t)
    rows = tree.rows.long()
    j = torch.arange(T, device=dev)
    start = torch.tensor(qsl[:-1], device=dev).unsqueeze(1)
    token_index = rows[start + torch.minimum(j.unsqueeze(0), q_t.unsqueeze(1) - 1)]
    valid = j.unsqueeze(0) < q_t.unsqueeze(1)
    uniform = (all(q == T for q in q_lens) and rows.numel() == B * T
               and bool((rows == torch.arange(B * T, device=dev)).all()))
    return TreeAttentionPlan(
        q_lens=q_lens, kv_lens=kv_lens, tree_size=T,
        block_table=meta.block_table.to(torch.int32).contiguous(),
        block_size=int(meta.block_size), intra_mask=intra, token_index=token_index,
        rows=rows, valid=valid, uniform=uniform)


def plan_uniform_batch(tree_size: int, kv_lens: Sequence[int], block_table: torch.Tensor,
                       block_size: int, tree: TreeVerifyRows | None = None) -> TreeAttentionPlan:
    """Plan of a whole uniform batch (every request has ``tree_size`` query tokens,
    back to back): the shape ACL graphs capture. Requests without a tree (and the
    dummy requests graph padding adds) are causal; tree requests take their masks
    from ``tree`` at the batch row their first token occupies.
    """
    T, B = int(tree_size), len(kv_lens)
    dev = block_table.device
    # Graph padding adds dummy requests whose KV length may be below T (even 0);
    # give them a context of 0 so every window and length stays well formed.
    kv_lens = [max(int(x), T) for x in kv_lens]
    intra = _causal(B, T, dev)
    if tree is not None and tree.rows.numel():
        tm = tree.meta.tree_mask.bool()
        if tm.shape[-1] != T:
            raise ValueError(f"uniform batch of {T} tokens per request, tree masks "
                             f"{tm.shape[-1]} wide")
        starts = tree.meta.query_start_loc[:-1].long()
        batch_row = torch.div(tree.rows.long()[starts], T, rounding_mode="floor")
        q_t = torch.full((tm.shape[0],), T, device=dev)
        intra[batch_row] = _pad_mask(tm, q_t)
    rows = torch.arange(B * T, device=dev)
    return TreeAttentionPlan(
        q_lens=[T] * B, kv_lens=[int(x) for x in kv_lens], tree_size=T,
        block_table=block_table[:B].to(torch.int32).contiguous(), block_size=int(block_size),
        intra_mask=intra, token_index=rows.view(B, T),
        rows=rows, valid=torch.ones(B, T, dtype=torch.bool, device=dev), uniform=True)


def pad_plan(plan: TreeAttentionPlan, tree_size: int) -> TreeAttentionPlan:
    """The same plan with T raised to ``tree_size`` (the static 1 + num_nodes the
    persistent buffers are sized for). New rows/columns are padding."""
    T0, T = plan.tree_size, int(tree_size)
    if T == T0:
        return plan
    if T < T0:
        raise ValueError(f"cannot shrink a plan from T={T0} to {T}")
    B, dev = plan.batch_size, plan.intra_mask.device
    intra = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
    intra[:, :T0, :T0] = plan.intra_mask
    q_t = torch.tensor(plan.q_lens, device=dev)
    intra = _pad_mask(intra, q_t)
    extra = plan.token_index[:, -1:].expand(B, T - T0)
    return dataclasses.replace(
        plan, tree_size=T, intra_mask=intra,
        token_index=torch.cat([plan.token_index, extra], dim=1),
        valid=torch.arange(T, device=dev).unsqueeze(0) < q_t.unsqueeze(1),
        uniform=plan.uniform and all(q == T for q in plan.q_lens),
        serial=next(_plan_serial))


def check_plan_invariants(plan: TreeAttentionPlan, num_blocks: int | None = None) -> None:
    """Host-side checks of a plan (reference mode and tests); raises ValueError
    naming the request. Synchronising: never on the fused hot path."""
    B, T = plan.batch_size, plan.tree_size
    cap = plan.block_table.shape[1] * plan.block_size
    mask = plan.intra_mask.cpu()
    table = plan.block_table.cpu()
    eye = torch.eye(T, dtype=torch.bool)
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    for b in range(B):
        q, kv = plan.q_lens[b], plan.kv_lens[b]
        if not 1 <= q <= T:
            raise ValueError(f"request {b}: {q} query tokens, expected 1..{T}")
        if kv - q < 1:
            raise ValueError(f"request {b}: KV length {kv} leaves no committed context "
                             f"before its {q} query tokens (the root's predecessor)")
        if kv > cap:
            raise ValueError(f"request {b}: KV length {kv} exceeds the block table's "
                             f"{cap} slots")
        m = mask[b, :q, :q]
        if not bool(m.diagonal().all()):
            raise ValueError(f"request {b}: a query token does not see itself")
        if bool((m & upper[:q, :q]).any()):
            raise ValueError(f"request {b}: a token sees a later token (parents must "
                             f"precede children)")
        if bool(mask[b, q:].any()) and not bool(
                (mask[b, q:] == eye[0].unsqueeze(0)).all()):
            raise ValueError(f"request {b}: padding rows must see token 0 only")
        if num_blocks is not None:
            used = table[b, : (kv + plan.block_size - 1) // plan.block_size]
            if bool(((used < 0) | (used >= num_blocks)).any()):
                raise ValueError(f"request {b}: block table points outside the "
                                 f"{num_blocks}-block cache")
    if plan.rows.numel() != plan.num_rows:
        raise ValueError(f"{plan.rows.numel()} rows for {plan.num_rows} query tokens")
    if plan.rows.unique().numel() != plan.rows.numel():
        raise ValueError("two tree tokens map to the same query row")


# -------------------------------------------------------------- persistent buffers
class TreeAttentionBuffers:
    """Persistent masks, padded queries and outputs, shared by all layers.

    Masks depend only on the step, so they are written once per plan (the first
    layer) and reused by every layer; graph replay finds them at fixed addresses.
    """

    def __init__(self, max_reqs: int, tree_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype, device, max_blocks: int,
                 block_size: int = ASCEND_BLOCK_SIZE):
        self.max_reqs, self.T = int(max_reqs), int(tree_size)
        self.H, self.KVH, self.D = num_heads, num_kv_heads, head_size
        self.dtype, self.device = dtype, torch.device(device)
        self.max_blocks, self.block_size = int(max_blocks), int(block_size)
        R, T = self.max_reqs, self.T
        # Full-mask windows: request slot b's tree columns start at window_ctx[b]
        # and repeat the last of window_len[b] nodes. (0, 1) = column 0, already 0.
        self.window_ctx = torch.zeros(R, dtype=torch.long, device=self.device)
        self.window_len = torch.ones(R, dtype=torch.long, device=self.device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._written: dict[str, int] = {}

    def fits(self, batch_size: int, tree_size: int) -> bool:
        return batch_size <= self.max_reqs and tree_size == self.T

    def _get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             fill: int | None = None) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            t = (torch.zeros(shape, dtype=dtype, device=self.device) if fill == 0
                 else torch.empty(shape, dtype=dtype, device=self.device))
            self._tensors[name] = t
        return t

    def _causal_tiles(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A mask buffer that starts as causal T x T tiles: well-formed for a
        uniform batch before any step wrote it (e.g. while a graph is captured)."""
        t = self._tensors.get(name)
        if t is None:
            T = self.T
            tile = torch.ones(T, T, dtype=torch.int8, device=self.device).triu(1)
            t = tile.repeat(self.max_reqs, 1).reshape(shape).contiguous()
            self._tensors[name] = t
        return t

    # ---- masks ------------------------------------------------------------
    @property
    def full_mask_columns(self) -> int:
        return self.max_blocks * self.block_size

    def full_mask(self, plan: TreeAttentionPlan) -> torch.Tensor:
        """int8 [B, 1, T, max_blocks*block] for ``full_mask`` (1 = masked)."""
        R, T, C = self.max_reqs, self.T, self.full_mask_columns
        buf = self._get("full_mask", (R, 1, T, C), torch.int8, fill=0)
        if self._written.get("full_mask") != plan.serial:
            self._rewrite_windows(buf, plan)
            self._written["full_mask"] = plan.serial
        return buf[: plan.batch_size]

    def _rewrite_windows(self, buf: torch.Tensor, plan: TreeAttentionPlan) -> None:
        # Invariant: everything outside the current windows is 0 (visible), which
        # is right for every context column; columns at or past a request's KV
        # length are ignored by FIA. A step clears each slot's previous window and
        # writes the new one: O(B*T*T) bytes, independent of the context length.
        # Window column j shows node min(j, q-1): duplicates carry equal values,
        # so the scatter is deterministic and never touches a column >= ctx+q.
        B, T = plan.batch_size, self.T
        dev = buf.device
        j = torch.arange(T, device=dev).unsqueeze(0)
        view = buf[:B, 0]                                               # [B, T, C]
        old_len = self.window_len[:B].unsqueeze(1)
        old = self.window_ctx[:B].unsqueeze(1) + torch.minimum(j, old_len - 1)
        view.scatter_(2, old.unsqueeze(1).expand(B, T, T), 0)
        ctx = torch.tensor(plan.ctx_lens, dtype=torch.long, device=dev)
        ql = torch.tensor(plan.q_lens, dtype=torch.long, device=dev)
        node = torch.minimum(j, ql.unsqueeze(1) - 1)                     # [B, T]
        masked = (~plan.intra_mask).to(torch.int8)
        vals = torch.gather(masked, 2, node.unsqueeze(1).expand(B, T, T))
        view.scatter_(2, (ctx.unsqueeze(1) + node).unsqueeze(1).expand(B, T, T), vals)
        self.window_ctx[:B] = ctx
        self.window_len[:B] = ql

    def pair_mask(self, plan: TreeAttentionPlan) -> torch.Tensor:
        """int8 [B, 1, T, T] among a request's own query tokens (1 = masked)."""
        buf = self._causal_tiles("pair_mask", (self.max_reqs, 1, self.T, self.T))
        B = plan.batch_size
        if self._written.get("pair_mask") != plan.serial:
            buf[:B, 0].copy_(~plan.intra_mask)
            self._written["pair_mask"] = plan.serial
        return buf[:B]

    def flat_tree_mask(self, plan: TreeAttentionPlan) -> torch.Tensor:
        """int8 (sum q_i^2,) for sparse_mode 9 in TND: request blocks back to back."""
        T = self.T
        buf = self._causal_tiles("flat_mask", (self.max_reqs * T * T,))
        total = sum(q * q for q in plan.q_lens)
        if self._written.get("flat_mask") != plan.serial:
            masked = (~plan.intra_mask).to(torch.int8)
            if plan.uniform:
                buf[:total].copy_(masked.reshape(-1))
            else:
                dev = masked.device
                q = torch.tensor(plan.q_lens, device=dev)
                sq = q * q
                b = torch.repeat_interleave(torch.arange(len(plan.q_lens), device=dev), sq,
                                            output_size=total)
                r = torch.arange(total, device=dev) - (torch.cumsum(sq, 0) - sq)[b]
                buf[:total].copy_(masked[b, torch.div(r, q[b], rounding_mode="floor"), r % q[b]])
            self._written["flat_mask"] = plan.serial
        return buf[:total]

    def mark_written(self, plan: TreeAttentionPlan) -> None:
        """Treat every mask as already holding ``plan``'s content. Used while an ACL
        graph is being captured: the mask writes must stay outside the graph (the
        replay-time update rewrites the masks for each step), so the captured calls
        just reference the persistent storage."""
        for name in ("full_mask", "pair_mask", "flat_mask"):
            self._written[name] = plan.serial

    # ---- padded activations --------------------------------------------------
    def padded(self, name: str, heads: int) -> torch.Tensor:
        return self._get(name, (self.max_reqs, self.T, heads, self.D), self.dtype)

    def lse(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._get(name, shape, torch.float32)


# ---------------------------------------------------------------- call builders
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
    with the log-sum-exp the merge needs."""
    return OpCall(FIA, (query_tnd, paged_kv(key_cache), paged_kv(value_cache)), dict(
        block_table=block_table, input_layout="TND", block_size=key_cache.shape[1],
        actual_seq_lengths=list(cu_q_lens), actual_seq_lengths_kv=list(prefix_lens),
        num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        sparse_mode=SPARSE_DEFAULT_MASK, softmax_lse_flag=True), "prefix")


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
    paged cache the KV lengths are per request (not cumulative)."""
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


# -------------------------------------------------------------------- executors
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
    else:
        raise ValueError(f"unknown Ascend tree-attention variant {variant!r}; "
                         f"expected one of {VARIANTS}")


def run_draft_level(ops: Any, md: DraftTreeLevelMetadata, query: torch.Tensor,
                    side_key: torch.Tensor, side_value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor,
                    heads: HeadConfig, output: torch.Tensor) -> None:
    """One tree-drafting level: the B*F frontier queries see their paged prefix
    (``prefix_len`` entries) and, in the dense side buffer, the entries their
    ``side_mask`` allows (ancestors and themselves). Two passes + LSE merge.

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
    q = query[: B * F]
    table = md.block_table[:B].to(torch.int32).contiguous()
    p_out, p_lse = prefix_call(q, key_cache, value_cache, table,
                               [F * (b + 1) for b in range(B)], prefix, H, KVH, s)(ops)
    t_out, t_lse = dense_masked_call(q.view(B, F, H, D), side_key, side_value, side_mask,
                                     [F] * B, [hi] * B, H, KVH, s)(ops)
    M = B * F * H
    merged, _ = merge_call(
        [p_lse.reshape(M).contiguous(),
         t_lse.view(B, H, F).permute(0, 2, 1).reshape(M).contiguous()],
        [p_out.reshape(M, D).float(), t_out.reshape(M, D).float()])(ops)
    out = output.view(output.shape[0], H, D)
    out[: B * F] = merged.view(B * F, H, D).to(out.dtype)


# ------------------------------------------------------------------ ACL graphs
@dataclasses.dataclass
class CapturedCall:
    """A tree-attention call captured in an ACL graph, re-issued at each replay
    with the step's host lengths (the device tensors are the captured ones)."""

    call: OpCall
    outs: list[torch.Tensor]
    workspace: torch.Tensor
    handle: Any
    event: Any


def capture_issuer(ops: Any, npu: Any, records: list[CapturedCall],
                   weak_ref: Callable[[Any], Any] = lambda t: t) -> Callable:
    """Issuer for :func:`run_tree_verify` during graph capture (torch_npu's
    task-group protocol, as vllm-ascend's own FIA capture uses it): each FIA call
    gets its max workspace, waits on an external event the replay-time update
    records, runs as ``.out`` into the persistent ``outs``, and is recorded.
    Calls without ``outs`` (the LSE merge) are captured as ordinary ops.

    ops: torch_npu; npu: torch.npu; weak_ref: vllm-ascend's ``weak_ref_tensors``
    (keeps the records from pinning graph-pool memory).
    """

    def issue(call: OpCall, outs: Sequence[torch.Tensor] | None = None):
        if outs is None:
            return call(ops)
        workspace = getattr(ops, f"_{call.op}_get_max_workspace")(*call.args, **call.kwargs)
        stream = ops.npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        getattr(ops, call.op).out(*call.args, **call.kwargs, workspace=workspace, out=list(outs))
        handle = npu.graph_task_group_end(stream)
        ref = OpCall(call.op, tuple(weak_ref(a) if isinstance(a, torch.Tensor) else a
                                    for a in call.args),
                     {k: weak_ref(v) if isinstance(v, torch.Tensor) else v
                      for k, v in call.kwargs.items()}, call.role)
        records.append(CapturedCall(ref, [weak_ref(o) for o in outs], workspace, handle, event))
        return outs[0], outs[1]

    return issue


def update_captured(ops: Any, npu: Any, records: Sequence[CapturedCall],
                    plan: TreeAttentionPlan, buffers: TreeAttentionBuffers, variant: str,
                    update_stream: Any, block_table: torch.Tensor | None = None) -> None:
    """Before a replay runs its attention: rewrite the persistent masks for this
    step, then re-issue every captured call with this step's lengths and record
    its event (the captured task waits for it). Runs on ``update_stream``."""
    with npu.stream(update_stream):
        if variant == FULL_MASK:
            buffers.full_mask(plan)
        elif variant == TWO_PASS:
            buffers.pair_mask(plan)
        elif variant == TREE_SPARSE:
            buffers.flat_tree_mask(plan)
        for rec in records:
            kwargs = rec.call.step_kwargs(plan)
            if block_table is not None and "block_table" in kwargs:
                kwargs["block_table"] = block_table
            npu.graph_task_update_begin(update_stream, rec.handle)
            getattr(ops, rec.call.op).out(*rec.call.args, **kwargs, workspace=rec.workspace,
                                          out=rec.outs)
            npu.graph_task_update_end(update_stream)
            rec.event.record(update_stream)


# ------------------------------------------------------------------- settings
EXEC_MODE_ENV = "VLLM_TREESPEC_EXEC_MODE"            # "fused" | "reference"
VARIANT_ENV = "VLLM_TREESPEC_ASCEND_VARIANT"         # one of VARIANTS
FULL_GRAPH_ENV = "VLLM_TREESPEC_ASCEND_FULL_GRAPH"   # "1": capture tree verify in ACL graphs


@dataclasses.dataclass(frozen=True)
class AscendTreeSettings:
    exec_mode: str        # "fused" or "reference"
    variant: str          # requested fused variant
    full_graph: bool      # capture tree verify in FULL ACL graphs


def resolve_settings(config_exec_mode: str, environ: dict[str, str]) -> AscendTreeSettings:
    """Settings from the tree config and the environment (the environment wins,
    so a deployment can switch to the debuggable path without editing its
    config). Errors name the variable, the value and what is allowed."""
    from vllm_treespec.config import EXEC_MODES, TreeSpecConfigError

    exec_mode = environ.get(EXEC_MODE_ENV) or config_exec_mode
    if exec_mode not in EXEC_MODES:
        raise TreeSpecConfigError(f"eagle3_tree: ${EXEC_MODE_ENV} has invalid value "
                                  f"{exec_mode!r}; allowed: {' or '.join(map(repr, EXEC_MODES))}")
    variant = environ.get(VARIANT_ENV) or FULL_MASK
    if variant not in VARIANTS:
        raise TreeSpecConfigError(f"eagle3_tree: ${VARIANT_ENV} has invalid value "
                                  f"{variant!r}; allowed: {', '.join(map(repr, VARIANTS))}")
    flag = environ.get(FULL_GRAPH_ENV, "0")
    if flag not in ("0", "1"):
        raise TreeSpecConfigError(f"eagle3_tree: ${FULL_GRAPH_ENV} has invalid value "
                                  f"{flag!r}; allowed: '0' or '1'")
    return AscendTreeSettings(exec_mode, variant, flag == "1")


# --------------------------------------------------------- synthetic verify batches
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


def make_verify_batch(seed: int, kinds: Sequence[str], tree_size: int, num_heads: int,
                      num_kv_heads: int, head_size: int, dtype: torch.dtype = torch.float32,
                      device="cpu", max_ctx: int = 300, block_size: int = ASCEND_BLOCK_SIZE,
                      full_trees: bool = False) -> SyntheticBatch:
    """Build a random mixed verify batch (see :class:`SyntheticBatch`)."""
    from vllm_treespec.tree import TreeBatch, tree_mask  # pure torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    T = tree_size
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
        ctx.append(rng.randint(1, max_ctx))
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
    compare. C is used only when this returns ok; the reason is logged."""
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
