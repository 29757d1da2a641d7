"""Persistent device buffers of the tree attention: masks, padded queries, outputs.

Static shapes: a uniform verify batch (every request has ``T`` query tokens laid
out back to back, the case ACL graphs capture) is viewed as BSND without any
copy; masks, padded queries and outputs live in :class:`TreeAttentionBuffers`,
allocated once.

Owns :class:`TreeAttentionBuffers`. Imports :mod:`.constants`, :mod:`.documented` and
:mod:`.plans`.
"""

from __future__ import annotations

import math

import torch

from vllm_treespec.attention.ascend.constants import (
    ASCEND_BLOCK_SIZE,
    FULL_MASK,
    TREE_SPARSE,
    TRITON,
    TWO_PASS,
)
from vllm_treespec.attention.ascend.documented import check_documented
from vllm_treespec.attention.ascend.plans import TreeAttentionPlan

# The persistent tensors each fused variant touches (shapes: ``_shapes``). ``triton``
# keeps none: its per-row ancestor words are built per step and do not grow with context.
_USES = {
    FULL_MASK: ("full_mask", "q_pad", "out_pad", "lse_unused"),
    TWO_PASS: ("pair_mask", "prefix_out", "prefix_lse", "q_pad", "k_pad", "v_pad",
               "out_pad", "tree_lse"),
    TREE_SPARSE: ("flat_mask", "prefix_out", "lse_unused"),
    TRITON: (),
}


class TreeAttentionBuffers:
    """Persistent masks, padded queries and outputs, shared by all layers.

    Masks depend only on the step, so they are written once per plan (the first
    layer) and reused by every layer; graph replay finds them at fixed addresses.
    """

    def __init__(self, max_reqs: int, tree_size: int, num_heads: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype, device, max_blocks: int,
                 block_size: int = ASCEND_BLOCK_SIZE):
        self.max_reqs, self.T = int(max_reqs), int(tree_size)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.dtype, self.device = dtype, torch.device(device)
        self.max_blocks, self.block_size = int(max_blocks), int(block_size)
        R = self.max_reqs
        # Full-mask windows: request slot b's tree columns start at window_ctx[b]
        # and repeat the last of window_len[b] nodes. (0, 1) = column 0, already 0.
        self.window_ctx = torch.zeros(R, dtype=torch.long, device=self.device)
        self.window_len = torch.ones(R, dtype=torch.long, device=self.device)
        self._tensors: dict[str, torch.Tensor] = {}
        self._written: dict[str, int] = {}

    # ---- memory -------------------------------------------------------------
    def _shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        R, T, H, KVH, D, dt = (self.max_reqs, self.T, self.num_heads, self.num_kv_heads,
                               self.head_size, self.dtype)
        return {"full_mask": ((R, 1, T, self.full_mask_columns), torch.int8),
                "pair_mask": ((R, 1, T, T), torch.int8),
                "flat_mask": ((R * T * T,), torch.int8),
                "q_pad": ((R, T, H, D), dt), "out_pad": ((R, T, H, D), dt),
                "prefix_out": ((R, T, H, D), dt),
                "k_pad": ((R, T, KVH, D), dt), "v_pad": ((R, T, KVH, D), dt),
                "prefix_lse": ((R * T, H, 1), torch.float32),
                "tree_lse": ((R, H, T, 1), torch.float32),
                "lse_unused": ((1,), torch.float32)}

    def reserved_bytes(self, variant: str) -> int:
        """Bytes :meth:`reserve` allocates for ``variant`` (docs/ascend.md, Memory)."""
        shapes = self._shapes()
        return sum(math.prod(shapes[n][0]) * shapes[n][1].itemsize for n in _USES[variant])

    def reserve(self, variant: str) -> int:
        """Allocate every persistent tensor ``variant`` uses now, so that vLLM's
        profiling run counts them before it sizes the KV cache (a lazy first
        allocation at the first tree step would come out of the KV cache's share).
        Returns the bytes held for ``variant``.

        It is also the startup step that knows the variant, head size and dtype
        together, so a variant whose calls torch_npu's docs do not cover for them
        is refused here, by name (:func:`.documented.check_documented`)."""
        check_documented(variant, self.head_size, self.dtype)
        shapes = self._shapes()
        for name in _USES[variant]:
            shape, dtype = shapes[name]
            if name in ("pair_mask", "flat_mask"):
                self._causal_tiles(name, shape)
            else:
                self._get(name, shape, dtype, fill=0 if name == "full_mask" else None)
        return self.reserved_bytes(variant)

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

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
        return self._get(name, (self.max_reqs, self.T, heads, self.head_size), self.dtype)

    def lse(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self._get(name, shape, torch.float32)
