"""The plan of a verify step: lengths, masks and row maps shared by every layer.

Owns :class:`TreeAttentionPlan` and the functions that build, pad and check it
(:func:`plan_tree_rows`, :func:`plan_uniform_batch`, :func:`pad_plan`,
:func:`check_plan_invariants`). Pure torch; imports only
:mod:`vllm_treespec.attention.metadata` (nothing else from this package).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from vllm_treespec.attention.metadata import TreeVerifyRows

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
    # The ``triton`` variant's per-row bitmask metadata, built by the first layer
    # that needs it (kernels.tree_attention.TreeRowMetadata).
    kernel_rows: object | None = dataclasses.field(default=None, compare=False)

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
        serial=next(_plan_serial), kernel_rows=None)


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
