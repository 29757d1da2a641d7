"""Tree speculation inside vllm-ascend (targets vllm-ascend main of 2026-08-22 with
vLLM 0.27.1). Imported only by the NPU worker, i.e. only when the platform is an
Ascend NPU and the speculative method is ``eagle3_tree``: CPU installs never
import this module, torch_npu or vllm_ascend.

What it adds to vllm-ascend, all selected in tree mode only:

* ``TreeAscendAttentionBackend`` / ``TreeAscendAttentionImpl`` /
  ``TreeAscendMetadataBuilder``: vllm-ascend's GQA attention with tree rows.
  vllm-ascend's ``NPUPlatform.get_attn_backend_cls`` ignores the requested
  backend, so :func:`install_backend` wraps it (idempotently, in the worker, after
  every plugin has loaded) to answer this backend when the engine is in tree
  mode and the stock answer is the GQA backend.
* ``TreeNPUWorker``: ``NPUWorker`` whose runner is ``NPUModelRunner`` + the
  device-agnostic ``TreeRunnerMixin`` (swapped in for ``init_device`` only, as
  the CPU worker does), with the drafter built on vllm-ascend's EAGLE proposer.

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
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch_npu  # this module only loads on Ascend installs
from vllm.config import CUDAGraphMode, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm_ascend.ascend_forward_context import _EXTRA_CTX
from vllm_ascend.attention.attention_v1 import (
    AscendAttentionBackend,
    AscendAttentionBackendImpl,
    AscendAttentionMetadataBuilder,
)
from vllm_ascend.worker.worker import NPUWorker

from vllm_treespec.attention import (
    DraftTreeLevelMetadata,
    TreeVerifyRows,
    paged_tree_attention,
    prefix_side_attention,
)
from vllm_treespec.attention import ascend as tree_npu
from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue.spec_config import tree_config_from_vllm

logger = logging.getLogger("vllm.treespec")

# vllm-ascend's metadata builder asserts 1 + num_speculative_tokens <= 16 ("FIA TND
# layout's limit"); see TreeAscendMetadataBuilder for why tree mode lifts it.
FIA_TND_DECODE_LIMIT = 16
STOCK_GQA_BACKEND = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"

# Per worker process: the fused variant in use (after the startup probe), the
# shared persistent buffers, and the calls captured in FULL ACL graphs.
_ACTIVE_VARIANT: str | None = None
_BUFFERS: dict[tuple, tree_npu.TreeAttentionBuffers] = {}
_GRAPH_RECORDS: dict[int, list[tree_npu.CapturedCall]] = {}
_GRAPH_BUFFERS: dict[int, tree_npu.TreeAttentionBuffers] = {}


def _settings(vllm_config) -> tree_npu.AscendTreeSettings:
    cfg = tree_config_from_vllm(vllm_config)
    return tree_npu.resolve_settings(cfg.exec_mode if cfg else "fused", dict(os.environ))


def kv_pair(kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer as [blocks, 128, KVH, D]: vllm-ascend stores a
    (K, V) pair per layer; a stacked ``(2, blocks, 128, KVH, D)`` tensor works too."""
    if isinstance(kv_cache, (tuple, list)) or (isinstance(kv_cache, torch.Tensor)
                                                 and kv_cache.dim() == 5):
        return kv_cache[0], kv_cache[1]
    raise TypeError(f"unexpected Ascend KV cache {type(kv_cache).__name__}")


# ------------------------------------------------------------------- backend
def _tree_mode() -> bool:
    try:
        return tree_config_from_vllm(get_current_vllm_config()) is not None
    except Exception:  # no current config: not inside an engine
        return False


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
    try:  # a backend resolved earlier in this process must not stay cached
        from vllm.v1.attention import selector
        selector._cached_get_attn_backend.cache_clear()
    except AttributeError:
        pass


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


class TreeAscendAttentionImpl(AscendAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.sliding_window is not None or self.sinks is not None:
            raise TreeSpecConfigError(
                "eagle3_tree on Ascend does not support sliding-window or attention-sink "
                "layers yet (the tree mask would need the window too)")
        self.tree_settings = _settings(self.vllm_config)
        spec = self.vllm_config.speculative_config
        self.tree_size = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        self.tree_heads = tree_npu.HeadConfig(self.num_heads, self.num_kv_heads,
                                              self.head_size, self.scale)
        self._side_kv: torch.Tensor | None = None

    @property
    def tree_variant(self) -> str:
        return _ACTIVE_VARIANT or tree_npu.FULL_MASK

    def _buffers(self, dtype: torch.dtype, device) -> tree_npu.TreeAttentionBuffers:
        key = (self.num_heads, self.num_kv_heads, self.head_size, dtype, str(device))
        buf = _BUFFERS.get(key)
        if buf is None:
            cfg = self.vllm_config
            block = tree_npu.ASCEND_BLOCK_SIZE
            buf = tree_npu.TreeAttentionBuffers(
                max_reqs=cfg.scheduler_config.max_num_seqs + 2, tree_size=self.tree_size,
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_size=self.head_size, dtype=dtype, device=device,
                max_blocks=-(-cfg.model_config.max_model_len // block), block_size=block)
            _BUFFERS[key] = buf
        return buf

    def _step_plan(self, tree: TreeVerifyRows,
                   buffers: tree_npu.TreeAttentionBuffers) -> tree_npu.TreeAttentionPlan:
        # One plan per step, kept in the scratch every layer shares.
        plan = tree.scratch.get("ascend_plan")
        if plan is None:
            plan = tree_npu.pad_plan(tree_npu.plan_tree_rows(tree), buffers.T)
            if plan.block_table.shape[1] > buffers.max_blocks:
                plan.block_table = plan.block_table[:, : buffers.max_blocks].contiguous()
            if not buffers.fits(plan.batch_size, plan.tree_size):
                raise RuntimeError(f"eagle3_tree: {plan.batch_size} trees of {plan.tree_size} "
                                   f"tokens exceed the Ascend buffers ({buffers.max_reqs} x "
                                   f"{buffers.T})")
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
                tree_npu.check_plan_invariants(self._step_plan(tree, buffers),
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
        tree_npu.run_tree_verify(torch_npu, self.tree_variant, plan, buffers, query, key,
                                 value, k_cache, v_cache, self.tree_heads, output)
        return output

    def _draft_level(self, query, key, value, kv_cache, md: DraftTreeLevelMetadata, output):
        B, F, D, KVH = md.batch_size, md.width, self.head_size, self.num_kv_heads
        side = self._side_kv
        if (side is None or side.shape[1] < B or side.shape[2] < md.side_capacity
                or side.dtype != key.dtype):
            side = torch.zeros(2, B, md.side_capacity, KVH, D, dtype=key.dtype,
                               device=key.device)
            self._side_kv = side
        lo, hi = md.side_offset, md.side_offset + F
        side[0, :B, lo:hi] = key[: B * F].view(B, F, KVH, D)
        side[1, :B, lo:hi] = value[: B * F].view(B, F, KVH, D)
        k_cache, v_cache = kv_pair(kv_cache)
        if self.tree_settings.exec_mode == "reference":
            q = query[: B * F].view(B, F, self.num_heads, D)
            out = prefix_side_attention(q, k_cache, v_cache, md.block_table, md.block_size,
                                        md.prefix_len, side[0, :B, :hi], side[1, :B, :hi],
                                        md.side_mask, self.scale, md.max_prefix_len)
            output[: B * F] = out.reshape((B * F,) + output.shape[1:]).to(output.dtype)
            return output
        tree_npu.run_draft_level(torch_npu, md, query, side[0, :B], side[1, :B], k_cache,
                                 v_cache, self.tree_heads, output)
        return output

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
                f"{sorted(set(lens))}, expected all {self.tree_size}; unset "
                f"${tree_npu.FULL_GRAPH_ENV} to run tree attention outside graphs")
        return True

    def _capture_tree(self, query, key, value, kv_cache, md, output):
        k_cache, v_cache = kv_pair(kv_cache)
        T = self.tree_size
        B = len(md.actual_seq_lengths_q)
        buffers = self._buffers(query.dtype, query.device)
        table = md.block_tables[:B]
        plan = tree_npu.plan_uniform_batch(T, md.seq_lens_list[:B], table,
                                           tree_npu.ASCEND_BLOCK_SIZE)
        buffers.mark_written(plan)  # masks are written by update_graph_params, never captured
        from vllm_ascend.utils import weak_ref_tensors

        records = _GRAPH_RECORDS.setdefault(B * T, [])
        _GRAPH_BUFFERS[B * T] = buffers
        issue = tree_npu.capture_issuer(torch_npu, torch.npu, records, weak_ref_tensors)
        tree_npu.run_tree_verify(torch_npu, self.tree_variant, plan, buffers, query, key,
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
        plan = tree_npu.plan_uniform_batch(T, md.seq_lens_list[:B], md.block_tables[:B],
                                           tree_npu.ASCEND_BLOCK_SIZE,
                                           getattr(md, "tree_verify", None))
        tree_npu.update_captured(torch_npu, torch.npu, records, plan, buffers,
                                 _ACTIVE_VARIANT or tree_npu.FULL_MASK, update_stream,
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


# -------------------------------------------------------------------- runner
class _NPURunnerKVLayout:
    def _kv_views(self, cache):
        return kv_pair(cache)

    def _tree_proposer_class(self) -> type:
        return tree_ascend_proposer_class()


class _NPUPrepareInputsOuter:
    """NPUModelRunner._prepare_inputs returns (logits_indices, spec_metadata,
    total_tokens); the tree mixin speaks vLLM's two-value form. This class sits
    outside the mixin and restores the third value for NPUModelRunner's caller."""

    def _prepare_inputs(self, *args, **kwargs):
        logits_indices, spec_md = super()._prepare_inputs(*args, **kwargs)
        return (logits_indices, spec_md, *self._npu_prepare_extra)


class _NPUPrepareInputsInner:
    """Sits between the tree mixin and NPUModelRunner (see the outer class)."""

    def _prepare_inputs(self, *args, **kwargs):
        logits_indices, spec_md, *extra = super()._prepare_inputs(*args, **kwargs)
        self._npu_prepare_extra = tuple(extra)
        return logits_indices, spec_md


def tree_npu_runner_class(base: type) -> type:
    from vllm_treespec.vllm_glue.runner import TreeRunnerMixin

    return type("TreeNPUModelRunner", (_NPURunnerKVLayout, _NPUPrepareInputsOuter,
                                       TreeRunnerMixin, _NPUPrepareInputsInner, base), {})


def tree_ascend_proposer_class() -> type:
    """The tree drafter on vllm-ascend's EAGLE proposer (its model loading,
    buffers and graph handling), adapted to the two places its interface differs
    from vLLM's: the runner calls ``_propose`` with extra keywords, and
    ``set_inputs_first_pass`` returns a fourth value (context-parallel args)."""
    from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer

    from vllm_treespec.vllm_glue.proposer import TreeEagleProposer

    class TreeAscendEagleProposer(TreeEagleProposer, AscendEagleProposer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # The catch-up pass builds its own CommonAttentionMetadata; whether
            # vllm-ascend's metadata builder accepts it has not been run on an NPU,
            # so the drafter keeps running every step there (the old behaviour).
            self.defer_when_off = False

        def set_inputs_first_pass(self, *args, **kwargs):
            num_tokens, token_indices_to_sample, cad, *_ = super().set_inputs_first_pass(
                *args, **kwargs)
            return num_tokens, token_indices_to_sample, cad

        def _propose(self, num_speculative_tokens, target_token_ids, target_positions,
                     target_hidden_states, next_token_ids, token_indices_to_sample,
                     common_attn_metadata, target_model_batch_desc=None,
                     sampling_metadata=None, mm_embed_inputs=None,
                     num_rejected_tokens_gpu=None, **_unused):
            return self.propose(num_speculative_tokens, target_token_ids, target_positions,
                                target_hidden_states, next_token_ids,
                                token_indices_to_sample, common_attn_metadata,
                                sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                                num_rejected_tokens_gpu=num_rejected_tokens_gpu)

    return TreeAscendEagleProposer


# -------------------------------------------------------------------- worker
def _check_supported(vllm_config) -> None:
    from vllm_ascend.utils import is_310p

    if is_310p():
        raise TreeSpecConfigError("eagle3_tree on Ascend needs an Atlas A2/A3 device "
                                  "(310P uses a different attention path)")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise TreeSpecConfigError("eagle3_tree on Ascend runs on model runner v1; unset "
                                  "VLLM_USE_V2_MODEL_RUNNER")
    parallel = vllm_config.parallel_config
    if (getattr(parallel, "prefill_context_parallel_size", 1) > 1
            or getattr(parallel, "decode_context_parallel_size", 1) > 1):
        raise TreeSpecConfigError("eagle3_tree on Ascend does not support context "
                                  "parallelism")


def _fit_graph_mode(vllm_config, settings: tree_npu.AscendTreeSettings) -> None:
    """FULL graphs replay attention as captured; without the tree capture path
    they would replay causal attention for trees. Keep piecewise graphs (attention
    runs eagerly, through this backend) unless the tree capture is enabled."""
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if settings.full_graph and settings.exec_mode == "fused":
        logger.warning("eagle3_tree: capturing tree verify in FULL ACL graphs ($%s=1); "
                       "validate with `vllm-treespec npu-check` first", tree_npu.FULL_GRAPH_ENV)
        return
    new = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() else CUDAGraphMode.NONE
    logger.info("eagle3_tree: ACL graph mode %s -> %s (tree attention runs outside graphs; "
                "$%s=1 captures it)", mode, new, tree_npu.FULL_GRAPH_ENV)
    cc.cudagraph_mode = new


def _select_variant(worker, settings: tree_npu.AscendTreeSettings) -> str:
    variant = settings.variant
    if settings.exec_mode != "fused" or variant != tree_npu.TREE_SPARSE:
        return variant
    cfg = worker.vllm_config
    mc, pc = cfg.model_config, cfg.parallel_config
    result = tree_npu.probe_tree_sparse(
        torch_npu, worker.device, mc.dtype, mc.get_num_attention_heads(pc),
        mc.get_num_kv_heads(pc), mc.get_head_size(),
        1 + cfg.speculative_config.num_speculative_tokens)
    if result.ok:
        logger.info("eagle3_tree: tree_sparse enabled: %s", result.reason)
        return variant
    logger.warning("eagle3_tree: tree_sparse (sparse_mode=9) disabled on this device, "
                   "using full_mask: %s", result.reason)
    return tree_npu.FULL_MASK


class TreeNPUWorker(NPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        self.tree_settings = _settings(vllm_config)
        _check_supported(vllm_config)
        _fit_graph_mode(vllm_config, self.tree_settings)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self):
        global _ACTIVE_VARIANT
        import vllm_ascend.worker.worker as npu_worker

        install_backend()
        stock_runner = npu_worker.NPUModelRunner
        npu_worker.NPUModelRunner = tree_npu_runner_class(stock_runner)
        try:
            super().init_device()
        finally:
            npu_worker.NPUModelRunner = stock_runner
        _ACTIVE_VARIANT = _select_variant(self, self.tree_settings)
        logger.info("eagle3_tree on Ascend: exec_mode %s, variant %s",
                    self.tree_settings.exec_mode, _ACTIVE_VARIANT)
