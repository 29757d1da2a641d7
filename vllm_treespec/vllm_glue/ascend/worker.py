"""The graph-mode NPU worker selected in tree mode (``parallel_config.worker_cls``).

Owns ``TreeNPUWorker``: ``NPUWorker`` whose runner is
:func:`~vllm_treespec.vllm_glue.ascend.runner.tree_npu_runner_class`'s, with the
start-up checks (supported device and configuration), the ACL graph mode fit
(FULL graphs become piecewise unless the tree capture is enabled) and the choice
of fused variant (the ``tree_sparse`` probe). Imports torch_npu and vllm_ascend
at module level, :mod:`.backend` and :mod:`.runner`, the tree config and
:mod:`vllm_treespec.attention.ascend`'s constants, settings and startup probe.
"""

from __future__ import annotations

import logging

import torch
import torch_npu  # this module only loads on Ascend installs
from vllm.config import CUDAGraphMode
from vllm_ascend.worker.worker import NPUWorker

from vllm_treespec.attention.ascend.constants import FULL_MASK, TREE_SPARSE
from vllm_treespec.attention.ascend.settings import FULL_GRAPH_ENV, AscendTreeSettings
from vllm_treespec.attention.ascend.synthetic import probe_tree_sparse
from vllm_treespec.config import TreeSpecConfigError
from vllm_treespec.vllm_glue import runner_class_swapped, support, versions
from vllm_treespec.vllm_glue.ascend import checks
from vllm_treespec.vllm_glue.ascend.backend import (
    install_backend,
    record_tree_mode,
    set_active_variant,
    settings_from_config,
)
from vllm_treespec.vllm_glue.ascend.runner import tree_npu_runner_class

logger = logging.getLogger("vllm.treespec")


def _installed(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_supported(vllm_config) -> None:
    from vllm_ascend.utils import is_310p

    npu = _installed("torch-npu") or getattr(torch_npu, "__version__", None)
    release = versions.installed_release()
    support.check_ascend_pairing(release, _installed("vllm-ascend"), npu)
    checks.check_cann(release, getattr(torch.version, "cann", None))
    checks.check_engine(vllm_config)
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


def _fit_graph_mode(vllm_config, settings: AscendTreeSettings) -> None:
    """FULL graphs replay attention as captured; without the tree capture path
    they would replay causal attention for trees. Keep piecewise graphs (attention
    runs eagerly, through this backend) unless the tree capture is enabled."""
    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        return
    if settings.full_graph and settings.exec_mode == "fused":
        logger.warning("eagle3_tree: capturing tree verify in FULL ACL graphs ($%s=1); "
                       "validate with `vllm-treespec npu-check` first", FULL_GRAPH_ENV)
        return
    new = CUDAGraphMode.PIECEWISE if mode.has_piecewise_cudagraphs() else CUDAGraphMode.NONE
    logger.info("eagle3_tree: ACL graph mode %s -> %s (tree attention runs outside graphs; "
                "$%s=1 captures it)", mode, new, FULL_GRAPH_ENV)
    cc.cudagraph_mode = new


def _select_variant(worker, settings: AscendTreeSettings) -> str:
    variant = settings.variant
    if settings.exec_mode != "fused" or variant != TREE_SPARSE:
        return variant
    cfg = worker.vllm_config
    mc, pc = cfg.model_config, cfg.parallel_config
    result = probe_tree_sparse(
        torch_npu, worker.device, mc.dtype, mc.get_num_attention_heads(pc),
        mc.get_num_kv_heads(pc), mc.get_head_size(),
        1 + cfg.speculative_config.num_speculative_tokens)
    if result.ok:
        logger.info("eagle3_tree: tree_sparse enabled: %s", result.reason)
        return variant
    logger.warning("eagle3_tree: tree_sparse (sparse_mode=9) disabled on this device, "
                   "using full_mask: %s", result.reason)
    return FULL_MASK


class TreeNPUWorker(NPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        self.tree_settings = settings_from_config(vllm_config)
        _check_supported(vllm_config)
        _fit_graph_mode(vllm_config, self.tree_settings)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self):
        import vllm_ascend.worker.worker as npu_worker

        record_tree_mode()
        install_backend()
        with runner_class_swapped(npu_worker, "NPUModelRunner", tree_npu_runner_class,
                                  self):
            super().init_device()
        variant = _select_variant(self, self.tree_settings)
        set_active_variant(variant)
        logger.info("eagle3_tree on Ascend: exec_mode %s, variant %s",
                    self.tree_settings.exec_mode, variant)
