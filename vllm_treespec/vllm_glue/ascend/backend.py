"""The tree attention backend inside vllm-ascend, and its per-process state.

``TreeAscendAttentionBackend`` / ``TreeAscendAttentionImpl`` /
``TreeAscendMetadataBuilder``: vllm-ascend's GQA attention with tree rows, and
:func:`install_backend`, which makes ``NPUPlatform.get_attn_backend_cls`` answer
this backend in tree mode.

Execution modes (``exec_mode`` in the tree config, overridable by
``$VLLM_TREESPEC_EXEC_MODE``):

* ``fused``: the torch_npu calls of :mod:`vllm_treespec.attention.ascend`:
  ``full_mask`` (default), ``two_pass``, or ``tree_sparse`` (``sparse_mode=9``,
  used only if the startup probe agrees with ``full_mask`` on this device;
  otherwise ``full_mask`` with the reason logged), chosen by
  ``$VLLM_TREESPEC_ASCEND_VARIANT``. When every token of a batch is a tree token
  the stock kernel is skipped; otherwise it runs for all rows and the tree rows
  are recomputed.
* ``reference``: stock kernel, then the tree rows recomputed by the eager
  reference on NPU tensors, with plan invariants checked each step.

ACL graphs: in tree mode FULL graphs are replaced by piecewise ones (attention
then runs eagerly, always through this backend) unless
``$VLLM_TREESPEC_ASCEND_FULL_GRAPH=1``, which captures the fused tree call for
uniform verify batches and re-issues it at replay through
``update_graph_params``. That path follows torch_npu's task-update protocol as
vllm-ascend uses it but has not run on hardware here: validate it with
``vllm-treespec npu-check`` first.

Owns the per-process state (active variant, persistent buffers, captured calls).
Imports torch_npu and vllm_ascend at module level; from this project: the
attention interface and :mod:`vllm_treespec.attention.ascend` (buffers, constants,
executors, graphs, plans, settings), the tree config and its error, and the glue's
backend-cache clearing and ``spec_config``; nothing else of ``vllm_glue.ascend``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch_npu  # this module only loads on Ascend installs
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm_ascend.ascend_forward_context import _EXTRA_CTX
from vllm_ascend.attention.attention_v1 import (
    AscendAttentionBackend,
    AscendAttentionBackendImpl,
    AscendAttentionMetadataBuilder,
)

from vllm_treespec.attention import (
    DraftTreeLevelMetadata,
    TreeVerifyRows,
    paged_tree_attention,
    prefix_side_attention,
)
from vllm_treespec.attention.ascend.buffers import TreeAttentionBuffers
from vllm_treespec.attention.ascend.constants import ASCEND_BLOCK_SIZE, FULL_MASK
from vllm_treespec.attention.ascend.execute import HeadConfig, run_draft_level, run_tree_verify
from vllm_treespec.attention.ascend.graphs import CapturedCall, capture_issuer, update_captured
from vllm_treespec.attention.ascend.plans import (
    TreeAttentionPlan,
    check_plan_invariants,
    pad_plan,
    plan_tree_rows,
    plan_uniform_batch,
)
from vllm_treespec.attention.ascend.settings import (
    FULL_GRAPH_ENV,
    AscendTreeSettings,
    resolve_settings,
)
from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import forget_resolved_backends
from vllm_treespec.vllm_glue.ascend import checks
from vllm_treespec.vllm_glue.draft_level import DraftLevelAttention
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

# vllm-ascend's metadata builder asserts 1 + num_speculative_tokens <= 16 ("FIA TND
# layout's limit"); see TreeAscendMetadataBuilder for why tree mode lifts it.
FIA_TND_DECODE_LIMIT = 16
STOCK_GQA_BACKEND = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"

# Per worker process: the fused variant in use (after the startup probe), the
# shared persistent buffers, and the calls captured in FULL ACL graphs.
_ACTIVE_VARIANT: str | None = None
_BUFFERS: dict[tuple, TreeAttentionBuffers] = {}
_GRAPH_RECORDS: dict[int, list[CapturedCall]] = {}
_GRAPH_BUFFERS: dict[int, TreeAttentionBuffers] = {}


def set_active_variant(variant: str) -> None:
    """Record the fused variant this worker process uses (after the startup probe)."""
    global _ACTIVE_VARIANT
    _ACTIVE_VARIANT = variant


def settings_from_config(vllm_config) -> AscendTreeSettings:
    cfg = tree_config_from_vllm(vllm_config)
    return resolve_settings(cfg.exec_mode if cfg else "fused", dict(os.environ))


def kv_pair(kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as [blocks, 128, KVH, D]: vllm-ascend stores a
    (K, V) pair per layer; a stacked ``(2, blocks, 128, KVH, D)`` tensor works too."""
    if isinstance(kv_cache, (tuple, list)) or (isinstance(kv_cache, torch.Tensor)
                                                 and kv_cache.dim() == 5):
        return kv_cache[0], kv_cache[1]
    raise TypeError(f"unexpected Ascend KV cache {type(kv_cache).__name__}")


# Recorded by the tree worker when it starts (``record_tree_mode``), not guessed
# from whichever config is current when a layer asks for its backend: a lookup
# that failed once answered "stock backend" while tree rows were scheduled.
# The runner then checks every layer's backend (``support.check_tree_backends``).
_TREE_MODE = False


def record_tree_mode() -> None:
    """This process serves ``eagle3_tree``: layers get the tree backend."""
    global _TREE_MODE
    _TREE_MODE = True


def _tree_mode() -> bool:
    return _TREE_MODE


def install_backend() -> None:
    """Wrap ``NPUPlatform.get_attn_backend_cls`` (idempotent)."""
    from vllm_ascend.platform import NPUPlatform

    current = NPUPlatform.get_attn_backend_cls
    if getattr(current, "_treespec_wrapped", False):
        return
    original = current.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        path = original(cls, selected_backend, attn_selector_config, num_heads)
        if not _tree_mode():
            return path
        if path == STOCK_GQA_BACKEND:
            return f"{__name__}.TreeAscendAttentionBackend"
        raise TreeSpecConfigError(
            f"eagle3_tree on Ascend supports models served by vllm-ascend's GQA/MHA "
            f"attention ({STOCK_GQA_BACKEND}); this model selects {path}")

    get_attn_backend_cls._treespec_wrapped = True  # type: ignore[attr-defined]
    NPUPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    forget_resolved_backends()


def tree_buffers(vllm_config, heads: HeadConfig, tree_size: int, dtype: torch.dtype,
                 device) -> TreeAttentionBuffers:
    """The process's persistent buffers for one head shape and dtype (one device per
    process, so the device is not part of the key: a profiling-time reservation
    and the first step must find the same buffers)."""
    key = (heads.num_heads, heads.num_kv_heads, heads.head_size, dtype, tree_size)
    buf = _BUFFERS.get(key)
    if buf is None:
        block = ASCEND_BLOCK_SIZE
        buf = TreeAttentionBuffers(
            max_reqs=vllm_config.scheduler_config.max_num_seqs + 2, tree_size=tree_size,
            num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads,
            head_size=heads.head_size, dtype=dtype, device=device,
            max_blocks=-(-vllm_config.model_config.max_model_len // block), block_size=block)
        _BUFFERS[key] = buf
    return buf


def reserve_for_profiling(layers: dict, device) -> int:
    """Allocate every tree layer's persistent buffers (shared across layers of one
    head shape) before vLLM measures its profiling run's peak; returns the bytes
    held, which then count as non-KV memory."""
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if isinstance(impl, TreeAscendAttentionImpl):
            impl.reserve_tree_buffers(device)
    return sum(b.allocated_bytes() for b in _BUFFERS.values())


@contextlib.contextmanager
def _speculative_tokens_presented_as(spec, value: int):
    real = spec.num_speculative_tokens
    object.__setattr__(spec, "num_speculative_tokens", value)
    try:
        yield
    finally:
        object.__setattr__(spec, "num_speculative_tokens", real)


class TreeAscendMetadataBuilder(AscendAttentionMetadataBuilder):
    """The stock builder, with the ``1 + num_speculative_tokens <= 16`` assertion
    lifted in tree mode.

    Why that is safe here: the limit guards the stock kernels' handling of verify
    rows. In tree mode every verify row (the tree requests' tokens) is computed by
    the tree backend with BSND or TND calls whose query length per request has no
    such limit in torch_npu's documentation (the 1..16 range applies to MLA and
    to quantised NZ KV). When a batch also holds prefill chunks, the stock call
    still covers all rows with its TND ``sparse_mode=3`` call, the same call it
    makes for chunked prefill of any length, and the tree rows are then
    overwritten. ``num_nodes`` stays bounded by the tree config (<= 256).
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        spec = vllm_config.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        if spec is None or 1 + k <= FIA_TND_DECODE_LIMIT:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        with _speculative_tokens_presented_as(spec, FIA_TND_DECODE_LIMIT - 1):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.decode_threshold = 1 + k
        self.reorder_batch_threshold = self.decode_threshold


class TreeAscendAttentionImpl(DraftLevelAttention, AscendAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        checks.check_layer_arguments(AscendAttentionBackendImpl.__init__, args, kwargs)
        if getattr(self, "enable_c8_quant", False):
            checks.check_quantised_kv(self.vllm_config.quant_config, None)
        self.tree_settings = settings_from_config(self.vllm_config)
        spec = self.vllm_config.speculative_config
        self.tree_size = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.tree_heads = HeadConfig(self.num_heads, self.num_kv_heads,
                                     self.head_size, self.scale)

    @property
    def tree_variant(self) -> str:
        return _ACTIVE_VARIANT or FULL_MASK

    def _buffers(self, dtype: torch.dtype, device) -> TreeAttentionBuffers:
        return tree_buffers(self.vllm_config, self.tree_heads, self.tree_size, dtype, device)

    def reserve_tree_buffers(self, device) -> int:
        """Allocate this layer's persistent buffers for the active variant now
        (called in vLLM's profiling run, see ``reserve_for_profiling``); bytes held."""
        if self.tree_settings.exec_mode != "fused":
            return 0
        return self._buffers(self.vllm_config.model_config.dtype, device).reserve(
            self.tree_variant)

    def _step_plan(self, tree: TreeVerifyRows,
                   buffers: TreeAttentionBuffers) -> TreeAttentionPlan:
        # One plan per step, kept in the scratch every layer shares.
        plan = tree.scratch.get("ascend_plan")
        if plan is None:
            plan = pad_plan(plan_tree_rows(tree), buffers.T)
            checks.check_step_fits(plan, buffers, self.vllm_config)
            if plan.block_table.shape[1] > buffers.max_blocks:
                # Columns past max_model_len's blocks are never referenced (checked above).
                plan.block_table = plan.block_table[:, : buffers.max_blocks].contiguous()
            tree.scratch["ascend_plan"] = plan
        return plan

    # ---------------------------------------------------------------- forward
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, DraftTreeLevelMetadata):
            return self._draft_level(query, key, value, kv_cache, attn_metadata, output)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def forward_impl(self, query, key, value, kv_cache, attn_metadata, output):
        if self._captures_tree(attn_metadata):
            return self._capture_tree(query, key, value, kv_cache, attn_metadata, output)
        tree: TreeVerifyRows | None = getattr(attn_metadata, "tree_verify", None)
        if tree is None or tree.rows.numel() == 0:
            return super().forward_impl(query, key, value, kv_cache, attn_metadata, output)
        k_cache, v_cache = kv_pair(kv_cache)
        if self.tree_settings.exec_mode == "reference":
            output = super().forward_impl(query, key, value, kv_cache, attn_metadata, output)
            if not tree.scratch.get("ascend_checked"):
                buffers = self._buffers(query.dtype, query.device)
                check_plan_invariants(self._step_plan(tree, buffers),
                                      num_blocks=k_cache.shape[0])
                tree.scratch["ascend_checked"] = True
            q = query[tree.rows].view(-1, self.num_heads, self.head_size)
            out = paged_tree_attention(q, k_cache, v_cache, tree.meta, self.scale)
            output.view(output.shape[0], self.num_heads, self.head_size)[tree.rows] = (
                out.to(output.dtype))
            return output
        buffers = self._buffers(query.dtype, query.device)
        plan = self._step_plan(tree, buffers)
        if not tree.covers_batch:  # prefill/decode rows too: stock kernel for all rows
            output = super().forward_impl(query, key, value, kv_cache, attn_metadata, output)
        run_tree_verify(torch_npu, self.tree_variant, plan, buffers, query, key,
                        value, k_cache, v_cache, self.tree_heads, output)
        return output

    def _attend_level(self, q, side_key, side_value, kv_cache, md: DraftTreeLevelMetadata):
        k_cache, v_cache = kv_pair(kv_cache)
        if self.tree_settings.exec_mode == "reference":
            hi = md.side_offset + md.width
            return prefix_side_attention(q, k_cache, v_cache, md.block_table, md.block_size,
                                         md.prefix_len, side_key[:, :hi], side_value[:, :hi],
                                         md.side_mask, self.scale, md.max_prefix_len)
        return run_draft_level(torch_npu, md, q, side_key, side_value, k_cache, v_cache,
                               self.tree_heads)

    # ------------------------------------------------------------- ACL graphs
    def _captures_tree(self, md) -> bool:
        """A FULL-graph capture of a uniform verify batch in tree mode."""
        if not (_EXTRA_CTX.capturing and self.tree_settings.full_graph
                and self.tree_settings.exec_mode == "fused") or _EXTRA_CTX.is_draft_model:
            return False
        if get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.FULL:
            return False
        cu = list(md.actual_seq_lengths_q)
        lens = [b - a for a, b in zip([0] + cu[:-1], cu)]
        if not lens or max(lens) <= 1:
            return False  # a plain decode graph: nothing tree-shaped to capture
        if any(n != self.tree_size for n in lens):
            raise RuntimeError(
                f"eagle3_tree: FULL ACL graph capture of a verify batch with query lengths "
                f"{sorted(set(lens))}; the tree capture needs every request at 1 + "
                f"num_speculative_tokens = {self.tree_size} tokens (uniform verify "
                f"batches). Fix: unset ${FULL_GRAPH_ENV} (tree attention then runs "
                f"eagerly between piecewise graphs), or keep the compilation config's "
                f"cudagraph_capture_sizes to multiples of {self.tree_size}")
        return True

    def _capture_tree(self, query, key, value, kv_cache, md, output):
        k_cache, v_cache = kv_pair(kv_cache)
        T = self.tree_size
        B = len(md.actual_seq_lengths_q)
        buffers = self._buffers(query.dtype, query.device)
        table = md.block_tables[:B]
        plan = plan_uniform_batch(T, md.seq_lens_list[:B], table,
                                  ASCEND_BLOCK_SIZE)
        buffers.mark_written(plan)  # masks are written by update_graph_params, never captured
        from vllm_ascend.utils import weak_ref_tensors

        records = _GRAPH_RECORDS.setdefault(B * T, [])
        _GRAPH_BUFFERS[B * T] = buffers
        issue = capture_issuer(torch_npu, torch.npu, records, weak_ref_tensors)
        run_tree_verify(torch_npu, self.tree_variant, plan, buffers, query, key,
                        value, k_cache, v_cache, self.tree_heads, output, issue=issue)
        return output

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens, vllm_config,
                            speculative_config=None, draft_attn_metadatas=None):
        records = None if _EXTRA_CTX.is_draft_model else _GRAPH_RECORDS.get(num_tokens)
        if not records:
            return AscendAttentionBackendImpl.update_graph_params(
                update_stream, forward_context, num_tokens, vllm_config, speculative_config,
                draft_attn_metadatas=draft_attn_metadatas)
        md = next(m for m in forward_context.attn_metadata.values()
                  if hasattr(m, "seq_lens_list"))
        spec = vllm_config.speculative_config
        T = 1 + spec.num_speculative_tokens
        B = num_tokens // T
        buffers = _GRAPH_BUFFERS[num_tokens]
        plan = plan_uniform_batch(T, md.seq_lens_list[:B], md.block_tables[:B],
                                  ASCEND_BLOCK_SIZE,
                                  getattr(md, "tree_verify", None))
        update_captured(torch_npu, torch.npu, records, plan, buffers,
                        _ACTIVE_VARIANT or FULL_MASK, update_stream,
                        block_table=md.block_tables[:B])


class TreeAscendAttentionBackend(AscendAttentionBackend):
    """vllm-ascend's GQA backend with tree rows; identical otherwise."""

    @staticmethod
    def get_impl_cls() -> type[TreeAscendAttentionImpl]:
        from vllm_ascend.attention.utils import enable_dcp, enable_pcp

        if enable_pcp() or enable_dcp():
            raise TreeSpecConfigError("eagle3_tree on Ascend does not support prefill/decode "
                                      "context parallelism")
        return TreeAscendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeAscendMetadataBuilder]:
        return TreeAscendMetadataBuilder
